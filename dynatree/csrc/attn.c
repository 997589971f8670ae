/* Batch-invariant attention over one sequence's KV cache for csrc/neox.c's forward.
 *
 * Compiled twice (native.py): for float32 caches, and with -DDT_KV_BF16 for bfloat16 caches whose
 * keys and values are widened in registers; the two builds run in parallel. */
#include <math.h>
#include <string.h>

#include "vec.h"
#include "attn.h"

/* Attention of one sequence's rows for one head: out[r] = softmax(q_r . K[keys]) V[keys] over
 * row r's allowed keys.  C16 = head_dim / 16 is a compile-time constant so accumulators live in
 * registers.
 *
 * Shared prefix: the rows of a sequence (tree nodes, prompt tokens) see mostly the same keys, so
 * keys are walked in blocks of KB and each block is scored and summed for every row while it sits
 * in L1 -- each key and value row is read from memory once per (sequence, head), not once per
 * row (at batch, re-reading the cache per row costs more than the weights).
 *
 * Batch invariance: the blocking only decides which rows share a load.  Per (row, key) the score
 * is the same chain (lanes over 16-dim chunks, then hsum16); sums over keys run over the row's
 * allowed keys in slot order, split two ways by the key's ordinal among them (carried across
 * blocks), so they depend only on which keys a row sees: a tree node and an AR step over the
 * same path add the same numbers in the same order.  The value sums run over the head dims in
 * blocks of NB registers (two sets of accumulators must fit 16 registers on AVX2). */
#define DIV_OR(n, d, r) ((n) % (d) == 0 ? (d) : (r))
#if DT_NREG >= 32
#define PV_BLOCK(n) ((n) <= 8 ? (n) : DIV_OR(n, 8, DIV_OR(n, 7, DIV_OR(n, 6, DIV_OR(n, 5, DIV_OR(n, 4, DIV_OR(n, 3, DIV_OR(n, 2, 1))))))))
#else
#define PV_BLOCK(n) ((n) <= 5 ? (n) : DIV_OR(n, 5, DIV_OR(n, 4, DIV_OR(n, 3, DIV_OR(n, 2, 1)))))
#endif

/* The end of the key block starting at j0 for a row that may see keys up to `last`. */
static inline long block_end(long j0, long kb, long last) { return j0 + kb < last + 1 ? j0 + kb : last + 1; }

/* The piece (attn_t) key j0 lies in, given the one before (nshare: the row's own cache), and where
 * the key block starting at j0 ends: KB keys on, but no block straddles a piece's end. */
static inline long piece_at(long j0, long p, long nshare, const long *ends) {
    while (p < nshare && j0 >= ends[p]) p++;
    return p;
}
static inline long next_block(long j0, long kb, long p, long nshare, const long *ends) {
    return p < nshare && j0 + kb > ends[p] ? ends[p] : j0 + kb;
}

/* Scores of R rows (q + r * qs) against keys j0..j1-1 into s + r * ss, KJ keys at a time: R * KJ
 * independent chains hide the FMA latency, and each key chunk loaded serves R rows.  Per (row,
 * key) the chain is always the same (lanes over 16-dim chunks in order, then hsum16). */
