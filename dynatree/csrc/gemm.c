/* Few-row float32 GEMM for CPU verification: y = x W + b for M = 1..~32 rows.
 *
 * Why: decoding a 10-100M-parameter model on a CPU reads every weight once per forward, so one
 * row costs the memory stream and a tree of 16 rows should cost about the same.  MKL/oneDNN pay
 * 1.5-2x for going from 1 to 16 rows here; this kernel streams pre-packed weight tiles once per
 * 12 rows and stays near the one-row cost.
 *
 * Batch invariance: every output y[m, j] is one FMA chain over k = 0..K-1 in order, whatever M,
 * the row chunking or the thread split (threads split output tiles, never k).  So a row's result
 * is bitwise the same alone (an AR step) or inside a tree of any size (verification).
 *
 * Layout: wp is (N/TW, K, TW) -- tile t holds columns t*TW .. t*TW+TW-1 for every k, contiguous.
 * bfloat16 tiles hold each k's TW columns in vec.h's pair order (ld2_bf16; native._pack).
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "neox.h"
#include "vec.h"

/* Register blocking per instruction set (vec.h): a pass keeps RMAX rows x NVT vectors of
 * accumulators, NVT weight vectors and the rows' x values in registers -- 12 x 2 zmm on AVX-512
 * (27 of 32: x is each FMA's broadcast memory operand), 6 x 2 ymm on AVX2 (15 of 16; BLIS's
 * Haswell shape), 10 x 2 on aarch64 (32 of 32: its by-element FMAs take x from a register, one
 * per row, and GCC 12 loads all of them first -- at 12 rows it spilled 4 accumulators, 8 stack
 * accesses per k), 6 x 2 on other 128-bit ISAs.  The blocking never changes a result: it only
 * decides which outputs share a pass, and each output stays one FMA chain over k. */
#define NVT 2           /* vectors per tile row */
#define TW (NVT * DT_W) /* output columns per tile */
#if DT_W == 16
#define RMAX 12 /* rows per pass */
#elif DT_NREG >= 32
#define RMAX 10
#else
#define RMAX 6
#endif
#define PREFETCH_BYTES 8192 /* ahead of the tile row being read: the hardware prefetcher alone
                               left 12-16 rows 1.5x slower (AVX-512 host); 8 KiB instead of 2 cut
                               one-pass GEMMs (1-12 rows AVX-512, 1-6 AVX2) 15-20% on Zen 5 */

/* Weights come as float32 or, when every weight of the model is exactly representable in it
 * (a bf16 or fp16 checkpoint loaded as float32), as 16-bit bfloat16 or IEEE half: half the bytes
 * to stream, the same float32 values in the same FMA chain, so bitwise the same outputs. */
_Static_assert(NVT == 2, "a tile row is read as two vectors (ld2_bf16)");
static inline void row_f32(const float *p, vf *wv) { wv[0] = ld(p), wv[1] = ld(p + DT_W); }
static inline void row_f16(const dt_half *p, vf *wv) { wv[0] = ld_f16(p), wv[1] = ld_f16(p + DT_W); }
static inline void row_bf16(const unsigned short *p, vf *wv) { ld2_bf16(p, &wv[0], &wv[1]); } /* pair order */

/* R rows of x (stride ldx) times one K x TW weight tile of type T -> R x TW outputs (stride ldy).
 * With nxt, each k also prefetches nrow bytes of the next tile (nxt: its start, nrow: its bytes
 * per k) into L2, so a later pass, which reads no new weights, loads the next tile's for the first.
 * (One row is bound by the weight stream, not by its two FMA chains' latency: pairing tiles to
 * give it four chains measured no faster.) */
