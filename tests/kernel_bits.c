/* Every result of the native kernel on fixed inputs, written raw to a file: tests/test_kernel_portable.py
 * runs it against each build this host runs and against an aarch64 build under qemu-user, and
 * compares the files byte for byte (vec.h: every variant computes the same bits where the CPU
 * fuses a*b+c).  Linked against one build of the kernel library:
 *     kernel_bits OUT_FILE [THREADS]   (default 2)
 *
 * Inputs come from an integer generator and are exact in every weight format (no libm here: the
 * rotary tables are random values too), so they are the same bits on every machine.  Covered:
 * dt_gemm at 1..27 rows in float32/bfloat16/half weights (a third of them subnormal as halves) and in
 * bfloat16 compute (format 3: the AVX512_BF16 instruction on one side, FMAs and a flush on the other),
 * and at 1, 13, 25 rows with K = 300 (long tiles, several passes); whole forwards of a GPT-NeoX-shaped
 * model (layer norms, GELU, parallel residual, partial rotary, biases) and a Llama/Qwen3-shaped
 * one (RMS norms, SwiGLU, grouped-query attention, q/k norms) in each weight format, over float32
 * and bfloat16 caches: a packed prefill of two prompts, then one forward of a masked tree, a
 * single row and a sequence reading its prompt from another's cache (a shared prefix) with the
 * top-k, argmax and sampling heads; Gumbel noise, softmax top-k and argmax alone. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../dynatree/csrc/neox.h"

static FILE *out;
static unsigned long long state = 0x9E3779B97F4A7C15ull;
static int threads = 2;

static void emit(const void *p, size_t bytes) {
    if (fwrite(p, 1, bytes, out) != bytes) { perror("kernel_bits: write"); exit(2); }
}

static void *alloc(size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p) { fprintf(stderr, "kernel_bits: out of memory\n"); exit(2); }
    return p;
}

/* A value exact in bfloat16 and in half (k / 256, |k| < 256, times 2^-scale): every format holds it. */
static float rnd(int scale) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    int k = (int)(state % 511) - 255;
    float v = (float)k / 256.0f;
    while (scale-- > 0) v *= 0.5f;
    return v;
}

static float *rnd_vec(long n, int scale) {
    float *v = alloc(sizeof(float) * (size_t)n);
    for (long i = 0; i < n; i++) v[i] = rnd(scale);
    return v;
}

/* The IEEE half holding v, which must be exact in one (every rnd() value is). */
static unsigned short to_half(float v) {
    unsigned int b;
    memcpy(&b, &v, 4);
    unsigned short sign = (unsigned short)((b >> 16) & 0x8000);
    int e = (int)((b >> 23) & 0xff) - 127;
    if ((b & 0x7fffffff) == 0) return sign;
    if (e < -14) { /* a subnormal half: |v| / 2^-24 is an integer below 1024 */
        float m = v < 0 ? -v : v;
        for (int i = 0; i < 24; i++) m *= 2.0f;
        return (unsigned short)(sign | (unsigned short)m);
    }
    return (unsigned short)(sign | (unsigned)(e + 15) << 10 | (b & 0x7fffff) >> 13);
}

/* W (N, K) row-major, packed into dt_gemm's tiles (N_pad / TW, K, TW) of format fmt: bfloat16 in
 * vec.h's pair order (native._pack: column h*w + 4l + i at position 8l + 4h + i). */
static void *pack_bf16c(const float *W, long N, long K);
static void *pack(const float *W, long N, long K, int fmt) {
    if (fmt == 3) return pack_bf16c(W, N, K);
    long tw = dt_tile_width(), w = dt_vector_floats(), npad = (N + tw - 1) / tw * tw;
    size_t elem = fmt ? 2 : 4;
    char *p = alloc(elem * (size_t)(npad * K));
    for (long t = 0; t < npad / tw; t++)
        for (long k = 0; k < K; k++)
            for (long c = 0; c < tw; c++) {
                long n = t * tw + c, at = (t * K + k) * tw + c;
                float v = n < N ? W[n * K + k] : 0.0f;
                if (fmt == 0) {
                    ((float *)p)[at] = v;
                } else if (fmt == 2) {
                    ((unsigned short *)p)[at] = to_half(v);
                } else {
                    long h = c / w, l = (c % w) / 4, i = c % 4;
                    unsigned int b;
                    memcpy(&b, &v, 4);
                    ((unsigned short *)p)[(t * K + k) * tw + 8 * l + 4 * h + i] = (unsigned short)(b >> 16);
                }
            }
    return p;
}