#define SCORES(C16, R, KJ, T, LDK, SUF)                                                                  \
    static void scores##R##_##C16##SUF(const float *q, long qs, const T *K, long j0, long j1, float scaling, \
                                       float *s, long ss) {                                              \
        enum { HD = 16 * C16 };                                                                          \
        long j = j0;                                                                                     \
        for (; j + KJ <= j1; j += KJ) {                                                                  \
            vf a[R][KJ][DT_L16];                                                                         \
            _Pragma("GCC unroll 2") for (int r = 0; r < R; r++)                                          \
                _Pragma("GCC unroll 8") for (int k = 0; k < KJ; k++)                                     \
                    _Pragma("GCC unroll 4") for (int l = 0; l < DT_L16; l++) a[r][k][l] = bc(0.f);       \
            _Pragma("GCC unroll 4") for (int c = 0; c < C16; c++)                                       \
                _Pragma("GCC unroll 4") for (int l = 0; l < DT_L16; l++)                                 \
                    _Pragma("GCC unroll 8") for (int k = 0; k < KJ; k++) {                               \
                        vf kc = LDK(K + (j + k) * HD + 16 * c + l * DT_W);                               \
                        _Pragma("GCC unroll 2") for (int r = 0; r < R; r++)                              \
                            a[r][k][l] = fmadd(ld(q + r * qs + 16 * c + l * DT_W), kc, a[r][k][l]);      \
                    }                                                                                    \
            float t[R * KJ];                                                                             \
            hsum16_n(&a[0][0][0], R * KJ, scaling, t);                                                   \
            _Pragma("GCC unroll 2") for (int r = 0; r < R; r++)                                          \
                _Pragma("GCC unroll 8") for (int k = 0; k < KJ; k++) s[r * ss + j + k] = t[r * KJ + k];  \
        }                                                                                                \
        for (; j < j1; j++)                                                                              \
            _Pragma("GCC unroll 2") for (int r = 0; r < R; r++) {                                        \
                vf a0[DT_L16];                                                                           \
                _Pragma("GCC unroll 4") for (int l = 0; l < DT_L16; l++) a0[l] = bc(0.f);                \
                _Pragma("GCC unroll 4") for (int c = 0; c < C16; c++)                                   \
                    _Pragma("GCC unroll 4") for (int l = 0; l < DT_L16; l++)                             \
                        a0[l] = fmadd(ld(q + r * qs + 16 * c + l * DT_W), LDK(K + j * HD + 16 * c + l * DT_W), a0[l]); \
                s[r * ss + j] = hsum16(a0) * scaling;                                                    \
            }                                                                                            \
    }
/* accumulators for the scores: half the registers (AVX-512 2 x 8 keys, AVX2 2 x 2, 128-bit 2 x 1) */
#define ACC_REGS (DT_NREG / 2)
#define KJ_FOR(R) (ACC_REGS / ((R) * DT_L16) >= 8 ? 8 : ACC_REGS / ((R) * DT_L16) >= 4 ? 4 : ACC_REGS / ((R) * DT_L16) >= 2 ? 2 : 1)

/* Row r of a task: token r / group's q vector of the group's (r % group)-th head. */
#define Q_ROW(r) (q + (r) / group * qstride + (r) % group * HD)

/* One head size's attention over a cache of element type T read with LDK (ld: float32, ld_bf16:
 * a bfloat16 cache widened in registers); SUF names the pair. */
