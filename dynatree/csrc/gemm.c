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
#define PREFETCH_BYTES 2048  /* ahead of the tile row being read: the hardware prefetcher alone
                                left 12-16 rows 1.5x slower */

#include "vec.h"

/* Weights come as float32 or, when every weight of the model is exactly representable in it
 * (a bf16 or fp16 checkpoint loaded as float32), as 16-bit bfloat16 or IEEE half: half the bytes
 * to stream, the same float32 values in the same FMA chain, so bitwise the same outputs. */
typedef unsigned short u16x16 __attribute__((vector_size(32), aligned(2)));
typedef _Float16 h16x16 __attribute__((vector_size(32), aligned(2)));
static inline v16 ld_f32(const float *p) { return ld(p); }
#if defined(__AVX512F__)  /* one widening load each (the generic form below compiles to six shuffles) */
static inline v16 ld_bf16(const unsigned short *p) {
    return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
static inline v16 ld_f16(const _Float16 *p) { return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#else
static inline v16 ld_bf16(const unsigned short *p) {
    u16x16 h;
    memcpy(&h, p, sizeof h);
    return (v16)(__builtin_convertvector(h, v16i) << 16);  /* bf16 is a float32's top half */
}
static inline v16 ld_f16(const _Float16 *p) {
    h16x16 h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, v16);
}
#endif

/* R rows of x (stride ldx) times one K x TW weight tile of type T -> R x TW outputs (stride ldy). */
#define KERN(R, T, LD)                                                                              \
    static void kern_##LD##_##R(const float *x, long ldx, const T *w, long K, float *y, long ldy,   \
                                const float *b) {                                                   \
        enum { PF = PREFETCH_BYTES / (TW * sizeof(T)) };                                            \
        v16 a0[R], a1[R];                                                                           \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) { a0[r] = bc(0.f); a1[r] = bc(0.f); } \
        for (long k = 0; k < K; k++) {                                                              \
            __builtin_prefetch(w + (k + PF) * TW);                                                  \
            if (sizeof(T) == 4) __builtin_prefetch(w + (k + PF) * TW + 16);                         \
            v16 w0 = LD(w + k * TW), w1 = LD(w + k * TW + 16);                                      \
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
#define KERNS_OF(T, LD)                                                                             \
    KERN(1, T, LD) KERN(2, T, LD) KERN(3, T, LD) KERN(4, T, LD) KERN(5, T, LD) KERN(6, T, LD)       \
    KERN(7, T, LD) KERN(8, T, LD) KERN(9, T, LD) KERN(10, T, LD) KERN(11, T, LD) KERN(12, T, LD)    \
    static void (*const KERNS_##LD[RMAX + 1])(const float *, long, const T *, long, float *, long,  \
                                              const float *) = {                                    \
        0, kern_##LD##_1, kern_##LD##_2, kern_##LD##_3, kern_##LD##_4, kern_##LD##_5,               \
        kern_##LD##_6, kern_##LD##_7, kern_##LD##_8, kern_##LD##_9, kern_##LD##_10,                 \
        kern_##LD##_11, kern_##LD##_12};
KERNS_OF(float, ld_f32)
KERNS_OF(unsigned short, ld_bf16)
KERNS_OF(_Float16, ld_f16)

int dt_tile_width(void) { return TW; }

/* x: (M, K) row-major; wp: packed (N/TW, K, TW) of format fmt (0 float32, 1 bfloat16, 2 half);
 * bp: (N,) float32 or NULL; y: (M, N) row-major; N % TW == 0. */
void dt_gemm(const float *x, long M, long K, const void *wp, int fmt, const float *bp, float *y, long N,
             int threads) {
    long nt = N / TW;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long t = 0; t < nt; t++) {
        for (long m = 0; m < M; m += RMAX) {
            long R = M - m < RMAX ? M - m : RMAX;
            const float *xm = x + m * K, *bt = bp ? bp + t * TW : 0;
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