/* Format 3 (bfloat16 compute): (N_pad / TW, K / 2, TW, 2) bfloat16 pairs where the kernel runs
 * VDPBF16PS, else format 1's tiles of the rows with each pair swapped (native._pack_bf16c); K
 * padded with a zero row to even.  Every rnd() value is a bfloat16: its top half is it. */
static void *pack_bf16c(const float *W, long N, long K) {
    long tw = dt_tile_width(), npad = (N + tw - 1) / tw * tw, kp = K + (K & 1);
    if (dt_bf16_dot()) {
        unsigned short *p = alloc(2 * (size_t)(npad * kp));
        for (long t = 0; t < npad / tw; t++)
            for (long k = 0; k < kp; k++)
                for (long c = 0; c < tw; c++) {
                    long n = t * tw + c;
                    float v = n < N && k < K ? W[n * K + k] : 0.0f;
                    unsigned int b;
                    memcpy(&b, &v, 4);
                    p[((t * (kp / 2) + k / 2) * tw + c) * 2 + k % 2] = (unsigned short)(b >> 16);
                }
        return p;
    }
    float *swapped = alloc(sizeof(float) * (size_t)(N * kp));
    for (long n = 0; n < N; n++)
        for (long k = 0; k < kp; k++) swapped[n * kp + k] = (k ^ 1) < K ? W[n * K + (k ^ 1)] : 0.0f;
    void *p = pack(swapped, N, kp, 1);
    free(swapped);
    return p;
}

static float *padded(const float *b, long N) { /* a bias, zero to the tile width */
    long tw = dt_tile_width(), npad = (N + tw - 1) / tw * tw;
    float *p = alloc(sizeof(float) * (size_t)npad);
    memcpy(p, b, sizeof(float) * (size_t)N);
    return p;
}

/* y = x W + b for each of M in ms, weights in each format (K = 300: tiles longer than the
 * prefetch distance, over one to three passes). */
static void gemms(long K, const long *ms, int nm) {
    const long N = 80;
    float *W = rnd_vec(N * K, 2), *b = rnd_vec(N, 0), *x = rnd_vec(27 * K, 0);
    for (long i = 0; i < N * K; i += 3) W[i] = rnd(16); /* k * 2^-24: subnormal halves (and zeros) */
    long npad = (N + dt_tile_width() - 1) / dt_tile_width() * dt_tile_width();
    float *y = alloc(sizeof(float) * (size_t)(27 * npad));
    for (int fmt = 0; fmt < 4; fmt++) {
        void *wp = pack(W, N, K, fmt);
        float *bp = padded(b, N);
        for (int i = 0; i < nm; i++) {
            long M = ms[i];
            dt_gemm(x, M, K, wp, fmt, M % 2 ? bp : NULL, y, npad, threads);
            for (long m = 0; m < M; m++) emit(y + m * npad, sizeof(float) * (size_t)N);
        }
        free(wp), free(bp);
    }
    free(W), free(b), free(x), free(y);
}