#define ATTN_SEQ(C16, T, LDK, SUF)                                                                       \
    SCORES(C16, 1, KJ_FOR(1), T, LDK, SUF)                                                               \
    SCORES(C16, 2, KJ_FOR(2), T, LDK, SUF)                                                               \
    /* acc (2, HD) += the values of idx[0..cnt) weighted by e, continuing chains of parity par */        \
    static void values_##C16##SUF(const T *V, const float *e, const long *idx, long cnt, long par, float *acc) { \
        enum { HD = 16 * C16, NVEC = HD / DT_W, NB = PV_BLOCK(NVEC) };                                   \
        for (long b = 0; b < NVEC; b += NB) {                                                            \
            vf x0[NB], x1[NB];                                                                           \
            float *a0 = acc + b * DT_W, *a1 = acc + HD + b * DT_W;                                       \
            _Pragma("GCC unroll 16") for (int c = 0; c < NB; c++) { x0[c] = ld(a0 + c * DT_W); x1[c] = ld(a1 + c * DT_W); } \
            long c2 = 0;                                                                                 \
            if (par && cnt) { /* an odd ordinal first: it continues the odd chain */                     \
                vf b1 = bc(e[idx[0]]);                                                                   \
                const T *v1 = V + idx[0] * HD + b * DT_W;                                                \
                _Pragma("GCC unroll 16") for (int c = 0; c < NB; c++) x1[c] = fmadd(b1, LDK(v1 + c * DT_W), x1[c]); \
                c2 = 1;                                                                                  \
            }                                                                                            \
            for (; c2 + 2 <= cnt; c2 += 2) {                                                             \
                vf b0 = bc(e[idx[c2]]), b1 = bc(e[idx[c2 + 1]]);                                         \
                const T *v0 = V + idx[c2] * HD + b * DT_W, *v1 = V + idx[c2 + 1] * HD + b * DT_W;        \
                _Pragma("GCC unroll 16") for (int c = 0; c < NB; c++) {                                  \
                    x0[c] = fmadd(b0, LDK(v0 + c * DT_W), x0[c]);                                        \
                    x1[c] = fmadd(b1, LDK(v1 + c * DT_W), x1[c]);                                        \
                }                                                                                        \
            }                                                                                            \
            if (c2 < cnt) {                                                                              \
                vf b0 = bc(e[idx[c2]]);                                                                  \
                const T *v0 = V + idx[c2] * HD + b * DT_W;                                               \
                _Pragma("GCC unroll 16") for (int c = 0; c < NB; c++) x0[c] = fmadd(b0, LDK(v0 + c * DT_W), x0[c]); \
            }                                                                                            \
            _Pragma("GCC unroll 16") for (int c = 0; c < NB; c++) { st(a0 + c * DT_W, x0[c]); st(a1 + c * DT_W, x1[c]); } \
        }                                                                                                \
    }                                                                                                    \
    static void attn_seq_##C16##SUF(const float *q, long qstride, long group, long nr, long L, long visible, \
                               const unsigned char *allowed, const void *K_, const void *V_, long nshare, \
                               const long *ends, const void *const *K0, const void *const *V0, float scaling, \
                               attn_scratch *w, float *out, long ostride) {                              \
        enum { HD = 16 * C16, KB = KEY_BLOCK_BYTES / (HD * 4) > 8 ? KEY_BLOCK_BYTES / (HD * 4) : 8 };    \
        const T *K = (const T *)K_, *V = (const T *)V_;                                                  \
        long ss = L + 16, okstride = L - visible;                                                        \
        for (long j0 = 0, jn, p = 0; j0 < L; j0 = jn) {                                                  \
            p = piece_at(j0, p, nshare, ends);                                                           \
            /* key j at Kb + (j - o) * HD; its score at w->s + r * ss + j either way */                  \
            long o = p < nshare && p ? ends[p - 1] : 0;                                                  \
            const T *Kb = p < nshare ? (const T *)K0[p] : K;                                             \
            jn = next_block(j0, KB, p, nshare, ends);                                                    \
            for (long r = 0; r < nr;) {                                                                  \
                long j1 = block_end(j0, jn - j0, w->last[r]);                                            \
                long pair = r + 1 < nr && block_end(j0, jn - j0, w->last[r + 1]) == j1; /* same keys */ \
                const float *qr = Q_ROW(r);                                                              \
                if (j1 > j0 && pair) /* the two rows' q vectors, however far apart */                   \
                    scores2_##C16##SUF(qr, Q_ROW(r + 1) - qr, Kb, j0 - o, j1 - o, scaling, w->s + r * ss + o, ss); \
                else if (j1 > j0)                                                                        \
                    scores1_##C16##SUF(qr, 0, Kb, j0 - o, j1 - o, scaling, w->s + r * ss + o, ss);       \
                r += 1 + pair;                                                                           \
            }                                                                                            \
        }                                                                                                \
        for (long r = 0; r < nr; r++) softmax_row(w->s + r * ss, w->last[r], visible,                    \
                                                  allowed ? allowed + r / group * okstride : NULL, w->inv + r); \
        memset(w->acc, 0, sizeof(float) * (size_t)(nr * 2 * HD));                                        \
        memset(w->par, 0, sizeof(long) * (size_t)nr);                                                    \
        for (long j0 = 0, jn, p = 0; j0 < L; j0 = jn) {                                                  \
            p = piece_at(j0, p, nshare, ends);                                                           \
            long o = p < nshare && p ? ends[p - 1] : 0; /* value j at Vb + (j - o) * HD */               \
            const T *Vb = p < nshare ? (const T *)V0[p] : V;                                             \
            jn = next_block(j0, KB, p, nshare, ends);                                                    \
            for (long r = 0; r < nr; r++) {                                                              \
                const unsigned char *ok = allowed ? allowed + r / group * okstride : NULL;               \
                long j1 = block_end(j0, jn - j0, w->last[r]), cnt = 0;                                   \
                if (!ok || j1 <= visible) /* every key of the block allowed */                           \
                    for (long j = j0; j < j1; j++) w->idx[cnt++] = j - o;                                \
                else                                                                                     \
                    for (long j = j0; j < j1; j++)                                                       \
                        if (j < visible || ok[j - visible]) w->idx[cnt++] = j - o;                       \
                values_##C16##SUF(Vb, w->s + r * ss + o, w->idx, cnt, w->par[r], w->acc + r * 2 * HD);  \
                w->par[r] ^= cnt & 1;                                                                    \
            }                                                                                            \
        }                                                                                                \
        for (long r = 0; r < nr; r++) {                                                                  \
            const float *a = w->acc + r * 2 * HD;                                                        \
            vf inv = bc(w->inv[r]);                                                                      \
            float *o = out + r / group * ostride + r % group * HD;                                       \
            for (long c = 0; c < HD; c += DT_W) st(o + c, (ld(a + c) + ld(a + HD + c)) * inv);          \
        }                                                                                                \
    }

