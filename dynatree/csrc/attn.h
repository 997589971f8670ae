/* The attention kernels of csrc/neox.c's forward (attn.c): one task per (sequence, head).
 * attn.c is compiled twice -- float32 caches, and with -DDT_KV_BF16 bfloat16 caches -- so the
 * two sets build side by side. */
#ifndef DT_ATTN_H
#define DT_ATTN_H

#define KEY_BLOCK_BYTES 16384 /* a block of keys (and one of values) that stays in L1 */

/* Scratch of one thread's attention tasks, sized for the longest sequence and most rows. */
typedef struct {
    float *s;   /* (rows, L + 16) scores, then softmax numerators */
    float *acc; /* (rows, 2, hd) value sums: even and odd key ordinals */
    float *inv; /* (rows,) 1 / softmax denominators */
    long *last, *par, *idx; /* (rows,) last key a row may see; its ordinal parity; (KB,) key list */
} attn_scratch;

/* out[r] = softmax(q_r . K[keys]) V[keys] for nr rows of a sequence over one kv head (see
 * attn.c): row r is token r / group's query of the group's (r % group)-th head, at q + (r / group)
 * * qstride + (r % group) * head_dim (group 1: one head's rows; more: grouped-query heads sharing
 * the kv head, scored together so each key is read once for all of them); L keys of which each
 * row sees those < visible and the ones its token may see in allowed (tokens, L - visible) --
 * NULL: causal -- up to w->last[r], which the caller sets; K, V (L, head_dim) in the cache's
 * element type, except the first ends[nshare - 1] keys (0 if nshare is 0), read in nshare pieces
 * from other buffers (a prompt prefix several sequences share, prefix.py: the same values, read
 * from one copy): key j of piece p (ends[p - 1] <= j < ends[p], ends[-1] = 0) at K0[p] + (j -
 * ends[p - 1]) * head_dim, its value likewise in V0[p]; out laid out like q (ostride per token). */
#define DT_MAX_PIECES 16
typedef void (*attn_t)(const float *q, long qstride, long group, long nr, long L, long visible,
                       const unsigned char *allowed, const void *K, const void *V, long nshare, const long *ends,
                       const void *const *K0, const void *const *V0, float scaling, attn_scratch *w, float *out,
                       long ostride);

attn_t dt_attn_f32(long nv);  /* head_dim 16 * nv over a float32 cache, or NULL if not built */
attn_t dt_attn_bf16(long nv); /* ... over a bfloat16 cache */
#endif
