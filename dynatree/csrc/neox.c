/* A whole decoder forward on the CPU, float32, over the new tokens of one or several sequences,
 * each with its own KV cache: GPT-NeoX (Pythia; layer norms, GELU, parallel or sequential
 * residual) and the Llama family (Llama, Mistral, Qwen2, Qwen3: RMS norms, SwiGLU, grouped-query
 * attention, Qwen3's per-head q/k norms).  The fused QKV projection's output is laid out
 * [q of every head | k of every kv head | v of every kv head] (lean.py permutes NeoX's per-head
 * interleaving into it: each output is its own FMA chain, so the bits do not move).
 *
 * Why: at draft and verify sizes a layer is ~20 small torch ops (layer norms, rotary halves, cache
 * writes, SDPA, residual adds) whose dispatch costs more than their arithmetic; here the whole
 * forward, and the top-k or argmax the caller reads from its logits, is one call.
 *
 * Batch invariance (the point, beside speed): every value a row produces is computed by the
 * same operations in the same order whatever the number of rows n, so a tree node's logits are
 * bitwise the logits an AR step computes for the same prefix:
 *   - GEMMs: dt_gemm (one FMA chain per output over k in order);
 *   - layer norms: one row at a time, fixed order;
 *   - attention: each (row, head) walks its *allowed* keys in slot order (prefix, then ancestors
 *     in BFS order == depth order), skipping masked ones, so a node sees exactly the keys, in
 *     exactly the order, that an AR step over the same path sees;
 *   - several sequences packed in one forward: rows share the GEMMs' weight stream and nothing
 *     else (each attends to its own sequence's cache), so a row's logits are bitwise the same
 *     alone, in a tree, or beside other sequences' rows.
 *
 * Threads: one parallel region per forward; every step splits rows, (row, head) pairs or GEMM
 * output tiles between the threads (`omp for`), never a sum, so the thread count changes no bit.
 *
 * Parameters come as an array of pointers (see enum); weights are dt_gemm-packed.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "neox.h"
#include "vec.h"

/* Row statistics in double over NORM_LANES independent lanes (element j into lane j % NORM_LANES
 * of its block; a last partial block's elements into lanes 0, 1, ...), the lanes then folded
 * pairwise in a fixed order: the same order on every variant and compiler (plain C, no
 * reassociation asked of it), so the same bits everywhere and for a row alone or in any batch.
 * Why lanes: one double chain per statistic waited on each add's latency -- 0.57-0.67 us per
 * 512-float layer-norm row (0.83-0.86 us in the AVX2 build), ~5% of a prefill; 16 lanes, which the
 * compiler vectorizes, 0.11-0.16 us (AMD EPYC Zen 5, a C harness over 300 random rows). */
#define NORM_LANES 16
static inline double fold_lanes(double *a) {
    for (int h = NORM_LANES / 2; h >= 1; h /= 2)
        for (int k = 0; k < h; k++) a[k] += a[k + h];
    return a[0];
}

/* sum_j (x[j] - c) (square 0) or sum_j (x[j] - c)^2 (square 1) in double, over the lanes. */
static inline double lane_sum(const float *x, long d, double c, int square) {
    double q[NORM_LANES] = {0};
    long j = 0, whole = d - d % NORM_LANES;
    for (; j < whole; j += NORM_LANES)
        for (int k = 0; k < NORM_LANES; k++) {
            double e = x[j + k] - c;
            q[k] += square ? e * e : e;
        }
    for (; j < d; j++) {
        double e = x[j] - c;
        q[j - whole] += square ? e * e : e;
    }
    return fold_lanes(q);
}

/* y[i] = layer_norm(x[i]) for n rows of d; statistics in double over the lanes, one row at a
 * time (rows split between the calling threads). */
static void layer_norm(const float *x, long n, long d, const float *w, const float *b, float eps, float *y) {
#pragma omp for schedule(static)
    for (long i = 0; i < n; i++) {
        const float *xi = x + i * d;
        double mean = lane_sum(xi, d, 0.0, 0) / d, ss = lane_sum(xi, d, mean, 1);
        float m = (float)mean, rstd = (float)(1.0 / sqrt(ss / d + eps));
        for (long j = 0; j < d; j++) y[i * d + j] = (xi[j] - m) * rstd * w[j] + b[j];
    }
}

