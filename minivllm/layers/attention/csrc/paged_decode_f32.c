/* Paged attention for short queries on the CPU, computed in fp32 (decode: one query token per
   sequence; draft verification and short chunks: a few, causal), keys and values read in place from
   the paged KV cache through the block table (no gathered copy, no mask); the cache holds float32,
   or bfloat16 (the _bf16 functions: kv_cache_dtype="bfloat16").
   Part of minivllm; built at first use by minivllm/layers/attention/cpu_decode.py and called
   through ctypes (which releases the GIL, so chunks of sequences can run on several threads).

   Per query row: scores for every head in one sweep over its K blocks (a slot holds all KV heads
   of one token, so each slot is read once), a max-subtracted softmax per head, then one sweep
   over its V blocks accumulating every head's output; for the common head sizes (decode_row_tiled)
   with dot products summed a vector of them at a time, else with portable loops
   (decode_row_generic); both in paged_decode_rows.h, compiled once per cache element type.
   Also here: causal self-attention of fresh prompts (causal_self_attention_f32, at the end). */
#include <stdint.h>
#include <math.h>
#include <string.h>

#include "../../csrc/vec_exp_f32.h"
#include "../../csrc/packed_call.h"

/* Softmax of s[0 .. len) in place, max subtracted (exp never overflows), exp vectorised in chunks:
   with libm's expf, one value at a time, a layer of 32 sequences of 200-260 keys (the embedded
   model's shapes, caches hot) took 0.67-0.94 ms, with this 0.66-0.76 ms in the same runs (dev EPYC,
   one thread, 2026-12-01). */
/* The largest of s[0 .. len), -inf for none (vectorised: a chain of scalar max was ~5% of the kernel,
   perf, 2026-12-05) */
static inline float max_f32(const float *s, int64_t len) {
    float m = -INFINITY;
    #pragma omp simd reduction(max:m)
    for (int64_t j = 0; j < len; j++) m = s[j] > m ? s[j] : m;
    return m;
}

static inline void softmax_f32(float *s, int64_t len) {
    float m = max_f32(s, len), sum = 0.f, gap[EXP_CHUNK];
    for (int64_t j0 = 0; j0 < len; j0 += EXP_CHUNK) {
        const int64_t n = len - j0 < EXP_CHUNK ? len - j0 : EXP_CHUNK;
        #pragma omp simd
        for (int64_t j = 0; j < n; j++) gap[j] = m - s[j0 + j];
        exp_neg_f32(gap, s + j0, n);
    }
    #pragma omp simd reduction(+:sum)
    for (int64_t j = 0; j < len; j++) sum += s[j];
    const float inv = 1.f / sum;
    #pragma omp simd
    for (int64_t j = 0; j < len; j++) s[j] *= inv;
}

/* Software prefetch of the next query row's K and V while this row is processed. Read from DRAM,
   the sweeps below ran at ~5 GB/s (the embedded model's batch-32 layer: 0.85 ms in the engine,
   0.35 ms with its KV in cache), far below a streaming read: a sequence's blocks are 8 KiB
   pieces at scattered addresses and the hardware prefetcher does not follow a block table (nor
   cross a 4 KiB page). The cursor walks the next row's K blocks then its V blocks, a 64-byte
   line per hint, at the pace this row reads its own (so about a row ahead). */
typedef struct {
    const char *k_cache, *v_cache;
    const int32_t *table;      /* the next row's block-table row; NULL: nothing (left) to prefetch */
    int64_t num_blocks, block_bytes, block, offset, in_v;
} prefetch_cursor;

