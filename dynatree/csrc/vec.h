/* Float vectors for the kernels, as wide as the instruction set the compiler targets.
 *
 * DT_W floats per register and DT_NREG registers decide every loop's blocking:
 *   AVX-512: 16 x 32;  AVX2 + FMA: 8 x 16;  aarch64 (NEON): 4 x 32;  anything else: 4 x 16.
 * DT_GENERIC (the `generic` build) takes the portable code on any machine: 128-bit GCC vector
 * extensions, no intrinsics -- the path other CPUs compile, so x86 hosts can test it; aarch64's
 * native build (`neon`) is that code with one NEON intrinsic (ld_f16), tested against the x86
 * builds under qemu-user (tests/test_kernel_portable.py).
 *
 * The same bits on every variant: lane-wise arithmetic does not depend on the width, and every
 * horizontal sum adds a *logical 16-float vector* (DT_L16 registers) in one fixed tree order
 * (hsum16), so AVX-512, AVX2 and generic builds give bitwise the same results wherever the CPU
 * fuses a*b+c (tests/test_native.py compares them).
 */
#ifndef DT_VEC_H
#define DT_VEC_H
#include <math.h>
#include <string.h>

#if defined(DT_GENERIC)
#define DT_ISA "generic"
#define DT_W 4
#elif defined(__AVX512F__)
#include <immintrin.h>
#define DT_ISA "avx512"
#define DT_W 16
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DT_ISA "avx2"
#define DT_W 8
#elif defined(__aarch64__)
#define DT_ISA "neon" /* the portable code, with NEON's half-precision widening (ld_f16) */
#define DT_W 4
#else
#define DT_ISA "generic"
#define DT_W 4
#endif
#if DT_W == 16 || defined(__aarch64__)
#define DT_NREG 32
#else
#define DT_NREG 16
#endif
#define DT_L16 (16 / DT_W) /* registers per logical 16-float vector, the unit of every sum */

/* A function whose a*b+c must round the product (GCC contracts across statements by default;
 * clang knows no such attribute and contracts only within one statement, so such code writes
 * its products and sums as separate statements). */
#ifdef __clang__
#define DT_UNFUSED
#define DT_UNFUSED_BODY _Pragma("STDC FP_CONTRACT OFF") /* (first in the body: standard C, clang honours it) */
#else
#define DT_UNFUSED __attribute__((optimize("fp-contract=off")))
#define DT_UNFUSED_BODY
#endif

typedef unsigned short dt_half; /* an IEEE half's bits (not _Float16: clang < 15 has none on x86) */
typedef float vf __attribute__((vector_size(4 * DT_W), aligned(4)));
typedef int vi __attribute__((vector_size(4 * DT_W), aligned(4)));
typedef unsigned int vu __attribute__((vector_size(4 * DT_W)));
static inline vf vsel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }

#if DT_W == 16 && !defined(DT_GENERIC)
static inline vf ld(const float *p) { return (vf)_mm512_loadu_ps(p); }
static inline void st(float *p, vf v) { _mm512_storeu_ps(p, (__m512)v); }
static inline vf bc(float x) { return (vf)_mm512_set1_ps(x); }
static inline vf fmadd(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
/* one widening load each (the generic forms compile to several shuffles) */
static inline vf ld_bf16(const unsigned short *p) {
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
static inline vf ld_f16(const dt_half *p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline void ld2_bf16(const unsigned short *p, vf *a, vf *b) { /* see ld2_bf16 below */
#ifdef __AVX512BW__
    __m512i v = _mm512_loadu_si512((const void *)p), z = _mm512_setzero_si512();
    *a = (vf)_mm512_unpacklo_epi16(z, v), *b = (vf)_mm512_unpackhi_epi16(z, v);
#else /* AVX-512F alone (Knights Landing): the same lane-wise interleaves, a 256-bit half at a time */
    __m256i lo = _mm256_loadu_si256((const __m256i *)p), hi = _mm256_loadu_si256((const __m256i *)p + 1);
    __m256i z = _mm256_setzero_si256();
    *a = (vf)_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(z, lo)), _mm256_unpacklo_epi16(z, hi), 1);
    *b = (vf)_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpackhi_epi16(z, lo)), _mm256_unpackhi_epi16(z, hi), 1);