#define KERN(R, T, LD, NAME, FMA, ADD)                                                              \
    static void NAME##_##R(const float *x, long ldx, const void *w_, long K, float *y, long ldy,    \
                           const float *b, const char *nxt, long nrow) {                            \
        enum { PF = PREFETCH_BYTES / (TW * sizeof(T)), ROWB = TW * sizeof(T) };                     \
        const T *w = (const T *)w_;                                                                 \
        vf acc[R][NVT];                                                                             \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                        \
            _Pragma("GCC unroll 4") for (int c = 0; c < NVT; c++) acc[r][c] = bc(0.f);              \
        for (long k = 0; k < K; k++) {                                                              \
            _Pragma("GCC unroll 4") for (int o = 0; o < ROWB; o += 64)                              \
                __builtin_prefetch((const char *)(w + (k + PF) * TW) + o);                          \
            if (nxt)                                                                                \
                for (long o = 0; o < nrow; o += 64) __builtin_prefetch(nxt + k * nrow + o, 0, 2);   \
            vf wv[NVT];                                                                             \
            LD(w + k * TW, wv);                                                                     \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                  \
                vf xv = bc(x[r * ldx + k]);                                                         \
                _Pragma("GCC unroll 4") for (int c = 0; c < NVT; c++)                               \
                    acc[r][c] = FMA(xv, wv[c], acc[r][c]);                                          \
            }                                                                                       \
        }                                                                                           \
        _Pragma("GCC unroll 4") for (int c = 0; c < NVT; c++) {                                     \
            vf bv = b ? ld(b + c * DT_W) : bc(0.f);                                                 \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) st(y + r * ldy + c * DT_W, ADD(acc[r][c], bv)); \
        }                                                                                           \
    }
typedef void (*kern_fn)(const float *, long, const void *, long, float *, long, const float *, const char *, long);
static inline vf vadd(vf a, vf b) { return a + b; }
#define KERNS_OF(T, LD, NAME, FMA, ADD)                                                             \
    KERN(1, T, LD, NAME, FMA, ADD) KERN(2, T, LD, NAME, FMA, ADD) KERN(3, T, LD, NAME, FMA, ADD)    \
    KERN(4, T, LD, NAME, FMA, ADD) KERN(5, T, LD, NAME, FMA, ADD) KERN(6, T, LD, NAME, FMA, ADD)    \
    KERN(7, T, LD, NAME, FMA, ADD) KERN(8, T, LD, NAME, FMA, ADD) KERN(9, T, LD, NAME, FMA, ADD)    \
    KERN(10, T, LD, NAME, FMA, ADD) KERN(11, T, LD, NAME, FMA, ADD) KERN(12, T, LD, NAME, FMA, ADD) \
    static const kern_fn NAME[13] = {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6, \
                                     NAME##_7, NAME##_8, NAME##_9, NAME##_10, NAME##_11, NAME##_12};
KERNS_OF(float, row_f32, kern_f32, fmadd, vadd)
KERNS_OF(unsigned short, row_bf16, kern_bf16, fmadd, vadd)
KERNS_OF(dt_half, row_f16, kern_f16, fmadd, vadd)
/* Format 3's emulation off x86 (no FPU mode flushes after rounding as x86 and VDPBF16PS do:
 * aarch64's FPCR.FZ flushes results that are tiny before rounding): each result whose rounded
 * value is below the smallest normal becomes a signed zero here, in software (the inputs carry
 * no denormals: x's rounding and the packing flush them).  The generic build does the same on
 * x86 too, so an x86 host tests the path ARM runs against the other two. */
#if !(defined(__x86_64__) || defined(__i386__)) || defined(DT_GENERIC)
#define BF16_FLUSH_SOFT 1
static inline vf flushed(vf r) {
    vi tiny = ((vi)r & 0x7f800000) == 0;
    return vsel(tiny, (vf)((vi)r & (int)0x80000000), r);
}
static inline vf fmadd_ftz(vf a, vf b, vf c) { return flushed(fmadd(a, b, c)); }
static inline vf vadd_ftz(vf a, vf b) { return flushed(a + b); }
KERNS_OF(unsigned short, row_bf16, kern_bf16z, fmadd_ftz, vadd_ftz)
#else
#define BF16_FLUSH_SOFT 0
#endif

/* The short last pass of a 16-register ISA: R = 1 or 2 rows over G tiles at once (tiles ts
 * elements apart), R x G x NVT = 8 accumulator chains.  Why: after the full RMAX-row passes
 * (12 chains), a 1- or 2-row pass over one tile has 2 or 4 chains, too few to cover the FMA
 * latency, so the equal split (7 rows: 4 + 3) left both passes latency-bound; 6 rows, then the
 * seventh over 4 tiles, ran the target's GEMMs 10-15% faster at 7-8 rows and 2-9% at 13-14 (Zen 5,
 * AVX2 and generic builds; 4 or 6 tiles, 2 or 3: the same; a 3-row tail over 2 tiles was slower).
 * Each output is still one FMA chain over k in order, plus the bias: the same bits. */
#define TAIL_ROWS (DT_NREG < 32 ? 2 : 0)
#define TAIL_TILES(R) (8 / (NVT * (R)))
#define KERNT(R, G, T, LD, NAME, FMA, ADD)                                                          \
    static void NAME##_##R##x##G(const float *x, long ldx, const void *w_, long ts, long K, float *y, long ldy, \
                                 const float *b) {                                                  \
        const T *w = (const T *)w_;                                                                 \
        vf acc[R][G][NVT];                                                                          \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                         \
            _Pragma("GCC unroll 8") for (int g = 0; g < G; g++)                                     \
                _Pragma("GCC unroll 4") for (int c = 0; c < NVT; c++) acc[r][g][c] = bc(0.f);       \
        for (long k = 0; k < K; k++)                                                                \
            _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {                                   \
                vf wv[NVT];                                                                         \
                LD(w + g * ts + k * TW, wv);                                                        \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                               \
                    vf xv = bc(x[r * ldx + k]);                                                     \
                    _Pragma("GCC unroll 4") for (int c = 0; c < NVT; c++)                           \
                        acc[r][g][c] = FMA(xv, wv[c], acc[r][g][c]);                                \
                }                                                                                   \
            }                                                                                       \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; g++)                                         \
            _Pragma("GCC unroll 4") for (int c = 0; c < NVT; c++) {                                 \
                vf bv = b ? ld(b + g * TW + c * DT_W) : bc(0.f);                                    \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                 \
                    st(y + r * ldy + g * TW + c * DT_W, ADD(acc[r][g][c], bv));                     \
            }                                                                                       \
    }