/* Hints for the next `bytes` of the next row's blocks, a 64-byte line per hint. */
static inline void prefetch_advance(prefetch_cursor *c, int64_t bytes) {
    while (bytes > 0 && c->table) {
        const char *base = (c->in_v ? c->v_cache : c->k_cache) + (int64_t)c->table[c->block] * c->block_bytes;
        const int64_t take = c->block_bytes - c->offset < bytes ? c->block_bytes - c->offset : bytes;
        for (int64_t i = 0; i < take; i += 64) __builtin_prefetch(base + c->offset + i, 0, 2);
        c->offset += take;
        bytes -= take;
        if (c->offset == c->block_bytes) {
            c->offset = 0;
            if (++c->block == c->num_blocks) {
                c->block = 0;
                if (c->in_v++) c->table = NULL;  /* K and V both done */
            }
        }
    }
}

/* ---- The common shapes: head_dim a multiple of VW (the vector width: 16 floats with AVX-512,
   else 8) and at most 8 VW, VW % (query heads per KV head) == 0 ------------------------------
   A dot product of one query head with one key ends in a sum across a vector's lanes, costing
   about as much as its multiply-adds at head_dim 64. Here VW such dots (VW / qpk keys x the qpk
   query heads sharing their KV head) are summed together by one transposing tree, and the weighted
   sum of V keeps 4 vectors x 2 heads of output in registers over a block. A layer on the dev EPYC
   (Zen 4, one thread, 2026-12-03; cold: after reading 96 MB elsewhere), against decode_row_generic:
   32 sequences x 132 keys, 2 KV heads of 64, qpk 2: 107 vs 197 us warm, 283 vs 299 us cold;
   8 x 300 keys, 8 KV heads of 128, qpk 4: 1305 vs 1687 warm, 1600 vs 2000 cold; built for AVX2
   (-march=x86-64-v3) the first: 124 vs 198 warm, 284 vs 304 cold. In the engine (embedded model,
   batch 32 and batch 4, contexts ~130, the two builds alternating step by step) the model's time
   fell 4-6% in four runs; the rest of a batch-32 layer's attention waits for its KV from memory. */
#ifdef __has_builtin
#if __has_builtin(__builtin_shufflevector)
#define HAVE_SHUFFLEVECTOR 1
#endif
#endif
#define VW VEC_W      /* vec_exp_f32.h */
typedef vec_f32 vecf;
#define LDV(p) (*(const vecf *)(p))
#define splatv vec_splat

/* Lane i of the result: the sum of a[i]'s VW lanes (a transposing tree: VW - 1 adds). */
static inline vecf sum_lanes(const vecf *a) {
#if defined(HAVE_SHUFFLEVECTOR) && VW == 16
    vecf b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)  /* b[i]: a[2i]'s halves added | a[2i + 1]'s */
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)  /* c[i]: four partial sums each of a[4i .. 4i + 3] */
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)  /* d[i]: two each of a[8i .. 8i + 7] */
        d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#elif defined(HAVE_SHUFFLEVECTOR) && VW == 8
    vecf b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13)
             + __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14)
         + __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
#else  /* a compiler without the builtin (GCC before 12): lane by lane */
    vecf r;
    for (int i = 0; i < VW; i++) {
        float t = 0.f;
        for (int l = 0; l < VW; l++) t += a[i][l];
        r[i] = t;
    }
    return r;
#endif
}

typedef vec_i32 veci;

/* Lane i of the result: a[i] or b[i], whichever is larger (a where b is NaN) */
static inline vecf max_lanes(vecf a, vecf b) {
    const veci take = b > a;
    return (vecf)(((veci)a & ~take) | ((veci)b & take));
}

/* v's first n lanes, then fill */
static inline vecf first_lanes(vecf v, int64_t n, float fill) {
    veci lane;
    for (int i = 0; i < VW; i++) lane[i] = i;
    const veci keep = lane < (int32_t)n;
    return (vecf)(((veci)v & keep) | ((veci)splatv(fill) & ~keep));
}

/* The 2 VW floats at src as two vectors: the even-numbered ones (*even) and the odd-numbered ones (*odd) */
static inline void deinterleave(const float *src, vecf *even, vecf *odd) {
#if defined(HAVE_SHUFFLEVECTOR) && VW == 16
    const vecf a = LDV(src), b = LDV(src + VW);
    *even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    *odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#elif defined(HAVE_SHUFFLEVECTOR) && VW == 8
    const vecf a = LDV(src), b = LDV(src + VW);
    *even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14);
    *odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