#endif
}
#elif DT_W == 8 && !defined(DT_GENERIC)
static inline vf ld(const float *p) { return (vf)_mm256_loadu_ps(p); }
static inline void st(float *p, vf v) { _mm256_storeu_ps(p, (__m256)v); }
static inline vf bc(float x) { return (vf)_mm256_set1_ps(x); }
static inline vf fmadd(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
static inline vf ld_bf16(const unsigned short *p) {
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
}
static inline vf ld_f16(const dt_half *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline void ld2_bf16(const unsigned short *p, vf *a, vf *b) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p), z = _mm256_setzero_si256();
    *a = (vf)_mm256_unpacklo_epi16(z, v), *b = (vf)_mm256_unpackhi_epi16(z, v);
}
#else /* DT_W == 4 */
typedef unsigned short u16x8 __attribute__((vector_size(16), aligned(2)));
typedef unsigned long long u64x2 __attribute__((vector_size(16)));
static inline vf ld(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf bc(float x) { return (vf){x, x, x, x}; } /* not {0} + x, which turns -0.f into +0.f */
static inline vf fmadd(vf a, vf b, vf c) { return a * b + c; } /* contracted to one FMA where the CPU has it */
static inline vf ld_bf16(const unsigned short *p) { /* bf16 is a float32's top half: interleave with zeros */
    unsigned long long bits;
    memcpy(&bits, p, 8);
    u16x8 h = (u16x8)(u64x2){bits, 0}, z = {0};
    return (vf)__builtin_shufflevector(z, h, 0, 8, 1, 9, 2, 10, 3, 11);
}
/* Half -> float32, exact: GCC 12 turns __builtin_convertvector on 4 halves into 4 scalar
 * conversions and 7 lane moves (on aarch64 and x86 alike), the GEMM's whole loop for a half
 * checkpoint (Pythia's) 84 instructions per k instead of ~40.  aarch64 has one instruction for
 * it; elsewhere the bits are rebuilt with integer lane operations (no subnormal float is formed,
 * so flush-to-zero modes change nothing). */
#if defined(__aarch64__) && !defined(DT_GENERIC)
#include <arm_neon.h>
static inline vf ld_f16(const dt_half *p) { return (vf)vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
#else
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "ld_bf16 and ld_f16 interleave 16-bit halves in lanes");
static inline vf ld_f16(const dt_half *p) {
    unsigned long long bits;
    memcpy(&bits, p, 8);
    u16x8 h = (u16x8)(u64x2){bits, 0}, z = {0};
    vi u = (vi)__builtin_shufflevector(h, z, 0, 8, 1, 9, 2, 10, 3, 11); /* zero-extended */
    vi em = u & 0x7fff, sign = (vi)((vu)(u & 0x8000) << 16);
    vf normal = (vf)((em << 13) + (112 << 23));                    /* exponent rebiased 15 -> 127 */
    vf small = __builtin_convertvector(em, vf) * bc(0x1p-24f);      /* subnormal: em * 2^-24 */
    vf special = (vf)((em << 13) | 0x7f800000 | ((em > 0x7c00) & 0x400000)); /* inf; nan, quieted as fcvt does */
    vf r = vsel(em < 0x400, small, vsel(em >= 0x7c00, special, normal));
    return (vf)((vi)r | sign);
}
#endif
static inline void ld2_bf16(const unsigned short *p, vf *a, vf *b) { *a = ld_bf16(p), *b = ld_bf16(p + 4); }
#endif
/* ld2_bf16(p, a, b): two registers of float32 (2 * DT_W columns) from 2 * DT_W bfloat16 values
 * stored in *pair order*: per 128-bit lane l, four values of a (columns 4l .. 4l+3) then four of b
 * (columns DT_W + 4l ..) -- what one interleave with zeros per register unpacks (a bf16 is a
 * float32's top half), so one load and two single-uop shuffles, no shifts on the FMA ports: the
 * AVX2 GEMM's time 0.81-0.93x at 1-300 rows (one run read 1.08x at 32), AVX-512's 0.88-0.95x at
 * 1-12 rows (Emerald Rapids, same process, bitwise the same outputs; README).  With 4-float vectors pair order is plain column order (one
 * 16-byte load there measured no faster than two 8-byte ones). */

/* The sum of a logical 16-float vector held in DT_L16 registers, in one fixed tree order
 * (lane i += lane i + 8, then + 4, + 2, + 1) whatever DT_W is. */
static inline float hsum16(const vf *a) {
#if DT_W == 16 && !defined(DT_GENERIC)
    return _mm512_reduce_add_ps((__m512)a[0]); /* GCC's reduction is this tree */
#else
    vf t[DT_L16];
    for (int i = 0; i < DT_L16; i++) t[i] = a[i];
    for (int n = DT_L16; n > 1; n /= 2)
        for (int i = 0; i < n / 2; i++) t[i] += t[i + n / 2];
#if DT_W == 8 && !defined(DT_GENERIC)
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)t[0]), _mm256_extractf128_ps((__m256)t[0], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
#else
    float f[DT_W];
    memcpy(f, &t[0], sizeof f);
    for (int w = DT_W / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++) f[i] += f[i + w];
    return f[0];
#endif
#endif
}

