/* One GPT-NeoX decoder layer on the CPU, float32, batch 1, for 1..n new tokens over a KV cache.
 *
 * Why: at draft and verify sizes a layer is ~20 small torch ops (layer norms, rotary halves, cache
 * writes, SDPA, residual adds) whose dispatch costs more than their arithmetic; here they are two
 * calls (GELU stays in torch between them).
 *
 * Batch invariance (the point, beside speed): every value a row produces is computed by the
 * same operations in the same order whatever the number of rows n, so a tree node's logits are
 * bitwise the logits an AR step computes for the same prefix:
 *   - GEMMs: dt_gemm (one FMA chain per output over k in order);
 *   - layer norms: one row at a time, fixed order;
 *   - attention: each (row, head) walks its *allowed* keys in slot order (prefix, then ancestors
 *     in BFS order == depth order), skipping masked ones, so a node sees exactly the keys, in
 *     exactly the order, that an AR step over the same path sees.
 *
 * Parameters come as an array of pointers (see enum); weights are dt_gemm-packed.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

void dt_gemm(const float *x, long M, long K, const float *wp, const float *bp, float *y, long N, int threads);

enum { LN1_W, LN1_B, LN2_W, LN2_B, QKV_W, QKV_B, OUT_W, OUT_B, FC1_W, FC1_B, FC2_W, FC2_B, NPARAM };
enum { D_MODEL, HEADS, HEAD_DIM, ROT, FF, PARALLEL, NDIM };

typedef float v16 __attribute__((vector_size(64), aligned(4)));
#if defined(__AVX512F__)
static inline v16 ld(const float *p) { return (v16)_mm512_loadu_ps(p); }
static inline void st(float *p, v16 v) { _mm512_storeu_ps(p, (__m512)v); }
static inline v16 bc(float x) { return (v16)_mm512_set1_ps(x); }
static inline v16 fmadd(v16 a, v16 b, v16 c) { return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#else
static inline v16 ld(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v16 bc(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline v16 fmadd(v16 a, v16 b, v16 c) { return a * b + c; }
#endif

typedef int v16i __attribute__((vector_size(64), aligned(4)));

static inline float hsum(v16 v) {  /* a fixed reduction order */
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#else
    float t[16];
    memcpy(t, &v, sizeof t);
    for (int w = 8; w > 0; w /= 2)
        for (int i = 0; i < w; i++) t[i] += t[i + w];
    return t[0];
#endif
}

static inline v16 vsel(v16i m, v16 a, v16 b) { return (v16)(((v16i)a & m) | ((v16i)b & ~m)); }

/* exp(x) for 16 lanes, Cephes' expf polynomial (~1 ulp); x below -87 gives ~0. */
static inline v16 vexp(v16 x) {
    x = vsel(x < bc(-87.f), bc(-87.f), x);
    x = vsel(x > bc(88.f), bc(88.f), x);
    v16 fx = x * bc(1.44269504088896341f) + bc(0.5f);
    v16 t = __builtin_convertvector(__builtin_convertvector(fx, v16i), v16);
    t = vsel(t > fx, t - bc(1.f), t);  /* floor */
    x = x - t * bc(0.693359375f) - t * bc(-2.12194440e-4f);
    v16 y = bc(1.9875691500e-4f);
    y = y * x + bc(1.3981999507e-3f);
    y = y * x + bc(8.3334519073e-3f);
    y = y * x + bc(4.1665795894e-2f);
    y = y * x + bc(1.6666665459e-1f);
    y = y * x + bc(5.0000001201e-1f);
    y = y * x * x + x + bc(1.f);
    v16i e = (__builtin_convertvector(t, v16i) + 127) << 23;
    return y * (v16)e;
}

/* y[i] = layer_norm(x[i]) for n rows of d; statistics in double, one row at a time. */
void dt_layer_norm(const float *x, long n, long d, const float *w, const float *b, float eps, float *y) {
    for (long i = 0; i < n; i++) {
        const float *xi = x + i * d;
        double s = 0.0, ss = 0.0;
        for (long j = 0; j < d; j++) s += xi[j];
        double mean = s / d;
        for (long j = 0; j < d; j++) { double c = xi[j] - mean; ss += c * c; }
        float m = (float)mean, rstd = (float)(1.0 / sqrt(ss / d + eps));
        for (long j = 0; j < d; j++) y[i * d + j] = (xi[j] - m) * rstd * w[j] + b[j];
    }
}

/* NeoX partial rotary on the first rot dims of x (rotate_half convention). */
static void rotate(float *x, long rot, const float *cos, const float *sin) {
    long half = rot / 2;
    for (long j = 0; j < half; j++) {
        float x1 = x[j], x2 = x[j + half];
        x[j] = x1 * cos[j] - x2 * sin[j];
        x[j + half] = x2 * cos[j + half] + x1 * sin[j + half];
    }
}

/* Attention of n query rows over L = past + n cached keys.  allowed: (n, L) bytes or NULL (causal).
 * q rows live in qkv (row stride 3d, head stride 3hd); kc/vc: (H, cap, hd); out: (n, d). */