/* y[i] = x[i] * rstd * w (RMS norm; Llama's order: the normalised row, then the weight), sum of
 * squares in double over the lanes, one row at a time. */
static void rms_row(const float *x, long d, const float *w, float eps, float *y) {
    float rstd = (float)(1.0 / sqrt(lane_sum(x, d, 0.0, 1) / d + eps));
    for (long j = 0; j < d; j++) y[j] = w[j] * (x[j] * rstd);
}

/* The layer's norm (dims[NORM]) of n rows of d: rows split between the calling threads. */
static void norm(const long *dims, const float *x, long n, long d, const float *w, const float *b, float eps,
                 float *y) {
    if (dims[NORM] == NORM_RMS) {
#pragma omp for schedule(static)
        for (long i = 0; i < n; i++) rms_row(x + i * d, d, w, eps, y + i * d);
    } else {
        layer_norm(x, n, d, w, b, eps, y);
    }
}

/* NeoX partial rotary on the first rot dims of x (rotate_half convention).  Products rounded
 * before the sum, as torch's q * cos + rotate_half(q) * sin: left to the compiler, which product
 * it fuses into the add differs by target (x86 and aarch64 GCC builds parted by an ulp here;
 * tests/test_kernel_portable.py), and every variant must compute the same bits. */
DT_UNFUSED
static void rotate(float *x, long rot, const float *cos, const float *sin) {
    DT_UNFUSED_BODY
    long half = rot / 2;
    for (long j = 0; j < half; j++) {
        float x1 = x[j], x2 = x[j + half];
        float a = x1 * cos[j], b = x2 * sin[j], c = x2 * cos[j + half], d = x1 * sin[j + half];
        x[j] = a - b; /* (separate statements: see DT_UNFUSED) */
        x[j + half] = c + d;
    }
}

/* The attention of head_dim 16 * nv over a float32 (kvfmt 0) or bfloat16 (1) cache (attn.c). */
static attn_t attn_for(long nv, long kvfmt) { return kvfmt ? dt_attn_bf16(nv) : dt_attn_f32(nv); }

int dt_attn_supported(long head_dim) { return head_dim % 16 == 0 && dt_attn_f32(head_dim / 16) != 0; }

long dt_seq_bytes(void) { return (long)sizeof(dt_seq); }

/* Where each packed row belongs: its sequence and its index among that sequence's rows; where
 * each sequence's rows start. */
typedef struct {
    const dt_seq *seq;
    long nseq;
    long *of, *local, *start; /* (n,), (n,), (nseq,) */
} rowmap;

/* Attention of the packed rows: one task per (sequence, kv head), over that sequence's keys of
 * layer l (attn_seq), whose rows are every (token, q head) pair of the kv head's group: each key
 * is read once per group, not once per q head (grouped-query attention; GPT-NeoX's groups are one
 * head).  Same bits in any grouping: a row's attention does not depend on the rows beside it
 * (what makes tree rows AR rows).  q rows live in qkv (row stride (H + 2 KV) hd, head stride hd);
 * out: (n, H hd). */
static void attend(const long *dims, float scaling, const rowmap *rm, long l, const float *qkv, float *out,
                   attn_scratch *w) {
    long H = dims[HEADS], KV = dims[KV_HEADS], hd = dims[HEAD_DIM], ns = rm->nseq, group = H / KV;
    long qkvw = (H + 2 * KV) * hd, ow = H * hd;
    /* kv-head-major: a thread's consecutive tasks share one head's weights of attention work */
#pragma omp for schedule(static)
    for (long t = 0; t < ns * KV; t++) {
        long g = t / ns, q = t % ns, r0 = rm->start[q];
        const dt_seq *sq = rm->seq + q;
        long L = sq->past + sq->rows, nr = sq->rows * group;
        for (long r = 0; r < nr; r++) w->last[r] = sq->allowed ? L - 1 : sq->past + r / group;
        size_t elem = sq->kvfmt ? 2 : 4, at = (size_t)(g * sq->cap * hd) * elem; /* bytes to the kv head's keys */
        const void *k0[DT_MAX_PIECES], *v0[DT_MAX_PIECES];
        long np = sq->nshare < DT_MAX_PIECES ? sq->nshare : DT_MAX_PIECES; /* prefix.py sends no more */
        for (long p = 0; p < np; p++) {
            size_t ats = (size_t)(g * sq->scaps[p] * hd) * elem;
            k0[p] = (const char *)sq->ks[l * sq->nshare + p] + ats;
            v0[p] = (const char *)sq->vs[l * sq->nshare + p] + ats;
        }
        attn_for(hd / 16, sq->kvfmt)(qkv + r0 * qkvw + g * group * hd, qkvw, group, nr, L, sq->visible, sq->allowed,
                                     (const char *)sq->kc[l] + at, (const char *)sq->vc[l] + at, np, sq->ends, k0, v0,
                                     scaling, w, out + r0 * ow + g * group * hd, ow);
    }
}

