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
 */
#include <omp.h>
#include <string.h>

#include "vec.h"

/* Register blocking per instruction set (vec.h): a pass keeps RMAX rows x NVT vectors of
 * accumulators, NVT weight vectors and one broadcast in registers -- 12 x 2 zmm on AVX-512
 * (27 of 32), 6 x 2 ymm on AVX2 (15 of 16; BLIS's Haswell shape), 12 x 2 / 6 x 2 on NEON /
 * other 128-bit ISAs.  The blocking never changes a result: it only decides which outputs share
 * a pass, and each output stays one FMA chain over k. */
#define NVT 2                         /* vectors per tile row */
#define TW (NVT * DT_W)               /* output columns per tile */
#define RMAX (DT_NREG >= 32 ? 12 : 6) /* rows per pass */
#define PREFETCH_BYTES 2048 /* ahead of the tile row being read: the hardware prefetcher alone
                               left 12-16 rows 1.5x slower (AVX-512 host) */

/* Weights come as float32 or, when every weight of the model is exactly representable in it
 * (a bf16 or fp16 checkpoint loaded as float32), as 16-bit bfloat16 or IEEE half: half the bytes
 * to stream, the same float32 values in the same FMA chain, so bitwise the same outputs. */
static inline vf ld_f32(const float *p) { return ld(p); }

/* R rows of x (stride ldx) times one K x TW weight tile of type T -> R x TW outputs (stride ldy).
 * (One row is bound by the weight stream, not by its two FMA chains' latency: pairing tiles to
 * give it four chains measured no faster.) */
#define KERN(R, T, LD)                                                                              \
    static void kern_##LD##_##R(const float *x, long ldx, const T *w, long K, float *y, long ldy,   \
                                const float *b) {                                                   \
        enum { PF = PREFETCH_BYTES / (TW * sizeof(T)), ROWB = TW * sizeof(T) };                     \
        vf acc[R][NVT];                                                                             \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                        \
            _Pragma("GCC unroll 4") for (int c = 0; c < NVT; c++) acc[r][c] = bc(0.f);              \
        for (long k = 0; k < K; k++) {                                                              \
            _Pragma("GCC unroll 4") for (int o = 0; o < ROWB; o += 64)                              \
                __builtin_prefetch((const char *)(w + (k + PF) * TW) + o);                          \
            vf wv[NVT];                                                                             \
            _Pragma("GCC unroll 4") for (int c = 0; c < NVT; c++) wv[c] = LD(w + k * TW + c * DT_W); \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                  \
                vf xv = bc(x[r * ldx + k]);                                                         \
                _Pragma("GCC unroll 4") for (int c = 0; c < NVT; c++)                               \
                    acc[r][c] = fmadd(xv, wv[c], acc[r][c]);                                        \
            }                                                                                       \
        }                                                                                           \
        _Pragma("GCC unroll 4") for (int c = 0; c < NVT; c++) {                                     \
            vf bv = b ? ld(b + c * DT_W) : bc(0.f);                                                 \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) st(y + r * ldy + c * DT_W, acc[r][c] + bv); \
        }                                                                                           \
    }
#define KERNS_OF(T, LD)                                                                             \
    KERN(1, T, LD) KERN(2, T, LD) KERN(3, T, LD) KERN(4, T, LD) KERN(5, T, LD) KERN(6, T, LD)       \
    KERN(7, T, LD) KERN(8, T, LD) KERN(9, T, LD) KERN(10, T, LD) KERN(11, T, LD) KERN(12, T, LD)    \
    static void (*const KERNS_##LD[13])(const float *, long, const T *, long, float *, long,         \
                                        const float *) = {                                          \
        0, kern_##LD##_1, kern_##LD##_2, kern_##LD##_3, kern_##LD##_4, kern_##LD##_5,               \
        kern_##LD##_6, kern_##LD##_7, kern_##LD##_8, kern_##LD##_9, kern_##LD##_10,                 \
        kern_##LD##_11, kern_##LD##_12};
KERNS_OF(float, ld_f32)
KERNS_OF(unsigned short, ld_bf16)
KERNS_OF(_Float16, ld_f16)

const char *dt_isa(void) { return DT_ISA; }
int dt_vector_floats(void) { return DT_W; }
int dt_rows_per_pass(void) { return RMAX; }
int dt_tile_width(void) { return TW; }

/* x: (M, K) row-major; wp: packed (N/TW, K, TW) of format fmt (0 float32, 1 bfloat16, 2 half);
 * bp: (N,) float32 or NULL; y: (M, N) row-major; N % TW == 0.  The calling threads split the
 * tiles (an orphaned `omp for`: inside a parallel region it shares the work, outside it runs
 * alone); rows go in passes of near-equal size (16 rows on AVX-512: 8 + 8, not 12 + 4).
 * (Blocking rows to keep x in L2 while tiles stream past measured no faster, even at 300 rows.) */
void dt_gemm_for(const float *x, long M, long K, const void *wp, int fmt, const float *bp, float *y, long N) {
    if (M <= 0) return;
    long nt = N / TW, passes = (M + RMAX - 1) / RMAX, base = M / passes, extra = M % passes;
#pragma omp for schedule(static)
    for (long t = 0; t < nt; t++) {
        const float *bt = bp ? bp + t * TW : 0;
        for (long p = 0, m = 0; p < passes; m += base + (p < extra), p++) {
            long R = base + (p < extra);
            const float *xm = x + m * K;
            float *yt = y + m * N + t * TW;
            if (fmt == 1)
                KERNS_ld_bf16[R](xm, K, (const unsigned short *)wp + t * K * TW, K, yt, N, bt);
            else if (fmt == 2)
                KERNS_ld_f16[R](xm, K, (const _Float16 *)wp + t * K * TW, K, yt, N, bt);
            else
                KERNS_ld_f32[R](xm, K, (const float *)wp + t * K * TW, K, yt, N, bt);
        }
    }
}

void dt_gemm(const float *x, long M, long K, const void *wp, int fmt, const float *bp, float *y, long N,
             int threads) {
#pragma omp parallel num_threads(threads)
    dt_gemm_for(x, M, K, wp, fmt, bp, y, N);
}

/* The FMA throughput this variant can reach, in GFLOP/s over `threads` threads: 12 independent
 * accumulator chains per thread (enough to cover the FMA latency of every CPU we know) over
 * `iters` iterations.  `dynatree profile` prints achieved GFLOP/s next to it. */
double dt_fma_peak(long iters, int threads) {
    double sink = 0;
    double t0 = 0, t1 = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        vf a[12], x = bc(0.999999f), y = bc(1e-9f);
        for (int i = 0; i < 12; i++) a[i] = bc(1e-9f * (float)i);
#pragma omp barrier
#pragma omp master
        t0 = omp_get_wtime();
        for (long k = 0; k < iters; k++)
            _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) a[i] = fmadd(a[i], x, y);
#pragma omp barrier
#pragma omp master
        t1 = omp_get_wtime();
        for (int i = 0; i < 12; i++) sink += a[i][0];
    }
    return sink * 0 + 2.0 * 12 * DT_W * (double)iters * threads / (t1 - t0) / 1e9;
}
