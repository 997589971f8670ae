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
#include <string.h>

#define TW 32    /* output columns per tile: two 16-float vectors */
#define RMAX 12  /* rows per pass: 2*RMAX accumulators + 2 weights + 1 broadcast <= 32 registers */
#define PREFETCH 16  /* k rows (2 KB) ahead: the hardware prefetcher alone left 12-16 rows 1.5x slower */

#include "vec.h"

/* R rows of x (stride ldx) times one K x TW weight tile -> R x TW outputs (stride ldy). */
#define KERN(R)                                                                                     \
    static void kern_##R(const float *x, long ldx, const float *w, long K, float *y, long ldy,     \
                         const float *b) {                                                          \
        v16 a0[R], a1[R];                                                                           \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) { a0[r] = bc(0.f); a1[r] = bc(0.f); } \
        for (long k = 0; k < K; k++) {                                                              \
            __builtin_prefetch(w + (k + PREFETCH) * TW);                                            \
            __builtin_prefetch(w + (k + PREFETCH) * TW + 16);                                       \
            v16 w0 = ld(w + k * TW), w1 = ld(w + k * TW + 16);                                      \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                  \
                v16 xv = bc(x[r * ldx + k]);                                                        \
                a0[r] = fmadd(xv, w0, a0[r]);                                                       \
                a1[r] = fmadd(xv, w1, a1[r]);                                                       \
            }                                                                                       \
        }                                                                                           \
        v16 b0 = b ? ld(b) : bc(0.f), b1 = b ? ld(b + 16) : bc(0.f);                                \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                      \
            st(y + r * ldy, a0[r] + b0);                                                            \
            st(y + r * ldy + 16, a1[r] + b1);                                                       \
        }                                                                                           \
    }
KERN(1) KERN(2) KERN(3) KERN(4) KERN(5) KERN(6) KERN(7) KERN(8) KERN(9) KERN(10) KERN(11) KERN(12)

typedef void (*kern_t)(const float *, long, const float *, long, float *, long, const float *);
static const kern_t KERNS[RMAX + 1] = {0,      kern_1, kern_2, kern_3,  kern_4,  kern_5, kern_6,
                                       kern_7, kern_8, kern_9, kern_10, kern_11, kern_12};

int dt_tile_width(void) { return TW; }

/* x: (M, K) row-major; wp: packed (N/TW, K, TW); bp: (N,) or NULL; y: (M, N) row-major; N % TW == 0. */
void dt_gemm(const float *x, long M, long K, const float *wp, const float *bp, float *y, long N, int threads) {
    long nt = N / TW;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long t = 0; t < nt; t++) {
        const float *w = wp + t * K * TW;
        for (long m = 0; m < M; m += RMAX) {
            long R = M - m < RMAX ? M - m : RMAX;
            KERNS[R](x + m * K, K, w, K, y + m * N + t * TW, N, bp ? bp + t * TW : 0);
        }
    }
}