typedef void (*kernt_fn)(const float *, long, const void *, long, long, float *, long, const float *);
#define KERNTS_OF(T, LD, NAME, FMA, ADD)                                                            \
    KERNT(1, 1, T, LD, NAME, FMA, ADD) KERNT(1, 2, T, LD, NAME, FMA, ADD)                           \
    KERNT(1, 3, T, LD, NAME, FMA, ADD) KERNT(1, 4, T, LD, NAME, FMA, ADD)                           \
    KERNT(2, 1, T, LD, NAME, FMA, ADD) KERNT(2, 2, T, LD, NAME, FMA, ADD)                           \
    static const kernt_fn NAME[3][5] = {{0}, {0, NAME##_1x1, NAME##_1x2, NAME##_1x3, NAME##_1x4},   \
                                        {0, NAME##_2x1, NAME##_2x2}};
#if TAIL_ROWS
KERNTS_OF(float, row_f32, kernt_f32, fmadd, vadd)
KERNTS_OF(unsigned short, row_bf16, kernt_bf16, fmadd, vadd)
KERNTS_OF(dt_half, row_f16, kernt_f16, fmadd, vadd)
#if BF16_FLUSH_SOFT
KERNTS_OF(unsigned short, row_bf16, kernt_bf16z, fmadd_ftz, vadd_ftz)
#endif
#endif

const char *dt_isa(void) { return DT_ISA; }
int dt_vector_floats(void) { return DT_W; }
int dt_rows_per_pass(void) { return RMAX; }
int dt_tile_width(void) { return TW; }

/* x: (M, K) row-major; wp: packed (N/TW, K, TW) of format fmt (0 float32, 1 bfloat16, 2 half);
 * bp: (N,) float32 or NULL; y: (M, N) row-major; N % TW == 0.  The calling threads split the
 * tiles (an orphaned `omp for`: inside a parallel region it shares the work, outside it runs
 * alone), in contiguous static halves: each thread's weight stream stays sequential, so the
 * prefetch runs on into its next tile.  Streaming from memory (1-4 rows) the two halves finish
 * 10-17% apart on Zen 5, the slower thread changing from process to process; schedule(dynamic,
 * 1 or 2) measured 5-60% slower at 1-16 rows, guided no better, and a split point moved per
 * matrix toward equal finishing times no faster (alternating processes: within the noise;
 * 2026-11-29).
 * AVX-512 builds run full RMAX-row passes, then the rest (16 rows: 12 + 4): a tile's first pass
 * streams its weights from memory while the most rows' FMAs run on them, and later
 * passes find the tile in L2.  Until 2026-11-29 the passes were of near-equal size (8 + 8), the
 * first also stored the tile widened to float32 for the others (Zen 4: 6-8% at 13-300 rows) and
 * the second prefetched the next tile into L2 (Zen 5: 17-26% at 13-18 rows); on Intel Emerald
 * Rapids, at Pythia-2.8B's shapes (K = 2560 and 10240: a widened tile of 0.3-1.3 MB, weights from
 * DRAM), the full first pass alone ran 13-32 rows 6-25% faster than that (same process, C GEMM
 * harness), and the bench pair's whole target forward 2-8% faster at 13-200 rows (medians of 5
 * alternating rounds); on Zen 5 (alternating processes) whole target forwards within 6% of the old
 * split: 13 rows 2-5% slower, 20-64 rows 1-6% faster, 3-6% faster at 16-32 rows at Pythia-2.8B's
 * shapes.  16-register ISAs (6-row passes, compute-bound from ~5 rows) keep the
 * near-equal split and the next-tile prefetch, and run a 1- or 2-row remainder over several tiles
 * at once (gemm_tail).  The split never changes a result: each output is one FMA chain over k.
 * (Blocking rows to keep x in L2 while tiles stream past measured no faster, even at 300 rows.) */
#define FULL_FIRST (DT_W == 16)
/* The kernel table of weight format fmt: 0 float32, 1 bfloat16, 2 half, 4 (internal) bfloat16 with
 * format 3's flush in software (BF16_FLUSH_SOFT). */
#if BF16_FLUSH_SOFT
#define KERNELS_OF(fmt, K) ((fmt) == 4 ? K##_bf16z : (fmt) == 1 ? K##_bf16 : (fmt) == 2 ? K##_f16 : K##_f32)
#else
#define KERNELS_OF(fmt, K) ((fmt) == 1 ? K##_bf16 : (fmt) == 2 ? K##_f16 : K##_f32)
#endif
static void gemm_tail(const float *x, long M, long K, const void *wp, int fmt, const float *bp, float *y, long N);
static void gemm_tiles(const float *x, long M, long K, const void *wp, int fmt, const float *bp, float *y, long N);
static void gemm_bf16c(const float *x, long M, long K, const void *wp, const float *bp, float *y, long N, void *xbuf);
void dt_gemm_for(const float *x, long M, long K, const void *wp, int fmt, const float *bp, float *y, long N,
                 void *xbuf) {
    if (M <= 0) return;
    if (fmt == 3)
        gemm_bf16c(x, M, K, wp, bp, y, N, xbuf);
    else
        gemm_tiles(x, M, K, wp, fmt, bp, y, N);
}

static void gemm_tiles(const float *x, long M, long K, const void *wp, int fmt, const float *bp, float *y, long N) {
    long nt = N / TW, passes = (M + RMAX - 1) / RMAX, base = M / passes, extra = M % passes;
    if (passes > 1 && M % RMAX <= TAIL_ROWS && M % RMAX) {
        gemm_tail(x, M, K, wp, fmt, bp, y, N);
        return;
    }
    size_t esize = fmt ? 2 : 4;
    const kern_fn *kern = KERNELS_OF(fmt, kern);
#pragma omp for schedule(static)
    for (long t = 0; t < nt; t++) {
        const float *bt = bp ? bp + t * TW : 0;
        const void *wt = (const char *)wp + t * K * TW * esize;
        for (long p = 0, m = 0, R; p < passes; m += R, p++) {
            R = FULL_FIRST ? (M - m < RMAX ? M - m : RMAX) : base + (p < extra);
            const char *nxt = !FULL_FIRST && p == 1 && t + 1 < nt ? (const char *)wt + K * TW * esize : 0;
            kern[R](x + m * K, K, wt, K, y + m * N + t * TW, N, bt, nxt, TW * esize);
        }
    }
}

/* dt_gemm_for when M % RMAX is 1 .. TAIL_ROWS (16-register ISAs): full RMAX-row passes tile by
 * tile, then the last rows over TAIL_TILES tiles at once (KERNT).  The tiles are split between the
 * calling threads as `omp for schedule(static)` would (contiguous, near-equal), then a barrier, as
 * at the end of an `omp for`: every thread of a parallel region calls it, like dt_gemm_for. */
static void gemm_tail(const float *x, long M, long K, const void *wp, int fmt, const float *bp, float *y, long N) {
#if TAIL_ROWS
    long nt = N / TW, tail = M % RMAX, m0 = M - tail, G = TAIL_TILES(tail), tile = K * TW * (fmt ? 2 : 4);
    const kern_fn *full = KERNELS_OF(fmt, kern);
    const kernt_fn *last = KERNELS_OF(fmt, kernt)[tail];
    int nth = omp_get_num_threads(), id = omp_get_thread_num();
    long t0 = nt * id / nth, t1 = nt * (id + 1) / nth;
    for (long g0 = t0; g0 < t1; g0 += G) {
        long g1 = g0 + G < t1 ? g0 + G : t1;
        for (long t = g0; t < g1; t++)
            for (long m = 0; m < m0; m += RMAX)
                full[RMAX](x + m * K, K, (const char *)wp + t * tile, K, y + m * N + t * TW, N, bp ? bp + t * TW : 0, 0,
                           0);
        last[g1 - g0](x + m0 * K, K, (const char *)wp + g0 * tile, K * TW, K, y + m0 * N + g0 * TW, N,
                      bp ? bp + g0 * TW : 0);
    }
#pragma omp barrier
#else
    (void)x, (void)M, (void)K, (void)wp, (void)fmt, (void)bp, (void)y, (void)N;
#endif
}

/* ---- fmt 3: bfloat16 compute ----
 * The GEMM's inputs are bfloat16 -- each x rounded as VCVTNEPS2BF16 does (bf16_bits), the weights
 * rounded when packed -- and each output sums its products in float32 in the order of AVX512_BF16's
 * VDPBF16PS: per pair of k (2j, 2j+1), acc += x[2j+1] w[2j+1], then acc += x[2j] w[2j], each an
 * exact product rounded once into acc (an FMA), denormal inputs and results flushed to signed
 * zero.  Where the CPU has the instruction (the native build of an AVX512_BF16 CPU) one VDPBF16PS
 * does a pair per lane, twice the float32 FMA's rate; elsewhere the same chain runs as two FMAs
 * per pair under the FPU's flush-to-zero/denormals-are-zero modes (off x86, a software flush of
 * each result: BF16_FLUSH_SOFT), over weights packed with each
 * pair's two rows swapped (so it is gemm_tiles' bfloat16 path over K rounded up to even, x
 * rounded and swapped alike): bitwise the same outputs on every variant, and still one chain per
 * output, so batch invariant.  The bias add runs under the same modes. */
#if DT_W == 16 && !defined(DT_GENERIC) && defined(__AVX512BF16__)
#define BF16_DOT 1
#else
#define BF16_DOT 0
#endif
int dt_bf16_dot(void) { return BF16_DOT; }

/* The body of a peak-rate probe: 12 independent accumulator chains of `a = OP(a, X, Y)` per
 * thread (enough to cover the latency of every CPU we know) over `iters` iterations, timed on the
 * master thread; returns GFLOP/s at FLOPS per lane per operation over LANES lanes. */
#define PEAK_BODY(VT, INIT, XT, X, Y, OP, FLOPS, LANES)                                             \
    double sink = 0, t0 = 0, t1 = 0;                                                                \
    _Pragma("omp parallel num_threads(threads) reduction(+ : sink)") {                              \
        VT a[12];                                                                                   \
        XT x = X, y = Y;                                                                            \
        for (int i = 0; i < 12; i++) a[i] = INIT(1e-9f * (float)i);                                 \
        _Pragma("omp barrier") _Pragma("omp master") t0 = omp_get_wtime();                          \
        for (long k = 0; k < iters; k++)                                                            \
            _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) a[i] = OP(a[i], x, y);            \
        _Pragma("omp barrier") _Pragma("omp master") t1 = omp_get_wtime();                          \
        for (int i = 0; i < 12; i++) sink += a[i][0];                                               \
    }                                                                                               \
    return sink * 0 + (FLOPS) * 12.0 * (LANES) * (double)iters * threads / (t1 - t0) / 1e9;

/* The FMA throughput this variant can reach, in GFLOP/s over `threads` threads.  `dynatree
 * profile` prints achieved GFLOP/s next to it. */
double dt_fma_peak(long iters, int threads) { PEAK_BODY(vf, bc, vf, bc(0.999999f), bc(1e-9f), fmadd, 2.0, DT_W) }

/* The rate of format 3's products in GFLOP/s over `threads` threads: VDPBF16PS's (four FLOP per
 * lane) where the kernel runs it, else the FMA's (dt_fma_peak). */
double dt_dot_peak(long iters, int threads) {
#if BF16_DOT
#define BF16_PAIR(v) _mm512_cvtne2ps_pbh(_mm512_set1_ps(v), _mm512_set1_ps(v))
    PEAK_BODY(__m512, _mm512_set1_ps, __m512bh, BF16_PAIR(0.999f), BF16_PAIR(1e-9f), _mm512_dpbf16_ps, 4.0, 16)
#else
    return dt_fma_peak(iters, threads);
#endif
}

/* x's conversion buffer: (M, K rounded up to even) of bfloat16 (BF16_DOT) or float32. */
long dt_bf16c_buffer_bytes(long M, long K) { return M * (K + (K & 1)) * (BF16_DOT ? 2 : 4); }

/* A float32's bfloat16 as VCVTNEPS2BF16 rounds it, in the top half of a float32's bits: zero and
 * denormals to signed zero, NaN quieted, else to nearest even. */
static inline unsigned bf16_bits(unsigned u) {
    unsigned e = u & 0x7f800000u;
    unsigned r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    r = e == 0x7f800000u && (u & 0x7fffffu) ? (u | 0x400000u) & 0xffff0000u : r;
    return e == 0 ? u & 0x80000000u : r;
}

/* One row of x (K floats) into the buffer's row (Kp = K rounded up to even; the pad is zero):
 * bfloat16 values in order for VDPBF16PS, else float32 with each pair swapped. */
static void round_row(const float *x, long K, void *row) {
    long Kp = K + (K & 1);
    for (long k = 0; k < Kp; k++) {
        unsigned u = 0;
        if (k < K) memcpy(&u, x + k, 4), u = bf16_bits(u);
#if BF16_DOT
        ((unsigned short *)row)[k] = (unsigned short)(u >> 16);
#else
        memcpy((float *)row + (k ^ 1), &u, 4);
#endif
    }
}

#if !BF16_FLUSH_SOFT /* x86: the FPU's modes flush as VDPBF16PS does, at float32's speed */
#include <xmmintrin.h>
typedef unsigned fpmode;
static fpmode flush_on(void) { fpmode c = _mm_getcsr(); _mm_setcsr(c | 0x8040u); return c; } /* FTZ | DAZ */
static void flush_off(fpmode c) { _mm_setcsr(c); }
#else /* elsewhere the kernels flush (kern_bf16z) */
typedef int fpmode;
static fpmode flush_on(void) { return 0; }
static void flush_off(fpmode c) { (void)c; }
#endif

#if BF16_DOT
/* R rows of bfloat16 x pairs (stride ldx bfloat16) times one K2 x TW tile of bfloat16 pairs. */
#define KERNDP(R)                                                                                   \
    static void kdp_##R(const unsigned short *x, long ldx, const void *w_, long K2, float *y, long ldy, \
                        const float *b) {                                                           \
        enum { PF = PREFETCH_BYTES / (TW * 4) };                                                    \
        const unsigned *w = (const unsigned *)w_;                                                   \
        __m512 acc[R][NVT];                                                                         \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                        \
            _Pragma("GCC unroll 4") for (int c = 0; c < NVT; c++) acc[r][c] = _mm512_setzero_ps();  \
        for (long j = 0; j < K2; j++) {                                                             \
            _Pragma("GCC unroll 4") for (int o = 0; o < TW * 4; o += 64)                            \
                __builtin_prefetch((const char *)(w + (j + PF) * TW) + o);                          \
            __m512bh wv[NVT];                                                                       \
            _Pragma("GCC unroll 4") for (int c = 0; c < NVT; c++)                                   \
                wv[c] = (__m512bh)_mm512_loadu_si512((const void *)(w + j * TW + c * 16));          \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                  \
                int pair;                                                                           \
                memcpy(&pair, x + r * ldx + 2 * j, 4);                                              \
                __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);                                    \
                _Pragma("GCC unroll 4") for (int c = 0; c < NVT; c++)                               \
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);                             \
            }                                                                                       \
        }                                                                                           \
        _Pragma("GCC unroll 4") for (int c = 0; c < NVT; c++) {                                     \
            __m512 bv = b ? _mm512_loadu_ps(b + c * 16) : _mm512_setzero_ps();                      \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                    \
                _mm512_storeu_ps(y + r * ldy + c * 16, _mm512_add_ps(acc[r][c], bv));               \
        }                                                                                           \
    }