/* Write n floats at element `at` of a cache buffer: as they are (float32) or rounded to the nearest
 * bfloat16, ties to even -- torch's float -> bfloat16 conversion, so the torch path's caches hold
 * the same values (no NaN ever reaches a cache of finite activations). */
static void put_kv(void *buf, long kvfmt, long at, const float *x, long n) {
    if (!kvfmt) {
        memcpy((float *)buf + at, x, sizeof(float) * (size_t)n);
        return;
    }
    unsigned short *o = (unsigned short *)buf + at;
    for (long i = 0; i < n; i++) {
        unsigned int b;
        memcpy(&b, x + i, 4);
        o[i] = (unsigned short)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
    }
}

/* Columns of fc1's output: [gate | up] for SwiGLU. */
static inline long fc1_width(const long *dims) { return dims[ACT] == ACT_SWIGLU ? 2 * dims[FF] : dims[FF]; }

/* The widest K of the model's GEMMs: d (q/k/v, fc1, head), H hd (attention output), ff (fc2). */
static long widest_k(const long *dims) {
    long k = dims[D_MODEL] > dims[HEADS] * dims[HEAD_DIM] ? dims[D_MODEL] : dims[HEADS] * dims[HEAD_DIM];
    return k > dims[FF] ? k : dims[FF];
}

/* Floats per packed row of the forward's work buffer before the bfloat16-compute buffer
 * (dt_neox_forward's layout: h, h2, a, z, then the scratch that block_in, the gated activation
 * and the head share). */
static long work_before_xconv(const long *dims) {
    long d = dims[D_MODEL], hd = dims[HEAD_DIM], H = dims[HEADS], KV = dims[KV_HEADS], ff = dims[FF];
    long scratch = d + (2 * H + 2 * KV) * hd;
    if (dims[ACT] == ACT_SWIGLU && ff > scratch) scratch = ff;
    return 3 * d + fc1_width(dims) + scratch;
}

/* Floats per packed row of the forward's work buffer: the layout above, then, for bfloat16
 * compute (dt_gemm's format 3), the GEMMs' rounded inputs (dt_bf16c_buffer_bytes, in floats). */
long dt_work_per_row(const long *dims) {
    return work_before_xconv(dims) + (dims[WFMT] == 3 ? dt_bf16c_buffer_bytes(1, widest_k(dims)) / 4 + 1 : 0);
}

/* First half of layer l.  h: (n, d) -> a: (n, d) attention output (plus h for a sequential
 * residual), z: (n, ff or 2 ff) fc1 pre-activation.  Writes each row's key/value at its
 * sequence's slot past + local index.  pos: (n,) positions or NULL (past + local index);
 * cos_t/sin_t: (max_pos, rot); work: the scratch (dt_work_per_row). */