#else
    vecf e, o;
    for (int i = 0; i < VW; i++) { e[i] = src[2 * i]; o[i] = src[2 * i + 1]; }
    *even = e; *odd = o;
#endif
}

/* even and odd (as deinterleave gives them) back in order: the 2 VW floats at dst */
static inline void interleave(vecf even, vecf odd, float *dst) {
#if defined(HAVE_SHUFFLEVECTOR) && VW == 16
    *(vecf *)dst = __builtin_shufflevector(even, odd, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    *(vecf *)(dst + VW) = __builtin_shufflevector(even, odd, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
#elif defined(HAVE_SHUFFLEVECTOR) && VW == 8
    *(vecf *)dst = __builtin_shufflevector(even, odd, 0, 8, 1, 9, 2, 10, 3, 11);
    *(vecf *)(dst + VW) = __builtin_shufflevector(even, odd, 4, 12, 5, 13, 6, 14, 7, 15);
#else
    for (int i = 0; i < VW; i++) { dst[2 * i] = even[i]; dst[2 * i + 1] = odd[i]; }
#endif
}

/* exp(x) for x <= 0, a vector at a time: exp_neg_f32's reduction and polynomial (vec_exp_f32.h) in
   registers, x clamped below at -87 (exp(-87) ~ 1.6e-38, where exp_neg_f32 clamps too), NaN kept */
static inline vecf exp_nonpositive(vecf x) {
    return vec_exp_clamped(max_lanes(x, splatv(-87.f)));  /* (NaN kept: max_lanes takes x where the comparison fails) */
}

/* s[0 .. n) := exp(s[j] - top) in place (top: their maximum); returns their sum */
static inline float exp_sum_below(float *s, int64_t n, float top) {
    const vecf t = splatv(top);
    vecf acc = splatv(0.f);
    int64_t j = 0;
    for (; j + VW <= n; j += VW) {
        const vecf e = exp_nonpositive(LDV(s + j) - t);
        *(vecf *)(s + j) = e;
        acc += e;
    }
    if (j < n) {  /* the last n - j scores, through a vector padded with zeros after exp */
        vecf v = splatv(top);
        memcpy(&v, s + j, (size_t)(n - j) * sizeof(float));
        const vecf e = first_lanes(exp_nonpositive(v - t), n - j, 0.f);
        memcpy(s + j, &e, (size_t)(n - j) * sizeof(float));
        acc += e;
    }
    float sum = 0.f;
    for (int i = 0; i < VW; i++) sum += acc[i];
    return sum;
}

/* The vector width (floats) decode_row_tiled uses for these heads, 0 where the rows take
   decode_row_generic (for the engine's startup log). */
int64_t paged_decode_tile_width(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
    const int64_t qpk = num_kv_heads > 0 && num_heads % num_kv_heads == 0 ? num_heads / num_kv_heads : 0;
    return qpk && head_dim % VW == 0 && VW % qpk == 0 && head_dim <= 8 * VW ? VW : 0;
}

/* The vector width of this build. */
int64_t paged_decode_vector_width(void) { return VW; }

/* The rows for each element type the cache may hold (paged_decode_rows.h): float32, and bfloat16
   (kv_cache_dtype="bfloat16": half the bytes read; its values widened to float32 exactly, by a shift). */
#define KV_T float
#define KV_LOAD(p) LDV(p)
#define KV_FLOAT(x) (x)
#define KV_STORE_ROW(dst, src, n) memcpy(dst, src, (n) * sizeof(float))
#define KV_NAME(f) f##_f32
#define KV_PAIRED 0
#define KV_LOAD_PAIRED(p, odd) KV_LOAD(p)  /* (never used: KV_PAIRED is 0) */
#include "paged_decode_rows.h"
#undef KV_T
#undef KV_LOAD
#undef KV_FLOAT
#undef KV_STORE_ROW
#undef KV_NAME
#undef KV_PAIRED
#undef KV_LOAD_PAIRED

typedef uint16_t vec_bf16 __attribute__((vector_size(VW * 2), aligned(2), may_alias));
typedef uint32_t vec_u32 __attribute__((vector_size(VW * 4)));

/* VW bfloat16 values at p as floats: a bfloat16 is the top half of a float32's bits. With AVX-512 or
   AVX2, one zero-extending load (vpmovzxwd from memory): GCC 12 builds __builtin_convertvector of 16-bit
   lanes from two half-width extensions, an extract and an insert, and that made the bfloat16 kernel
   compute-bound (0.63 ms a step against 0.36 ms for a bare read of its KV, probe_kv_read.py). */
#if defined(__AVX512F__) && VW == 16
#include <immintrin.h>
static inline vecf bf16_load(const uint16_t *p) {
    return (vecf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
#elif defined(__AVX2__) && VW == 8
#include <immintrin.h>
static inline vecf bf16_load(const uint16_t *p) {
    return (vecf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
}
#else
static inline vecf bf16_load(const uint16_t *p) {
    return (vecf)(__builtin_convertvector(*(const vec_bf16 *)p, vec_u32) << 16);
}
#endif

static inline float bf16_float(uint16_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A float rounded to the nearest bfloat16, ties to even, as torch converts (bit for bit, but for NaN:
   always the quiet NaN 0x7fc0, where torch's vectorised conversion may give another NaN). */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline void bf16_store_row(uint16_t *dst, const float *src, int64_t n) {
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_round(src[i]);
}

/* Of the 2 VW bfloat16 values at p, the even-numbered ones (odd == 0) or the odd-numbered ones as floats:
   read as VW 32-bit words, element 2i is the low half of word i (little-endian) and 2i + 1 its high half,
   so one shift or one mask each (decode_row_tiled's paired loads). */
typedef uint32_t vec_w32 __attribute__((vector_size(VW * 4), aligned(2), may_alias));
static inline vecf bf16_load_paired(const uint16_t *p, int odd) {
    const vec_w32 w = *(const vec_w32 *)p;
    return odd ? (vecf)(w & 0xffff0000u) : (vecf)(w << 16);
}

#define KV_T uint16_t
#define KV_LOAD(p) bf16_load(p)
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define KV_PAIRED 1
#define KV_LOAD_PAIRED(p, odd) bf16_load_paired(p, odd)
#else
#define KV_PAIRED 0
#define KV_LOAD_PAIRED(p, odd) KV_LOAD(p)
#endif
#define KV_FLOAT(x) bf16_float(x)
#define KV_STORE_ROW(dst, src, n) bf16_store_row(dst, src, n)
#define KV_NAME(f) f##_bf16
#include "paged_decode_rows.h"
#undef KV_T
#undef KV_LOAD
#undef KV_FLOAT
#undef KV_STORE_ROW
#undef KV_NAME
#undef KV_PAIRED
#undef KV_LOAD_PAIRED

/* paged_decode_attention_f32's (or _bf16's) arguments, for a split over threads (native_parallel_run
   in the panel GEMM library calls paged_decode_part for each part). scratch holds parts x
   scratch_floats; kv_bf16: the caches hold bfloat16. */
typedef struct {
    const float *q;
    const void *k_cache, *v_cache;
    const int32_t *block_tables;
    int64_t table_stride;
    const int32_t *row_seq, *row_lens;
    float *out;
    int64_t num_rows, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    float *scratch;
    int64_t scratch_floats, kv_bf16;
} decode_call;

/* Rows num_rows * part / parts up to the next part's first, with the part's own scratch. */
void paged_decode_part(void *ctx, int part, int parts) {
    const decode_call *a = (const decode_call *)ctx;
    const int64_t lo = a->num_rows * part / parts, hi = a->num_rows * (part + 1) / parts;
    const int64_t per_row = a->num_heads * a->head_dim;
    if (hi <= lo) return;
    if (a->kv_bf16)
        paged_decode_attention_bf16(a->q + lo * per_row, a->k_cache, a->v_cache, a->block_tables, a->table_stride,
                                    a->row_seq + lo, a->row_lens + lo, a->out + lo * per_row, hi - lo, a->num_heads,
                                    a->num_kv_heads, a->head_dim, a->block_size, a->scale,
                                    a->scratch + part * a->scratch_floats);
    else
        paged_decode_attention_f32(a->q + lo * per_row, a->k_cache, a->v_cache, a->block_tables, a->table_stride,
                                   a->row_seq + lo, a->row_lens + lo, a->out + lo * per_row, hi - lo, a->num_heads,
                                   a->num_kv_heads, a->head_dim, a->block_size, a->scale,
                                   a->scratch + part * a->scratch_floats);
}

/* Packed twins for a CPU graph's replay in C (packed_call.h) */
PACKED(paged_decode_attention_f32) {
    paged_decode_attention_f32(ARG_P(0), ARG_P(1), ARG_P(2), ARG_P(3), ARG_I(4), ARG_P(5), ARG_P(6), ARG_P(7), ARG_I(8),
                               ARG_I(9), ARG_I(10), ARG_I(11), ARG_I(12), ARG_F(13), ARG_P(14));
    return 0;
}
PACKED(paged_decode_attention_bf16) {
    paged_decode_attention_bf16(ARG_P(0), ARG_P(1), ARG_P(2), ARG_P(3), ARG_I(4), ARG_P(5), ARG_P(6), ARG_P(7),
                                ARG_I(8), ARG_I(9), ARG_I(10), ARG_I(11), ARG_I(12), ARG_F(13), ARG_P(14));
    return 0;
}
PACKED(paged_store_kv_f32) {
    return paged_store_kv_f32(ARG_P(0), ARG_I(1), ARG_P(2), ARG_I(3), ARG_P(4), ARG_I(5), ARG_I(6), ARG_P(7), ARG_P(8),
                              ARG_I(9)) >= 0;
}

PACKED(paged_store_kv_bf16) {
    return paged_store_kv_bf16(ARG_P(0), ARG_I(1), ARG_P(2), ARG_I(3), ARG_P(4), ARG_I(5), ARG_I(6), ARG_P(7),
                               ARG_P(8), ARG_I(9)) >= 0;
}

/* ---- Causal self-attention of fresh prompts ------------------------------------------------
   A prompt computed from its first token (no cached prefix) attends only over its own tokens, so
   its K and V are read from the step's k and v, not the paged cache. For the embedded model's 32
   prompts of 17-236 tokens (4004 tokens; dev EPYC Zen 4, one thread, 2026-12-02) torch's CPU flash
   SDPA, one call per prompt, took 14.9 ms per layer and the row-at-a-time kernel above 17.0 ms in
   one run; in another, SDPA 13.7 ms and this function 8.9 ms. Here up to TILE query vectors (rows x the heads sharing one KV head) are scored together
   against VW keys at a time (a vector's width) from a transposed copy of the head's keys: each key vector loaded
   feeds TILE multiply-adds, as in a GEMM. With AVX-512 the scores and the weighted sums of V take 16-float
   vectors (each output still summed in the same order: the same bits as 8-float ones); on a 2-core Xeon (one
   thread, 2026-12-06, the two builds alternating) a 512-token prompt of Qwen3-0.6B's heads (16 query, 8 KV,
   head_dim 128) took 18.3-18.5 ms a layer against 27.4-28.6 with 8-float vectors, a 236-token prompt of the
   embedded model's (4 query, 2 KV, 64) 0.39-0.49 against 0.61-0.85 ms (medians of 7 calls). Each score row
   becomes exp(score - its maximum) in one pass that also sums them, and the weighted sums of V are divided by
   that sum once, at the end (not a softmax pass of its own); V is summed for QV query vectors at a time (4
   with AVX-512), so each vector of V loaded from the L2 feeds QV multiply-adds. Together, on the same Xeon
   (2026-12-06, one thread, builds alternating, medians of 11-31 calls): the embedded model's 32 prompts of the cpu
   workload (4004 tokens) 6.20 / 8.68 / 8.95 -> 5.21 / 6.83 / 6.51 ms a layer, Qwen3-0.6B's heads over a
   512-token prompt 21.30 -> 17.56 ms, built for AVX2 (QV 2) 8.95 -> 8.13 ms. */
typedef float v8f __attribute__((vector_size(32), aligned(4), may_alias));
#define TILE 8
#define QV (VW == 16 ? 4 : 2)  /* query vectors per pass over V (AVX2's 16 registers hold 2 x 4 accumulators) */

static inline v8f splat8(float s) { v8f v = {s, s, s, s, s, s, s, s}; return v; }

/* For each prompt s (tokens starts[s] .. starts[s] + lens[s] - 1 of the step) and head h:
     out[t, h, :] = softmax_{j <= i}(scale * q[t, h, :] . k[t0 + j, h / qpk, :]) @ v[t0 + j, h / qpk, :]
   for its token t = t0 + i. q, k, v, out: rows of heads x head_dim floats, unit stride inside a
   row, row strides q_stride, k_stride, v_stride, out_stride (floats). head_dim % 8 == 0. Only KV
   heads g_lo .. g_hi - 1 (and their query heads) are computed: calls for disjoint ranges may run
   on separate threads (one long prompt split over threads).
   scratch: >= (head_dim + TILE) * npad floats, npad = max(lens) rounded up to VW. */
void causal_self_attention_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                               const float *v, int64_t v_stride, float *out, int64_t out_stride,
                               const int64_t *starts, const int64_t *lens, int64_t num_seqs, int64_t num_heads,
                               int64_t num_kv_heads, int64_t g_lo, int64_t g_hi, int64_t head_dim, float scale,
                               float *scratch) {
    const int64_t qpk = num_heads / num_kv_heads;
    const int64_t rows_per_block = qpk >= TILE ? 1 : TILE / qpk;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t t0 = starts[s], n = lens[s], npad = (n + VW - 1) & ~(int64_t)(VW - 1);
        float *kt = scratch, *sc = scratch + head_dim * npad;  /* kt [head_dim, npad]; sc [TILE, npad] */
        for (int64_t g = g_lo; g < g_hi; g++) {
            for (int64_t j = 0; j < n; j++) {  /* the head's keys, transposed */
                const float *kj = k + (t0 + j) * k_stride + g * head_dim;
                for (int64_t d = 0; d < head_dim; d++) kt[d * npad + j] = kj[d];
            }
            for (int64_t d = 0; d < head_dim; d++)  /* padding keys: zero (scored, then dropped) */
                for (int64_t j = n; j < npad; j++) kt[d * npad + j] = 0.f;
            for (int64_t i0 = 0; i0 < n; i0 += rows_per_block) {
                const int64_t rows = n - i0 < rows_per_block ? n - i0 : rows_per_block;
                for (int64_t a0 = 0; a0 < rows * qpk; a0 += TILE) {  /* query vectors a = r * qpk + head */
                    const int64_t na = rows * qpk - a0 < TILE ? rows * qpk - a0 : TILE;
                    const float *qa[TILE];
                    int64_t len[TILE], kmax = 0;
                    for (int64_t a = 0; a < TILE; a++) {  /* unused slots repeat the first (not stored) */
                        const int64_t b = a < na ? a : 0, r = (a0 + b) / qpk, h = g * qpk + (a0 + b) % qpk;
                        qa[a] = q + (t0 + i0 + r) * q_stride + h * head_dim;
                        len[a] = i0 + r + 1;  /* row i0 + r sees keys 0 .. i0 + r */
                        kmax = len[a] > kmax ? len[a] : kmax;
                    }
                    const int64_t kpad = (kmax + VW - 1) & ~(int64_t)(VW - 1);
                    /* scores of the tile, VW keys per vector */
                    for (int64_t j0 = 0; j0 < kpad; j0 += VW) {
                        vecf acc[TILE];
                        for (int64_t a = 0; a < TILE; a++) acc[a] = splatv(0.f);
                        for (int64_t d = 0; d < head_dim; d++) {
                            const vecf kv = LDV(kt + d * npad + j0);
                            for (int64_t a = 0; a < TILE; a++) acc[a] += splatv(qa[a][d]) * kv;
                        }
                        for (int64_t a = 0; a < na; a++) *(vecf *)(sc + a * npad + j0) = acc[a] * splatv(scale);
                    }
                    /* each vector's first len[a] scores as exp(score - their maximum), later keys 0; the
                       weighted sums of V below divide by the exps' sum once, at the end */
                    float inv[TILE];
                    for (int64_t a = 0; a < na; a++) {
                        float *sa = sc + a * npad;
                        inv[a] = 1.f / exp_sum_below(sa, len[a], max_f32(sa, len[a]));
                        for (int64_t j = len[a]; j < kpad; j++) sa[j] = 0.f;
                    }
                    /* weighted sums of V: QV query vectors at a time, 4 VW output floats per pass, so each
                       vector of V loaded feeds QV multiply-adds (V is read from the L2 once per pass) */
                    for (int64_t a = 0; a < na; a += QV) {
                        const int64_t nq = na - a < QV ? na - a : QV;
                        const float *pp[QV];
                        float *oo[QV], iv[QV];
                        int64_t jn = 0;
                        for (int64_t b = 0; b < QV; b++) {  /* unused slots repeat the first (not stored) */
                            const int64_t c = a + (b < nq ? b : 0), r = (a0 + c) / qpk, h = g * qpk + (a0 + c) % qpk;
                            pp[b] = sc + c * npad;
                            oo[b] = out + (t0 + i0 + r) * out_stride + h * head_dim;
                            iv[b] = inv[c];
                            jn = len[c] > jn ? len[c] : jn;  /* scores past a vector's own len are 0 */
                        }
                        int64_t d0 = 0;
                        for (; d0 + 4 * VW <= head_dim; d0 += 4 * VW) {  /* 4 QV accumulators, in registers */
                            vecf x[QV][4];
                            for (int64_t b = 0; b < QV; b++)
                                for (int i = 0; i < 4; i++) x[b][i] = splatv(0.f);
                            for (int64_t j = 0; j < jn; j++) {
                                const float *vj = v + (t0 + j) * v_stride + g * head_dim + d0;
                                const vecf e0 = LDV(vj), e1 = LDV(vj + VW), e2 = LDV(vj + 2 * VW), e3 = LDV(vj + 3 * VW);
                                for (int64_t b = 0; b < QV; b++) {
                                    const vecf w = splatv(pp[b][j]);
                                    x[b][0] += w * e0; x[b][1] += w * e1; x[b][2] += w * e2; x[b][3] += w * e3;
                                }
                            }
                            for (int64_t b = 0; b < nq; b++)
                                for (int i = 0; i < 4; i++) *(vecf *)(oo[b] + d0 + i * VW) = x[b][i] * splatv(iv[b]);
                        }
                        for (; d0 < head_dim; d0 += 8) {  /* head_dim not a multiple of 4 VW: the rest, 8 floats a pass */
                            v8f x[QV];
                            for (int64_t b = 0; b < QV; b++) x[b] = splat8(0.f);
                            for (int64_t j = 0; j < jn; j++) {
                                const v8f e0 = *(const v8f *)(v + (t0 + j) * v_stride + g * head_dim + d0);
                                for (int64_t b = 0; b < QV; b++) x[b] += splat8(pp[b][j]) * e0;
                            }
                            for (int64_t b = 0; b < nq; b++) *(v8f *)(oo[b] + d0) = x[b] * splat8(iv[b]);
                        }
                    }
                }
            }
        }
    }
}
