/* 16-float vectors for the kernels: AVX-512 intrinsics where the compiler targets them, GCC
 * vector extensions elsewhere (same results on one machine; FMA only where fmadd is one). */
#ifndef DT_VEC_H
#define DT_VEC_H
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int v16i __attribute__((vector_size(64), aligned(4)));

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
#endif