static float bitsf(unsigned int b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* Format 3 at the smallest normal, 2^-126: over k = 1, 0, 3 the first output's exact sum is
 * 2^-126 + 2^-149 - 1.125 * 2^-149, tiny before rounding and 2^-126 after (kept: x86's flush and
 * VDPBF16PS's test the rounded value; aarch64's FPCR.FZ would flush it), the second's rounds to
 * the largest denormal (flushed everywhere). */
static void boundary(void) {
    float x[4] = {bitsf(52u << 23), bitsf(64u << 23), 0.0f, bitsf(0x80000000u | 52u << 23 | 0x100000u)};
    float W[2 * 4] = {bitsf(53u << 23), bitsf(64u << 23), 0.0f, bitsf(53u << 23),
                      bitsf(53u << 23), bitsf(64u << 23), 0.0f, bitsf(54u << 23)};
    void *wp = pack(W, 2, 4, 3);
    float *y = alloc(sizeof(float) * (size_t)dt_tile_width());
    dt_gemm(x, 1, 4, wp, 3, NULL, y, dt_tile_width(), threads);
    emit(y, 2 * sizeof(float));
    free(wp), free(y);
}

typedef struct { /* a model as dt_neox_forward reads it */
    long dims[NDIM], nlayers, V;
    float eps, scaling;
    const float **p, *head[3], *embed, *cos_t, *sin_t;
} model;

enum { MAXPOS = 64 };

static model make_model(int llama, int fmt) {
    model m = {{0}, 2, 100, 1e-5f, 0.25f, 0, {0}, 0, 0, 0};
    long d = 64, H = 4, KV = llama ? 2 : 4, hd = llama ? 32 : 16, ff = llama ? 96 : 128;
    long dims[NDIM] = {[D_MODEL] = d, [HEADS] = H, [HEAD_DIM] = hd, [ROT] = llama ? hd : hd / 2, [FF] = ff,
                       [PARALLEL] = !llama, [ACT] = llama ? ACT_SWIGLU : ACT_GELU, [EMBED_ROWS] = m.V, [WFMT] = fmt,
                       [KV_HEADS] = KV, [NORM] = llama ? NORM_RMS : NORM_LAYER};
    long tw = dt_tile_width();
    dims[VOCAB_PAD] = (m.V + tw - 1) / tw * tw;
    memcpy(m.dims, dims, sizeof dims);
    m.scaling = llama ? 0.17677669f : 0.25f;
    long qkvw = (H + 2 * KV) * hd, fc1 = llama ? 2 * ff : ff;
    m.p = alloc(sizeof(float *) * (size_t)(m.nlayers * NPARAM));
    for (long l = 0; l < m.nlayers; l++) {
        const float **p = m.p + l * NPARAM;
        long shape[4][2] = {{qkvw, d}, {d, H * hd}, {fc1, d}, {d, ff}}; /* (N, K) of QKV, OUT, FC1, FC2 */
        for (int j = 0; j < 4; j++) {
            float *W = rnd_vec(shape[j][0] * shape[j][1], 3);
            p[QKV_W + 2 * j] = pack(W, shape[j][0], shape[j][1], fmt);
            p[QKV_B + 2 * j] = llama ? NULL : padded(rnd_vec(shape[j][0], 2), shape[j][0]);
            free(W);
        }
        p[LN1_W] = rnd_vec(d, 0), p[LN2_W] = rnd_vec(d, 0);
        p[LN1_B] = llama ? NULL : rnd_vec(d, 2), p[LN2_B] = llama ? NULL : rnd_vec(d, 2);
        p[QN_W] = llama ? rnd_vec(hd, 0) : NULL, p[KN_W] = llama ? rnd_vec(hd, 0) : NULL;
    }
    float *lm = rnd_vec(m.V * d, 1);
    m.head[0] = rnd_vec(d, 0), m.head[1] = llama ? NULL : rnd_vec(d, 2), m.head[2] = pack(lm, m.V, d, fmt);
    free(lm);
    m.embed = rnd_vec(m.V * d, 0);
    m.cos_t = rnd_vec(MAXPOS * dims[ROT], 0), m.sin_t = rnd_vec(MAXPOS * dims[ROT], 0);
    return m;
}

typedef struct { void **k, **v; long cap, fmt; } cache;

static cache make_cache(const model *m, long cap, long fmt) {
    cache c = {alloc(sizeof(void *) * (size_t)m->nlayers), alloc(sizeof(void *) * (size_t)m->nlayers), cap, fmt};
    for (long l = 0; l < m->nlayers; l++) {
        size_t bytes = (size_t)(m->dims[KV_HEADS] * cap * m->dims[HEAD_DIM]) * (fmt ? 2 : 4);
        c.k[l] = alloc(bytes), c.v[l] = alloc(bytes);
    }
    return c;
}

static dt_seq seq_of(const cache *c, long rows, long past, long keep) {
    return (dt_seq){.rows = rows, .past = past, .cap = c->cap, .keep = keep, .kc = c->k, .vc = c->v, .kvfmt = c->fmt};
}

/* One forward; every logit of the kept rows and the heads' results go to the file. */
static void forward(const model *m, const long *ids, long n, const long *pos, const dt_seq *seqs, long nseq,
                    long topk) {
    long kept = 0, vp = m->dims[VOCAB_PAD], k = topk > 0 ? topk : 1;
    for (long q = 0; q < nseq; q++) kept += seqs[q].keep;
    float *logits = alloc(sizeof(float) * (size_t)(kept * vp)), *vals = alloc(sizeof(float) * (size_t)(kept * k));
    float *work = alloc(sizeof(float) * (size_t)(n * dt_work_per_row(m->dims)));
    long *top = alloc(sizeof(long) * (size_t)(kept * k));
    if (dt_neox_forward(m->dims, m->eps, m->scaling, m->nlayers, m->p, m->embed, m->head, ids, n, pos, m->cos_t,
                        m->sin_t, seqs, nseq, logits, work, threads, m->V, topk, vals, top)) {
        fprintf(stderr, "kernel_bits: dt_neox_forward refused its ids\n");
        exit(2);
    }
    for (long r = 0; r < kept; r++) emit(logits + r * vp, sizeof(float) * (size_t)m->V);
    if (topk > 0) emit(vals, sizeof(float) * (size_t)(kept * k));
    if (topk) emit(top, sizeof(long) * (size_t)(kept * k));
    free(logits), free(vals), free(work), free(top);
}

/* Two prompts prefilled in one packed forward, then one forward of: a 5-node tree over prompt A
 * (mask), one row after prompt B sampled (noise), and a sequence C whose first 16 keys are A's
 * (read from A's cache as a shared prefix) with 3 new rows; each with each head. */
static void forwards(int llama, int fmt, long kvfmt) {
    model m = make_model(llama, fmt);
    cache a = make_cache(&m, 48, kvfmt), b = make_cache(&m, 48, kvfmt), c = make_cache(&m, 48, kvfmt);
    long ids[64];
    for (int i = 0; i < 64; i++) ids[i] = (long)((unsigned)(i * 37 + 11) % (unsigned)m.V);
    dt_seq pre[2] = {seq_of(&a, 21, 0, 2), seq_of(&b, 9, 0, 1)};
    forward(&m, ids, 30, NULL, pre, 2, 0);
    unsigned char allowed[5 * 5] = {1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 1, 0, 0, 1, 1, 0, 1, 0, 1, 0, 1, 0, 1};
    long pos[5 + 1 + 3] = {21, 22, 22, 23, 23, 9, 16, 17, 18};
    float *noise = alloc(sizeof(float) * (size_t)m.V);
    dt_gumbel(7u, 99u, m.V, noise);
    const float *noises[1] = {noise};
    long ends[1] = {16}, scaps[1] = {a.cap};
    for (long topk = -1; topk <= 4; topk += 5) { /* argmax, then top-4 */
        dt_seq step[3] = {seq_of(&a, 5, 21, 5), seq_of(&b, 1, 9, 1), seq_of(&c, 3, 16, 3)};
        step[0].visible = 21, step[0].allowed = allowed;
        step[1].noise = noises, step[1].inv_temp = 1.25f;
        step[2].nshare = 1, step[2].ends = ends, step[2].ks = a.k, step[2].vs = a.v, step[2].scaps = scaps;
        forward(&m, ids + 30, 9, pos, step, 3, topk);
    }
    free(noise);
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: kernel_bits OUT_FILE [THREADS]\n");
        return 2;
    }
    if (argc == 3) threads = atoi(argv[2]); /* (no bit may depend on it) */
    out = fopen(argv[1], "wb");
    if (!out) { perror(argv[1]); return 2; }
    fprintf(stderr, "kernel_bits: %s variant, %d-float vectors, %d-column tiles\n", dt_isa(), dt_vector_floats(),
            dt_tile_width());
    long every[27], some[] = {1, 13, 25};
    for (int i = 0; i < 27; i++) every[i] = i + 1;
    gemms(96, every, 27);
    gemms(300, some, 3);
    gemms(97, some, 3); /* odd K: format 3 pads a zero pair */
    boundary();
    for (int llama = 0; llama < 2; llama++)
        for (int fmt = 0; fmt < 4; fmt++)
            for (long kvfmt = 0; kvfmt < 2; kvfmt++) forwards(llama, fmt, kvfmt);
    float noise[1000], vals[3 * 5], x[3 * 1000];
    long ids[3 * 5], best[3];
    dt_gumbel(0x9E3779B9u, 12345u, 1000, noise);
    emit(noise, sizeof noise);
    for (int i = 0; i < 3000; i++) x[i] = rnd(0) * 8.0f;
    dt_softmax_topk(x, 3, 997, 1000, 5, vals, ids);
    dt_argmax(x, 3, 997, 1000, best);
    emit(vals, sizeof vals), emit(ids, sizeof ids), emit(best, sizeof best);
    return fclose(out) ? 2 : 0;
}