static void block_in(const long *dims, float eps, float scaling, const float *const *p, long l, long n,
                      const rowmap *rm, const float *h, const long *pos, const float *cos_t, const float *sin_t,
                      float *a, float *z, float *work, attn_scratch *w, void *xconv) {
    long d = dims[D_MODEL], H = dims[HEADS], KV = dims[KV_HEADS], hd = dims[HEAD_DIM], rot = dims[ROT];
    long qw = H * hd, qkvw = (H + 2 * KV) * hd;
    float *x = work, *qkv = work + n * d, *att = qkv + n * qkvw;
    norm(dims, h, n, d, p[LN1_W], p[LN1_B], eps, x);
    dt_gemm_for(x, n, d, p[QKV_W], (int)dims[WFMT], p[QKV_B], qkv, qkvw, xconv);
#pragma omp for schedule(static)
    for (long i = 0; i < n; i++) {
        const dt_seq *sq = rm->seq + rm->of[i];
        long slot = sq->past + rm->local[i], at = pos ? pos[i] : slot;
        const float *c = cos_t + at * rot, *sn = sin_t + at * rot;
        float *row = qkv + i * qkvw;
        for (long hh = 0; hh < H; hh++) {
            if (p[QN_W]) rms_row(row + hh * hd, hd, p[QN_W], eps, row + hh * hd);
            rotate(row + hh * hd, rot, c, sn);
        }
        for (long g = 0; g < KV; g++) {
            float *k = row + qw + g * hd, *v = row + qw + KV * hd + g * hd;
            if (p[KN_W]) rms_row(k, hd, p[KN_W], eps, k);
            rotate(k, rot, c, sn);
            put_kv(sq->kc[l], sq->kvfmt, (g * sq->cap + slot) * hd, k, hd);
            put_kv(sq->vc[l], sq->kvfmt, (g * sq->cap + slot) * hd, v, hd);
        }
    }
    attend(dims, scaling, rm, l, qkv, att, w);
    dt_gemm_for(att, n, qw, p[OUT_W], (int)dims[WFMT], p[OUT_B], a, d, xconv);
    if (dims[PARALLEL]) {
        norm(dims, h, n, d, p[LN2_W], p[LN2_B], eps, x);
    } else {
#pragma omp for schedule(static)
        for (long i = 0; i < n; i++)
            for (long j = i * d; j < (i + 1) * d; j++) a[j] += h[j];
        norm(dims, a, n, d, p[LN2_W], p[LN2_B], eps, x);
    }
    dt_gemm_for(x, n, d, p[FC1_W], (int)dims[WFMT], p[FC1_B], z, fc1_width(dims), xconv);
}

/* Second half.  g: (n, ff) activated fc1 output -> out: (n, d) = fc2(g) + a (+ h if parallel). */
static void block_out(const long *dims, const float *const *p, long n, const float *g, const float *a,
                       const float *h, float *out, void *xconv) {
    long d = dims[D_MODEL];
    dt_gemm_for(g, n, dims[FF], p[FC2_W], (int)dims[WFMT], p[FC2_B], out, d, xconv);
#pragma omp for schedule(static)
    for (long i = 0; i < n; i++)
        for (long j = i * d; j < (i + 1) * d; j++) out[j] = dims[PARALLEL] ? (out[j] + a[j]) + h[j] : out[j] + a[j];
}

/* erf by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), the formula torch's AVX-512 GELU uses. */
static inline vf verf(vf x) {
    vi sign = (vi)x & (vi)bc(-0.f);
    vf ax = (vf)((vi)x & ~(vi)bc(-0.f));
    vf t = bc(1.f) / (bc(0.3275911f) * ax + bc(1.f));
    vf r = bc(1.061405429f);
    r = r * t + bc(-1.453152027f);
    r = r * t + bc(1.421413741f);
    r = r * t + bc(-0.284496736f);
    r = r * t + bc(0.254829592f);
    vf y = bc(1.f) - r * t * vexp(-(ax * ax));
    return (vf)((vi)y | sign);
}

/* z: (n, ff) fc1 output -> activated in place; SWIGLU: z (n, 2 ff) [gate | up] -> g (n, ff).
 * Returns the fc2 input. */
static float *activate(int act, float *z, long n, long ff, float *g) {
    if (act == ACT_SWIGLU) {
#pragma omp for schedule(static)
        for (long i = 0; i < n; i++)
            for (long j = 0; j < ff; j += DT_W) {
                vf x = ld(z + i * 2 * ff + j), up = ld(z + i * 2 * ff + ff + j);
                st(g + i * ff + j, x / (bc(1.f) + vexp(-x)) * up);
            }
        return g;
    }
#pragma omp for schedule(static)
    for (long j = 0; j < n * ff; j += DT_W) {
        vf x = ld(z + j);
        if (act == ACT_GELU)
            x = bc(0.5f) * x * (bc(1.f) + verf(x * bc(0.70710678118654752f)));
        else
            x = vsel(x > bc(0.f), x, bc(0.f));
        st(z + j, x);
    }
    return z;
}