static void attend(const long *dims, float scaling, long n, const float *qkv, const float *kc, const float *vc,
                   long cap, long past, const unsigned char *allowed, float *out, int threads) {
    long d = dims[D_MODEL], H = dims[HEADS], hd = dims[HEAD_DIM], L = past + n, nv = hd / 16;
#pragma omp parallel num_threads(threads)
    {
        float *s = malloc(sizeof(float) * (size_t)(L + 16));
        v16 acc[16];  /* hd <= 256 */
#pragma omp for schedule(static)
        for (long t = 0; t < n * H; t++) {
            long i = t / H, h = t % H;
            const float *q = qkv + i * 3 * d + h * 3 * hd;
            const float *K = kc + h * cap * hd, *V = vc + h * cap * hd;
            const unsigned char *ok = allowed ? allowed + i * L : NULL;
            long last = allowed ? L - 1 : past + i;
            /* scores for keys 0..last, four at a time (independent chains); masked ones are
             * computed too and ignored below -- a key's score never depends on its neighbours */
            long j = 0;
            for (; j + 4 <= last + 1; j += 4) {
                v16 a0 = bc(0.f), a1 = bc(0.f), a2 = bc(0.f), a3 = bc(0.f);
                const float *k0 = K + j * hd;
                for (long c = 0; c < nv; c++) {
                    v16 qc = ld(q + 16 * c);
                    a0 = fmadd(qc, ld(k0 + 16 * c), a0);
                    a1 = fmadd(qc, ld(k0 + hd + 16 * c), a1);
                    a2 = fmadd(qc, ld(k0 + 2 * hd + 16 * c), a2);
                    a3 = fmadd(qc, ld(k0 + 3 * hd + 16 * c), a3);
                }
                s[j] = hsum(a0) * scaling;
                s[j + 1] = hsum(a1) * scaling;
                s[j + 2] = hsum(a2) * scaling;
                s[j + 3] = hsum(a3) * scaling;
            }
            for (; j <= last; j++) {
                v16 a0 = bc(0.f);
                for (long c = 0; c < nv; c++) a0 = fmadd(ld(q + 16 * c), ld(K + j * hd + 16 * c), a0);
                s[j] = hsum(a0) * scaling;
            }
            float m = -INFINITY;
            for (j = 0; j <= last; j++)
                if ((!ok || ok[j]) && s[j] > m) m = s[j];
            for (j = 0; j <= last; j += 16) st(s + j, vexp(ld(s + j) - bc(m)));  /* s has 16 spare */
            for (long c = 0; c < nv; c++) acc[c] = bc(0.f);
            float sum = 0.f;
            for (j = 0; j <= last; j++) {
                if (ok && !ok[j]) continue;
                float e = s[j];
                sum += e;
                v16 ev = bc(e);
                for (long c = 0; c < nv; c++) acc[c] = fmadd(ev, ld(V + j * hd + 16 * c), acc[c]);
            }
            v16 inv = bc(1.f / sum);
            for (long c = 0; c < nv; c++) st(out + i * d + h * hd + 16 * c, acc[c] * inv);
        }
        free(s);
    }
}

/* First half of a layer.  h: (n, d) -> a: (n, d) attention output (plus h for a sequential
 * residual), z: (n, ff) fc1 pre-activation.  Writes the n new keys/values at slots past..past+n-1.
 * pos: (n,) positions; cos_t/sin_t: (max_pos, rot); work: >= n * 5d floats. */
void dt_neox_block_in(const long *dims, float eps, float scaling, const float *const *p, long n, const float *h,
                      const long *pos, const float *cos_t, const float *sin_t, float *kc, float *vc, long cap,
                      long past, const unsigned char *allowed, float *a, float *z, float *work, int threads) {
    long d = dims[D_MODEL], H = dims[HEADS], hd = dims[HEAD_DIM], rot = dims[ROT], ff = dims[FF];
    float *x = work, *qkv = work + n * d, *att = work + 4 * n * d;
    dt_layer_norm(h, n, d, p[LN1_W], p[LN1_B], eps, x);
    dt_gemm(x, n, d, p[QKV_W], p[QKV_B], qkv, 3 * d, threads);
    for (long i = 0; i < n; i++) {
        const float *c = cos_t + pos[i] * rot, *s = sin_t + pos[i] * rot;
        for (long hh = 0; hh < H; hh++) {
            float *q = qkv + i * 3 * d + hh * 3 * hd, *k = q + hd, *v = q + 2 * hd;
            rotate(q, rot, c, s);
            rotate(k, rot, c, s);
            memcpy(kc + (hh * cap + past + i) * hd, k, sizeof(float) * hd);
            memcpy(vc + (hh * cap + past + i) * hd, v, sizeof(float) * hd);
        }
    }
    attend(dims, scaling, n, qkv, kc, vc, cap, past, allowed, att, threads);
    dt_gemm(att, n, d, p[OUT_W], p[OUT_B], a, d, threads);
    if (dims[PARALLEL]) {
        dt_layer_norm(h, n, d, p[LN2_W], p[LN2_B], eps, x);
    } else {
        for (long j = 0; j < n * d; j++) a[j] += h[j];
        dt_layer_norm(a, n, d, p[LN2_W], p[LN2_B], eps, x);
    }
    dt_gemm(x, n, d, p[FC1_W], p[FC1_B], z, ff, threads);
}

/* Second half.  g: (n, ff) activated fc1 output -> out: (n, d) = fc2(g) + a (+ h if parallel). */
void dt_neox_block_out(const long *dims, const float *const *p, long n, const float *g, const float *a,
                       const float *h, float *out, int threads) {
    long d = dims[D_MODEL];
    dt_gemm(g, n, dims[FF], p[FC2_W], p[FC2_B], out, d, threads);
    if (dims[PARALLEL])
        for (long j = 0; j < n * d; j++) out[j] = (out[j] + a[j]) + h[j];
    else
        for (long j = 0; j < n * d; j++) out[j] = out[j] + a[j];
}
