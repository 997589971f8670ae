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

/* out[r] = softmax(q_r . K[keys]) V[keys] for a sequence's nr rows and one head (see attn.c):
 * q (row stride qstride), L keys of which each row sees those < visible and the ones marked in
 * allowed (rows, L - visible) -- NULL: causal -- up to w->last[r], which the caller sets; K, V
 * (L, head_dim) in the cache's element type. */
typedef void (*attn_t)(const float *q, long qstride, long nr, long L, long visible, const unsigned char *allowed,
                       const void *K, const void *V, float scaling, attn_scratch *w, float *out, long ostride);

attn_t dt_attn_f32(long nv);  /* head_dim 16 * nv over a float32 cache, or NULL if not built */
attn_t dt_attn_bf16(long nv); /* ... over a bfloat16 cache */
#endif