/* A whole forward over the new tokens of nseq sequences packed into n = sum(rows) rows:
 * embedding, every layer (each sequence's cache slots past .. past + rows - 1 written), final
 * layer norm and LM head for each sequence's last `keep` rows.
 *   dims: NDIM longs; p: nlayers * NPARAM pointers; head: {final_ln_w, final_ln_b, packed lm head};
 *   ids, pos: (n,) (pos NULL: past + index within the sequence); seqs: see dt_seq;
 *   logits: (sum keep, VOCAB_PAD), sequence by sequence; work: >= n * dt_work_per_row(dims) floats.
 * Heads over the first `cols` logits of each kept row: topk > 0 -> softmax top-k into top_vals,
 * top_ids (sum keep, topk); topk < 0 -> argmax into top_ids (sum keep,); 0 -> none.
 * Every row is computed as it would be alone (batch invariance: see the top of this file), so a
 * sequence's logits do not depend on what else is packed with it.
 * Returns 0, or 1 (nothing computed) if a token id is outside the embedding. */
static void argmax_rows(const float *logits, long n, long V, long stride, long *out);
static void softmax_topk_rows(const float *logits, long n, long V, long stride, long k, float *vals, long *ids);
static void perturb_row(float *x, long V, float inv_temp, const float *g);

/* A forward's scratch, or a message and an abort: a NULL used later would be a silent segfault. */
static void *must_alloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "dynatree native kernel: out of memory allocating %zu bytes of forward scratch\n", bytes);
        abort();
    }
    return p;
}

int dt_neox_forward(const long *dims, float eps, float scaling, long nlayers, const float *const *p,
                     const float *embed, const float *const *head, const long *ids, long n, const long *pos,
                     const float *cos_t, const float *sin_t, const dt_seq *seqs, long nseq, float *logits,
                     float *work, int threads, long cols, long topk, float *top_vals, long *top_ids) {
    long d = dims[D_MODEL], ff = dims[FF], hd = dims[HEAD_DIM], kept = 0, most = 0, span = 0;
    for (long i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= dims[EMBED_ROWS]) return 1;
    rowmap rm = {seqs, nseq, must_alloc(sizeof(long) * (size_t)n), must_alloc(sizeof(long) * (size_t)n),
                 must_alloc(sizeof(long) * (size_t)nseq)};
    long *keep_rows = must_alloc(sizeof(long) * (size_t)n);
    const float **noise = must_alloc(sizeof(float *) * (size_t)n); /* per kept row, NULL: plain logits */
    float *inv_temp = must_alloc(sizeof(float) * (size_t)n);
    void *xconv = dims[WFMT] == 3 ? work + n * work_before_xconv(dims) : 0; /* (bfloat16 compute) */
    for (long q = 0, i = 0; q < nseq; q++) {
        rm.start[q] = i;
        long tr = seqs[q].rows * (dims[HEADS] / dims[KV_HEADS]); /* rows of its attention tasks */
        if (tr > most) most = tr;
        if (tr * (seqs[q].past + seqs[q].rows + 16) > span) span = tr * (seqs[q].past + seqs[q].rows + 16);
        for (long r = 0, first = seqs[q].rows - seqs[q].keep; r < seqs[q].rows; r++, i++) {
            rm.of[i] = q;
            rm.local[i] = r;
            if (r >= first) {
                noise[kept] = seqs[q].noise ? seqs[q].noise[r - first] : 0;
                inv_temp[kept] = seqs[q].inv_temp;
                keep_rows[kept++] = i;
            }
        }
    }
#pragma omp parallel num_threads(threads)
    {
        float *h = work, *h2 = h + n * d, *a = h2 + n * d, *z = a + n * d, *scratch = z + n * fc1_width(dims);
        attn_scratch w = {must_alloc(sizeof(float) * (size_t)span),
                          must_alloc(sizeof(float) * (size_t)(most * 2 * hd)),
                          must_alloc(sizeof(float) * (size_t)most), must_alloc(sizeof(long) * (size_t)most),
                          must_alloc(sizeof(long) * (size_t)most),
                          must_alloc(sizeof(long) * (size_t)(KEY_BLOCK_BYTES / 4))};
#pragma omp for schedule(static)
        for (long i = 0; i < n; i++) memcpy(h + i * d, embed + ids[i] * d, sizeof(float) * d);
        for (long l = 0; l < nlayers; l++) {
            const float *const *pl = p + l * NPARAM;
            block_in(dims, eps, scaling, pl, l, n, &rm, h, pos, cos_t, sin_t, a, z, scratch, &w, xconv);
            block_out(dims, pl, n, activate((int)dims[ACT], z, n, ff, scratch), a, h, h2, xconv);
            float *t = h; h = h2; h2 = t;
        }
#pragma omp for schedule(static)
        for (long r = 0; r < kept; r++) memcpy(scratch + r * d, h + keep_rows[r] * d, sizeof(float) * d);
        norm(dims, scratch, kept, d, head[0], head[1], eps, h2);
        dt_gemm_for(h2, kept, d, head[2], (int)dims[WFMT], 0, logits, dims[VOCAB_PAD], xconv);
#pragma omp for schedule(static)
        for (long r = 0; r < kept; r++)
            if (noise[r]) perturb_row(logits + r * dims[VOCAB_PAD], cols, inv_temp[r], noise[r]);
        if (topk > 0) softmax_topk_rows(logits, kept, cols, dims[VOCAB_PAD], topk, top_vals, top_ids);
        if (topk < 0) argmax_rows(logits, kept, cols, dims[VOCAB_PAD], top_ids);
        free(w.idx);
        free(w.par);
        free(w.last);
        free(w.inv);
        free(w.acc);
        free(w.s);
    }
    free(keep_rows);
    free(noise);
    free(inv_temp);
    free(rm.start);
    free(rm.local);
    free(rm.of);
    return 0;
}