/* out[i] = hsum16(a + i * DT_L16) * scale for n logical vectors; with AVX-512 and n == 16 the
 * sums run transposed -- each shuffle + add serves several vectors -- pairing exactly the lanes
 * hsum16 pairs (i += 8, 4, 2, 1; float addition commutes), so the bits are hsum16's. */
static inline void hsum16_n(const vf *a, int n, float scale, float *out) {
#if DT_W == 16 && !defined(DT_GENERIC)
    if (n == 16) {
        __m512 u[8], w[4], z[2];
        for (int i = 0; i < 8; i++) /* (v_2i, v_2i+1) -> their 8-lane halves added */
            u[i] = _mm512_add_ps(_mm512_shuffle_f32x4((__m512)a[2 * i], (__m512)a[2 * i + 1], 0x44),
                                 _mm512_shuffle_f32x4((__m512)a[2 * i], (__m512)a[2 * i + 1], 0xEE));
        for (int i = 0; i < 4; i++) /* quarter k of w_i: v_4i+k's 4 lanes */
            w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                                 _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
        for (int i = 0; i < 2; i++)
            z[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
        __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
        /* lane 4k + m holds v_k+4m's sum */
        const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_permutexvar_ps(order, r), _mm512_set1_ps(scale)));
        return;
    }
#endif
    for (int i = 0; i < n; i++) out[i] = hsum16(a + i * DT_L16) * scale;
}

/* exp(x) lane-wise, Cephes' expf polynomial (~1 ulp); x below -87 gives ~0. */
static inline vf vexp(vf x) {
    x = vsel(x < bc(-87.f), bc(-87.f), x);
    x = vsel(x > bc(88.f), bc(88.f), x);
    vf fx = x * bc(1.44269504088896341f) + bc(0.5f);
    vf t = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);
    t = vsel(t > fx, t - bc(1.f), t);  /* floor */
    x = x - t * bc(0.693359375f) - t * bc(-2.12194440e-4f);
    vf y = bc(1.9875691500e-4f);
    y = y * x + bc(1.3981999507e-3f);
    y = y * x + bc(8.3334519073e-3f);
    y = y * x + bc(4.1665795894e-2f);
    y = y * x + bc(1.6666665459e-1f);
    y = y * x + bc(5.0000001201e-1f);
    y = y * x * x + x + bc(1.f);
    vi e = (__builtin_convertvector(t, vi) + 127) << 23;
    return y * (vf)e;
}

/* log(x) lane-wise for positive normal x, Cephes' logf polynomial (~1 ulp). */
static inline vf vlog(vf x) {
    vi bits = (vi)x;
    vi e = ((bits >> 23) & 0xff) - 126;
    vf m = (vf)((bits & 0x007fffff) | 0x3f000000); /* x = m * 2^e, m in [0.5, 1) */
    vi low = m < bc(0.707106781186547524f);       /* then use 2m - 1 and e - 1 */
    e = e + low;
    m = vsel(low, m + m, m) - bc(1.f);
    vf z = m * m, y = bc(7.0376836292e-2f);
    y = y * m + bc(-1.1514610310e-1f);
    y = y * m + bc(1.1676998740e-1f);
    y = y * m + bc(-1.2420140846e-1f);
    y = y * m + bc(1.4249322787e-1f);
    y = y * m + bc(-1.6668057665e-1f);
    y = y * m + bc(2.0000714765e-1f);
    y = y * m + bc(-2.4999993993e-1f);
    y = y * m + bc(3.3333331174e-1f);
    vf fe = __builtin_convertvector(e, vf);
    y = y * m * z + fe * bc(-2.12194440e-4f) - bc(0.5f) * z;
    return m + y + fe * bc(0.693359375f);
}

static inline float vmax_row(const float *x, long V) {
    vf mv = bc(-INFINITY);
    long j = 0;
    for (; j + DT_W <= V; j += DT_W) { vf v = ld(x + j); mv = vsel(v > mv, v, mv); }
    float t[DT_W], m = -INFINITY;
    memcpy(t, &mv, sizeof t);
    for (int i = 0; i < DT_W; i++) if (t[i] > m) m = t[i];
    for (; j < V; j++) if (x[j] > m) m = x[j];
    return m;
}
#endif