KERNDP(1) KERNDP(2) KERNDP(3) KERNDP(4) KERNDP(5) KERNDP(6) KERNDP(7) KERNDP(8) KERNDP(9) KERNDP(10) KERNDP(11)
KERNDP(12)
typedef void (*kdp_fn)(const unsigned short *, long, const void *, long, float *, long, const float *);
static const kdp_fn kdp[13] = {0, kdp_1, kdp_2, kdp_3, kdp_4, kdp_5, kdp_6, kdp_7, kdp_8, kdp_9, kdp_10, kdp_11, kdp_12};
#endif

/* fmt 3's GEMM (every thread of the region calls it, like dt_gemm_for): x rounded into xbuf
 * (dt_bf16c_buffer_bytes), then the tiles.  wp: (N/TW, Kp/2, TW) of bfloat16 pairs (BF16_DOT),
 * else gemm_tiles' bfloat16 layout of the pair-swapped rows (native._pack_bf16c). */
static void gemm_bf16c(const float *x, long M, long K, const void *wp, const float *bp, float *y, long N, void *xbuf) {
    long Kp = K + (K & 1), rowb = Kp * (BF16_DOT ? 2 : 4);
    fpmode mode = flush_on();
#pragma omp for schedule(static)
    for (long m = 0; m < M; m++) round_row(x + m * K, K, (char *)xbuf + m * rowb);
#if BF16_DOT
    long nt = N / TW;
#pragma omp for schedule(static)
    for (long t = 0; t < nt; t++) {
        const void *wt = (const char *)wp + t * Kp * TW * 2;
        for (long m = 0, R; m < M; m += R) {
            R = M - m < RMAX ? M - m : RMAX;
            kdp[R]((const unsigned short *)xbuf + m * Kp, Kp, wt, Kp / 2, y + m * N + t * TW, N, bp ? bp + t * TW : 0);
        }
    }
#else
    gemm_tiles((const float *)xbuf, M, Kp, wp, BF16_FLUSH_SOFT ? 4 : 1, bp, y, N);
#endif
    flush_off(mode);
}

void dt_gemm(const float *x, long M, long K, const void *wp, int fmt, const float *bp, float *y, long N,
             int threads) {
    void *xbuf = fmt == 3 && M > 0 ? malloc(dt_bf16c_buffer_bytes(M, K)) : 0;
    if (fmt == 3 && M > 0 && !xbuf) abort();
#pragma omp parallel num_threads(threads)
    dt_gemm_for(x, M, K, wp, fmt, bp, y, N, xbuf);
    free(xbuf);
}