/* Whether any lane of a comparison mask is set (one instruction where the ISA has it). */
static inline int vany(vi m) {
#if DT_W == 16 && !defined(DT_GENERIC)
    return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0;
#elif DT_W == 8 && !defined(DT_GENERIC)
    return _mm256_movemask_ps((__m256)m) != 0;
#else
    int any = 0;
    for (int l = 0; l < DT_W; l++) any |= m[l];
    return any;
#endif
}

/* Index of each row's largest logit (the first on ties), n rows of V with row stride `stride`:
 * one pass keeping each lane's best value and its first index, then the lanes' best (the lowest
 * index among equal values). */
static void argmax_rows(const float *logits, long n, long V, long stride, long *out) {
#pragma omp for schedule(static)
    for (long i = 0; i < n; i++) {
        const float *x = logits + i * stride;
        vf best = bc(-INFINITY);
        vi at, idx;
        for (int l = 0; l < DT_W; l++) at[l] = idx[l] = l;
        long j = 0;
        for (; j + DT_W <= V; j += DT_W, idx += DT_W) {
            vf v = ld(x + j);
            vi gt = v > best;
            best = vsel(gt, v, best);
            at = (gt & idx) | (~gt & at);
        }
        float m = best[0];
        long b = at[0];
        for (int l = 1; l < DT_W; l++)
            if (best[l] > m || (best[l] == m && at[l] < b)) m = best[l], b = at[l];
        for (; j < V; j++)
            if (x[j] > m) m = x[j], b = j;
        out[i] = b;
    }
}

/* Softmax probabilities and ids of the k most likely tokens of each of n rows of logits (row
 * stride `stride`), most likely first; ties keep the lower id.  vals: (n, k); ids: (n, k).
 * After the max, one pass both sums the exponentials (16-float logical vectors, one fixed order)
 * and scans for the top k, skipping at once every vector none of whose lanes beats the k-th. */
static inline void topk_insert(const float *x, long j0, long j1, long k, long *have, float *thr, float *bv, long *bi) {
    for (long j = j0; j < j1; j++) {
        float v = x[j];
        if (*have == k && v <= *thr) continue;
        long r = *have < k ? (*have)++ : k - 1;
        while (r > 0 && bv[r - 1] < v) { bv[r] = bv[r - 1]; bi[r] = bi[r - 1]; r--; }
        bv[r] = v;
        bi[r] = j;
        if (*have == k) *thr = bv[k - 1];
    }
}
static void softmax_topk_rows(const float *logits, long n, long V, long stride, long k, float *vals, long *ids) {
#pragma omp for schedule(static)
    for (long i = 0; i < n; i++) {
        const float *x = logits + i * stride;
        float *bv = vals + i * k;
        long *bi = ids + i * k;
        long have = 0;
        float m = vmax_row(x, V), thr = -INFINITY;  /* thr: the k-th best so far once k are held */
        vf acc[DT_L16];
        for (int l = 0; l < DT_L16; l++) acc[l] = bc(0.f);
        long j = 0;
        for (; j + 16 <= V; j += 16)
            for (int l = 0; l < DT_L16; l++) {
                vf v = ld(x + j + l * DT_W);
                acc[l] += vexp(v - bc(m));
                if (have < k || vany(v > bc(thr))) topk_insert(x, j + l * DT_W, j + (l + 1) * DT_W, k, &have, &thr, bv, bi);
            }
        float sum = hsum16(acc);
        topk_insert(x, j, V, k, &have, &thr, bv, bi);
        for (; j < V; j++) sum += expf(x[j] - m);
        for (long r = 0; r < have; r++) bv[r] = expf(bv[r] - m) / sum;
    }
}

