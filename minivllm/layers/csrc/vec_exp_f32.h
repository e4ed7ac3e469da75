/* A vectorisable exp, and the register vector type, for our C sources (included by cpu_fused_f32.c and
   attention/csrc/paged_decode_f32.c). Part of minivllm; the build keys each source by the headers
   it includes too (minivllm/layers/native_build.py). */
#ifndef MINIVLLM_VEC_EXP_F32_H
#define MINIVLLM_VEC_EXP_F32_H
#include <stdint.h>
#include <string.h>

/* exp(-g) for a run of at most EXP_CHUNK values, in loops the compiler vectorises (a libm expf
   call is one element at a time: SiLU-and-multiply over 32 x 768 values took 156 us with it, 3x
   torch's). Range reduction x = n ln2 + r, |r| <= ln2 / 2, with ln2 split in a short high part
   and a correction so n * ln2 is exact; exp(r) by its degree-7 Taylor polynomial in Horner form
   (relative error below 2e-7 there, about one float32 ulp); 2^n built in the exponent bits. The
   bits go through memcpy between two loops because a type pun inside one loop stops GCC from
   vectorising it. Inputs are clamped to [-87, 88], where 2^n stays a normal float. */
#define EXP_CHUNK 256

/* The vector both C files compute in registers (GCC/clang vector extensions): VEC_W floats, 16 with
   AVX-512, else 8; loads and stores through it may be unaligned and may alias float memory. */
#if defined(__AVX512F__)
#define VEC_W 16
#else
#define VEC_W 8
#endif
typedef float vec_f32 __attribute__((vector_size(VEC_W * 4), aligned(4), may_alias));
typedef int32_t vec_i32 __attribute__((vector_size(VEC_W * 4)));

/* s in every lane: one broadcast instruction (a lane-by-lane loop compiled to inserts and made the
   decode kernel twice as slow) */
static inline vec_f32 vec_splat(float s) {
#if VEC_W == 16
    const vec_f32 v = {s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s};
#else
    const vec_f32 v = {s, s, s, s, s, s, s, s};
#endif
    return v;
}

/* The steps, on a float or (GCC/clang vector extensions) a vector of floats: k = x / ln2 rounded to
   nearest, r = x - k ln2, exp(r) by the polynomial; 2^k goes into the exponent bits of the result. */
#define EXP_ROUND_K(x) (((x) * 1.44269504f + 12582912.f) - 12582912.f)
#define EXP_REDUCE(x, k) (((x) - (k) * 0.693359375f) + (k) * 2.12194440e-4f)
#define EXP_TAYLOR7(r) \
    ((((((((r) * (1.f / 5040.f) + 1.f / 720.f) * (r) + 1.f / 120.f) * (r) + 1.f / 24.f) * (r) + 1.f / 6.f) * (r) \
       + 0.5f) * (r) + 1.f) * (r) + 1.f)

static inline void exp_neg_f32(const float *g, float *out, int64_t n) {
    int32_t bits[EXP_CHUNK];
    float poly[EXP_CHUNK], scale[EXP_CHUNK];
    #pragma omp simd
    for (int64_t d = 0; d < n; d++) {
        float x = -g[d];  /* clamped with two selects: GCC vectorises these, not fminf/fmaxf */
        x = x < -87.f ? -87.f : x;
        x = x > 88.f ? 88.f : x;
        /* k = x / ln2 rounded to nearest: adding and removing 1.5 * 2^23 drops the fraction (not
           floorf, which GCC does not vectorise without -ffast-math) */
        const float k = EXP_ROUND_K(x);
        const float r = EXP_REDUCE(x, k);
        poly[d] = EXP_TAYLOR7(r);
        bits[d] = ((int32_t)k + 127) << 23;
    }
    memcpy(scale, bits, (size_t)n * sizeof(float));
    #pragma omp simd
    for (int64_t d = 0; d < n; d++) out[d] = poly[d] * scale[d];
}

/* exp(x) for a vector already clamped to [-87, 88]: exp_neg_f32's steps (the same bits), in registers */
static inline vec_f32 vec_exp_clamped(vec_f32 x) {
    const vec_f32 k = EXP_ROUND_K(x), r = EXP_REDUCE(x, k);
    return EXP_TAYLOR7(r) * (vec_f32)((__builtin_convertvector(k, vec_i32) + 127) << 23);
}

#endif