/* Row r's softmax over its scores s[0..last]: numerators exp(s - max) in place (over every key
 * up to last; the masked ones are never read) and 1 / (sum over allowed keys, even and odd
 * ordinals summed apart as the value sums are). */
static void softmax_row(float *s, long last, long visible, const unsigned char *ok, float *inv) {
    long full = ok && visible < last + 1 ? visible : last + 1; /* keys [0, full) are all allowed */
    float m = vmax_row(s, full); /* a max is exact in any order */
    for (long j = full; j <= last; j++)
        if (ok[j - visible] && s[j] > m) m = s[j];
    for (long j = 0; j <= last; j += DT_W) st(s + j, vexp(ld(s + j) - bc(m))); /* s has 16 spare */
    float s0 = 0.f, s1 = 0.f;
    long j = 0;
    for (; j + 2 <= full; j += 2) { s0 += s[j]; s1 += s[j + 1]; } /* ordinal == slot here */
    if (j < full) s0 += s[j++];
    for (long cnt = j, k = full; k <= last; k++)
        if (ok[k - visible]) {
            if (cnt++ & 1) s1 += s[k]; else s0 += s[k];
        }
    *inv = 1.f / (s0 + s1);
}

#ifdef DT_KV_BF16
#define ATTN_OF(C16) ATTN_SEQ(C16, unsigned short, ld_bf16, _bf16)
#define ENTRY dt_attn_bf16
#define PICK(n) attn_seq_##n##_bf16
#else
#define ATTN_OF(C16) ATTN_SEQ(C16, float, ld, _f32)
#define ENTRY dt_attn_f32
#define PICK(n) attn_seq_##n##_f32
#endif
ATTN_OF(1) ATTN_OF(2) ATTN_OF(3) ATTN_OF(4) ATTN_OF(5) ATTN_OF(6) ATTN_OF(7) ATTN_OF(8) ATTN_OF(10) ATTN_OF(12) ATTN_OF(16)

attn_t ENTRY(long nv) {
#define CASE(n) case n: return PICK(n);
    switch (nv) {
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(10) CASE(12) CASE(16)
    default: return 0;
    }
#undef CASE
}