void dt_argmax(const float *logits, long n, long V, long stride, long *out) { argmax_rows(logits, n, V, stride, out); }

/* Sampling's perturbed scores in place (dynatree/sampling.py): x = x * inv_temp + g over V entries,
 * the product rounded before the add (no fused multiply-add), as torch computes them on the
 * runners without this kernel. */
DT_UNFUSED
static void perturb_row(float *x, long V, float inv_temp, const float *g) {
    DT_UNFUSED_BODY
    long j = 0;
    for (; j + DT_W <= V; j += DT_W) {
        vf p = ld(x + j) * bc(inv_temp);
        st(x + j, p + ld(g + j));
    }
    for (; j < V; j++) {
        float p = x[j] * inv_temp; /* two statements: see DT_UNFUSED */
        x[j] = p + g[j];
    }
}

/* Gumbel noise for sampling (dynatree/sampling.py has the same in torch for machines without this
 * library): out[i] = -log(-log1p(-v_i)), i < n, with v_i = (floor(h_i / 2) + 1/4) * 2^-31 and h_i
 * the 32-bit hash fmix32(fmix32(i ^ k0) + k1) (murmur3's finalizer), v_i kept below 1 - 2^-24.
 * In float32: v is fine-grained near 0, where the noise is large, so the largest noise is ~22.9
 * (a token scoring over ~25 below the best can never be drawn: at most V * e^-25 of probability,
 * ~1e-7 for 50k tokens).  log1p(-v) = log(u) * -v / (u - 1), u = 1 - v rounded (Goldberg). */
static inline vu fmix32(vu x) {
    x ^= x >> 16;
    x *= 0x85ebca6bu;
    x ^= x >> 13;
    x *= 0xc2b2ae35u;
    return x ^ (x >> 16);
}
void dt_gumbel(unsigned int k0, unsigned int k1, long n, float *out) {
    vu lane;
    for (int l = 0; l < DT_W; l++) lane[l] = (unsigned)l;
    for (long i = 0; i < n; i += DT_W) {
        vu h = fmix32(fmix32((lane + (unsigned)i) ^ k0) + k1);
        vf v = (__builtin_convertvector((vi)(h >> 1), vf) + bc(0.25f)) * bc(0x1p-31f);
        v = vsel(v > bc(0x1.fffffep-1f), bc(0x1.fffffep-1f), v);
        vf u = bc(1.f) - v;
        vf e = vsel(u == bc(1.f), v, vlog(u) * v / (u - bc(1.f))); /* -log1p(-v) */
        vf g = -vlog(e);
        if (i + DT_W <= n)
            st(out + i, g);
        else
            memcpy(out + i, &g, (size_t)(n - i) * sizeof(float));
    }
}

void dt_softmax_topk(const float *logits, long n, long V, long stride, long k, float *vals, long *ids) {
    softmax_topk_rows(logits, n, V, stride, k, vals, ids);
}

/* Move cache slots src[0..k) to start..start+k-1 in nl layers' key and value buffers, each
 * (rows, cap, hd) elements of `elem` bytes with rows = batch * heads.  src ascends with
 * src[i] >= start + i (a BFS tree path), so copying in order never overwrites a slot still to be read. */
void dt_cache_keep(char *const *kc, char *const *vc, long nl, long rows, long cap, long hd, long start,
                   const long *src, long k, long elem) {
    size_t row = (size_t)hd * (size_t)elem;
    for (long l = 0; l < nl; l++)
        for (long r = 0; r < rows; r++)
            for (long i = 0; i < k; i++) {
                if (src[i] == start + i) continue;
                size_t to = (size_t)(r * cap + start + i) * row, from = (size_t)(r * cap + src[i]) * row;
                memmove(kc[l] + to, kc[l] + from, row);
                memmove(vc[l] + to, vc[l] + from, row);
            }
}
