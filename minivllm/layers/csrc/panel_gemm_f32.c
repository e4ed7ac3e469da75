/* y = x @ W^T (+ bias) on the CPU in fp32 for the few rows of a decode step, with W stored in
   column panels. Part of minivllm; built at first use by minivllm/layers/cpu_gemm.py and called
   through ctypes.

   Why: a decode step multiplies a handful of rows (one per sequence) by every weight, so it should
   cost one read of the weights, as at one row. On the 2-core dev EPYC (AVX2, one thread) MKL's
   sgemm and oneDNN's prepacked linear cost 1.6-2.8x more at 4 rows than at one on the 0.6B
   model's shapes; this kernel streams each weight once for up to 6 rows and keeps the FMA units
   busy enough to stay near the memory's pace (probe and figures: cpu_gemm.py).

   Layout: W [N, K] (N a multiple of 16) is stored as panels P [N / 16][K][16]: panel b holds
   output columns 16b .. 16b + 15, one 64-byte line per k (32 bytes for 16-bit values: below). A
   panel is read front to back once per group of up to 6 rows of x, in chunks of KC values of k so
   the chunk stays in the L1/L2 cache while several row groups (a prefill) reuse it. The inner loop
   is the outer-product form: per k, two vector loads of the panel, one broadcast per row of x, two
   FMAs per row, accumulators in registers (6 rows x 2 vectors = 12 of the 16 AVX2 registers). No
   horizontal sums. GCC's vector extensions so the same source builds for NEON (x86 intrinsics only
   to widen 16-bit values, behind their feature macros). Built for a CPU with AVX-512 (-march=native
   defines __AVX512F__), passes of two or more rows use 16-float vectors and more accumulators
   instead (below).

   int8 panels (weight-only int8, WT_I8 with a scale per output): 16 bytes per k, widened to float32 as they are
   loaded; the per-output-channel scale multiplies each output once, after the sum over k, then the
   bias is added.

   Sums run over k in order within a chunk, so results differ from MKL's by float32 reassociation
   (about 1e-6 relative). */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "packed_call.h"

/* 8 floats; loads and stores through a v8 pointer may be unaligned and may alias float memory
   (memcpy into locals instead made GCC keep the accumulators on the stack: 4x slower) */
typedef float v8 __attribute__((vector_size(32), aligned(4), may_alias));
#define NR 16     /* output columns per panel */
#define MR 6      /* rows of x per pass over a panel chunk */
#define KC 256    /* k values per chunk (16 KiB of panel) */
/* rows of x per block of a call with many rows (panel_gemm_range), in bytes of x, rounded down to whole passes
   of 12 rows, at least 24. On a 2-core Xeon with AVX-512 (one thread, 2026-12-06, float16 panels): Qwen3-0.6B's
   four linears at 256 rows (a call's most, cpu_gemm.ROWS_PER_CALL) 143 -> 151 GFLOP/s (best of 8), in one
   engine switching it on and off prefill by prefill (six 512-token prefills each) 4984 -> 4723 and 4094 ->
   3948 ms (medians); the embedded model's 2000-token prefill 368 -> 362 ms. 64-512 KiB: within 5% of this. */
#define X_BLOCK_BYTES (128 * 1024)
#define WSIZE(wt) (TYPE(wt) == WT_F32 ? 4 : TYPE(wt) == WT_I8 ? 1 : 2)
#define PF 128    /* prefetch distance: PF lines of float32 panel, 8 KiB ahead in the stream whatever the panel type (4 KiB read 11-12 GB/s at one row, 8 KiB 13-15) */
/* Software prefetch only in passes of at least PF_MIN_ROWS rows. On the AVX-512 Zen 4 dev EPYC
   (2026-12-03, one thread, 180 MiB of Qwen3-0.6B layer weights) the hardware prefetcher alone
   streamed passes of 1, 2, 4 and 6 rows 10-20% faster (one row: 21-23 against 19 GB/s), while 8 and 16 rows
   ran 4-13% slower without the software prefetch; on the AVX2 EPYC it helped at one row (above).
   On the 2-core AVX-512 Intel Xeon (2026-12-06, one thread, 1.76 GB of Qwen3-0.6B-shaped float32 panels,
   two builds alternating pass by pass) the opposite: at one row hints 2 KiB ahead read 5-8% more per
   second than none (means 13.3-16.3 against 12.6-15.5 GB/s), 8 KiB ahead no more than none; at 2 / 4 / 6
   rows hints 8 KiB ahead gained 3-5 / 7-11 / 11-13% over none, and at 4 rows 2 KiB gained 16-17% (15.0
   against 12.9 GB/s; bfloat16 panels 20% more at 1 and 4 rows); in the engine random:qwen3-0.6b's batch-1
   step 6% and batch-4 step 13-14% shorter, the embedded model's batch-1 step (weights in cache: nothing to
   hide) 2-4% longer. So an AVX-512 build hints passes of fewer rows PF_FEW_BYTES ahead where the CPU is
   Intel's, and not at all elsewhere (pf_few, set once when the library loads). */
/* int8 panels (weight-only int8), passes of 1-6 rows: one hint per 64-byte line, 1 KiB ahead in the
   panel's stream. On a 2-core Xeon (AVX-512, one thread, 2026-12-06, 440 MiB of Qwen3-0.6B-shaped int8
   panels at one row) the hardware prefetcher alone read 11.5-11.8 GB/s; hints 0.5 / 1 / 2 / 4 / 8 KiB
   ahead 12.7-13.3 / 12.6-13.7 / 11.6-13.3 / 10.9-12.4 / 11.2-11.4 GB/s; at 4 rows 11.3 -> 12.3 GB/s.
   From 7 rows (compute-bound) the float hint below, which ran 4% faster there, in passes of 7 or more rows:
   with AVX-512, 13 rows on (7-12 rows go in two passes of up to 6: panel_chunk). */
#define PF_I8 1024
#define PF_I8_MAX_ROWS 6
#ifdef __AVX512F__
#define PF_MIN_ROWS 7
#define PF_FEW_BYTES 2048
static int64_t pf_few;  /* bytes ahead for passes of 1 .. PF_MIN_ROWS - 1 rows, 0: no hint */
__attribute__((constructor)) static void choose_few_row_prefetch(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    pf_few = __builtin_cpu_is("intel") ? PF_FEW_BYTES : 0;
#endif
}
#else
#define PF_MIN_ROWS 1
#endif

static inline v8 splat(float s) { v8 v = {s, s, s, s, s, s, s, s}; return v; }

/* Weight types: the panels hold float32 (WT_F32), or the 16-bit values a checkpoint stored, widened
   to float32 exactly as they are loaded (WT_F16: IEEE half; WT_BF16: bfloat16, the top half of a
   float32). The arithmetic is float32 either way, so a weight that round-trips through the 16-bit
   type gives the same bits as its float32 panel; a decode step reads half the bytes. WT_I8: the int8
   values of a quantised weight, widened the same way and scaled per output after the sum (panel_gemm_w).
   `wt` is a constant after inlining. */
#define WT_F32 0
#define WT_F16 1
#define WT_BF16 2
#define WT_I8 3
/* Grouped panels (WT_GROUPED, a flag on a weight type; N a multiple of 64): group c holds the k lines of
   panels 4c .. 4c + 3 one after another, [K][4][16], so a pass over four panels (a decode step's few
   rows) reads one stream of whole cache lines; panel by panel, it reads four streams of 16 values per k
   (int8: 16 bytes per k each). Qwen3-0.6B-shaped int8 weights streamed at one row (1024 -> 151936, dev
   EPYC Zen 4, one thread, 2026-12-07, best of 7 passes over three copies, 2 MiB pages): 28.0 GB/s
   grouped against 20.0 panel by panel (4 KiB pages: 21.3 against 16.5); with a software hint 1 KiB
   ahead 24.5 grouped, so a grouped int8 pass of one row gives none. Cache-resident, both ran at ~30
   GB/s: there the widening's arithmetic, not the memory, is the ceiling, and from two rows on the FMAs
   are. Grouped int8 passes of 2-6 rows hint one line per k 1 KiB ahead. Qwen3-0.6B's five linear shapes,
   ~600 MiB of each cycled, 2 MiB pages, same run, best of 5, GB/s panel by panel -> grouped:
       rows       1            2            4            6          8          16
       int8   17.5 -> 25.2  16.1 -> 18.8  11.7 -> 12.6  8.6 -> 9.0  6.1 -> 6.3
       bf16   26.8 -> 31.5  26.9 -> 31.4  20.1 -> 21.6              10.9 -> 11.1  5.5 -> 5.6 (64, 256 rows level)
       f16    27.4 -> 30.1                19.8 -> 21.2                            5.4 -> 5.6 (256 rows level)
       f32    28.4 -> 28.9  27.5 -> 30.7  26.6 -> 29.5              17.3 -> 18.9  10.4 -> 8.8, 64 rows 2.6 -> 2.4
   (int8 without the hint: 2-8 rows 3-5% slower than panel by panel). Those grouped passes of 13 rows or
   more went over two panels of a group, in groups of 12 rows, as passes panel by panel do: for float32
   half of each 256-byte k line. Over all four panels in groups of 6 rows instead (panel_chunk; same bits),
   the float32 figures from 13 rows became (a later run, GB/s panel by panel -> grouped) 13 rows 11.6 ->
   13.4, 16 rows 10.4 -> 12.1, 32 rows 5.2 -> 5.9, 64 rows 2.6 -> 2.9, 256 rows 0.6 -> 0.8 (1 / 4 / 8 rows
   29.7 -> 31.2 / 28.3 -> 30.6 / 17.8 -> 19.0); bf16 at 13 / 16 / 64 / 256 rows 6.1 -> 6.8, 5.2 -> 5.9, 1.3
   -> 1.5, 0.3 -> 0.4; int8 3.3 -> 4.0, 2.8 -> 3.4, 0.7 -> 0.9, 0.2 -> 0.2. In the engine, two engines of
   random:qwen3-0.6b (float32 panels) in one process taking turns: a 512-token prefill 4.85-4.94 s grouped
   against 5.59-5.67 s, batch-4 / 16 decode steps 83-85 / 200-207 ms against 87-91 / 232-233 ms, batch 1
   level; the embedded model (float16 panels, cache-resident): a 1500-token prefill 0.155-0.159 s against
   0.166-0.173 s, batch-32 decode 2.97-3.18 ms against 3.32-3.56 ms. So every panel type is grouped where
   the build has AVX-512 (panel_gemm_prefers_groups, with an AVX2 build's figures). Not timed on the
   Intel Xeon. */
#define WT_GROUPED 8  /* a flag on any of the above: panels in groups (above) */
#define WT_I8G (WT_I8 | WT_GROUPED)
#define GROUP_PANELS 4
#define TYPE(wt) ((wt) & (WT_GROUPED - 1))
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int8_t i8x8 __attribute__((vector_size(8), aligned(1), may_alias));
/* Half floats widen in one instruction with F16C (x86: vcvtph2ps; GCC 12 turned a vector
   conversion of _Float16 into a lane-by-lane call, 2x slower than float32 panels); elsewhere
   the library makes no half-precision panels. */
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__F16C__)
#define HAVE_F16 1
#else
#define HAVE_F16 0
#endif

/* The software prefetch of a pass of `rows` rows at step k, for the panel line at element q (wt and
   rows are constants after inlining; see PF, PF_MIN_ROWS and PF_I8 above) */
static inline __attribute__((always_inline)) void prefetch_panel(const int wt, const int rows, int64_t k,
                                                                 const void *pc, int64_t q) {
    if (wt == WT_I8G && rows <= PF_I8_MAX_ROWS) {  /* one line of four panels per k (WT_GROUPED above) */
        if (rows > 1 && (q & 63) == 0)
            __builtin_prefetch((const char *)pc + q + PF_I8);
        return;
    }
    if (wt == WT_I8 && rows <= PF_I8_MAX_ROWS) {  /* a panel's int8 line lasts 4 k: one hint per line */
        if ((k & 3) == 0)
            __builtin_prefetch((const char *)pc + q + PF_I8);
    } else if (rows >= PF_MIN_ROWS)
        __builtin_prefetch((const char *)pc + q * WSIZE(wt) + PF * NR * 4);  /* PF lines of float32 ahead */
#ifdef __AVX512F__
    else if (pf_few)
        __builtin_prefetch((const char *)pc + q * WSIZE(wt) + pf_few);
#endif
}

static inline __attribute__((always_inline)) v8 load_w8(const int wt, const void *base, int64_t i) {
#if HAVE_F16
    if (TYPE(wt) == WT_F16)
        return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
#endif
    if (TYPE(wt) == WT_BF16) {  /* the bits of a float32 whose low half is zero */
#if defined(__AVX2__)  /* (GCC 12 split the generic form into halves and an insert: 1.4x slower) */
        return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i))), 16);
#else
        return (v8)(__builtin_convertvector(*(const u16x8 *)((const uint16_t *)base + i), u32x8) << 16);
#endif
    }
    if (TYPE(wt) == WT_I8) {  /* int8 weights (weight-only quantisation): widened to float32 exactly */
#if defined(__AVX2__)
        return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + i))));
#else
        return __builtin_convertvector(*(const i8x8 *)((const int8_t *)base + i), v8);
#endif
    }
    return *(const v8 *)((const float *)base + i);
}

/* 1 when this build widens half-precision panels in hardware (else they are not made) */
int panel_gemm_has_f16(void) { return HAVE_F16; }

/* Whether grouped panels (WT_GROUPED) pay in this build: with AVX-512 a pass of up to 12 rows reads all
   four panels of a group. An AVX2 build's passes of 2 or more rows read two panels or one, so each pass
   streams every line of the group again: Qwen3-0.6B's shapes built for x86-64-v3 (same Zen 4, one
   thread, 2026-12-07, GB/s panel by panel -> grouped) bf16 1 row 20.7 -> 29.0 but 2 rows 22.2 -> 17.8,
   8 rows 9.6 -> 6.4, 64 rows 1.5 -> 1.2; int8 1 row 14.2 -> 15.6, 2-16 rows 3-11% slower. */
int panel_gemm_prefers_groups(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* `rows` rows (1..MR) of x times a chunk of kc values of k of `g` adjacent panels (pc: the first
   panel's chunk; the next panel's is pstride elements on, or NR for grouped panels, whose k lines are
   GROUP_PANELS * NR elements apart). rows and g are constants after inlining,
   and rows * g <= 6 keeps the 2 * rows * g accumulators within AVX2's 16 vector registers (with
   the panel vectors, 1 x 4 and 3 x 2 need one more, which the compiler folds into the FMAs'
   memory operands or spills). The accumulators start from
   the bias (first chunk) or from y (later chunks). Reading g panels at once is g streams through
   memory: at one row, one stream read 14 GB/s, four 19 GB/s (dev EPYC, 300 MB weight). */
static inline __attribute__((always_inline)) void panel_rows(const int wt, const int rows, const int g, const float *x,
        int64_t ldx, const void *pc, int64_t pstride, int64_t kc, const float *init, int64_t ld_init,
        float *y, int64_t ldy) {
    v8 a0[MR][4], a1[MR][4];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < g; j++) {
            if (init) {
                a0[r][j] = *(const v8 *)(init + r * ld_init + j * NR);
                a1[r][j] = *(const v8 *)(init + r * ld_init + j * NR + 8);
            } else {
                a0[r][j] = splat(0.f);
                a1[r][j] = splat(0.f);
            }
        }
    for (int64_t k = 0; k < kc; k++) {
        v8 w0[4], w1[4];
        for (int j = 0; j < g; j++) {
            const int64_t q = wt & WT_GROUPED ? j * NR + k * (GROUP_PANELS * NR) : j * pstride + k * NR;
            prefetch_panel(wt, rows, k, pc, q);
            w0[j] = load_w8(wt, pc, q);
            w1[j] = load_w8(wt, pc, q + 8);
        }
        for (int r = 0; r < rows; r++) {
            v8 xb = splat(x[r * ldx + k]);
            for (int j = 0; j < g; j++) {
                a0[r][j] += xb * w0[j];
                a1[r][j] += xb * w1[j];
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < g; j++) {
            *(v8 *)(y + r * ldy + j * NR) = a0[r][j];
            *(v8 *)(y + r * ldy + j * NR + 8) = a1[r][j];
        }
}

#if !defined(__AVX512F__)
/* one chunk of k for all m rows of g (1, 2 or 4) adjacent panels */
static inline __attribute__((always_inline)) void panel_chunk(const int wt, int g, const float *x, int64_t ldx,
        const void *pc, int64_t pstride, int64_t m,
                        int64_t kc, const float *init, int64_t ld_init, float *y, int64_t ldy) {
    if (g == 4) {  /* m == 1 */
        panel_rows(wt, 1, 4, x, ldx, pc, pstride, kc, init, ld_init, y, ldy);
        return;
    }
    if (g == 2) {  /* 2 <= m <= 6: rows in groups of 3 (the second group reads the two panels from cache;
                       at 8 rows, three groups measured slower than one panel at a time) */
        int64_t r = 0;
        for (; r + 3 <= m; r += 3)
            panel_rows(wt, 3, 2, x + r * ldx, ldx, pc, pstride, kc, init ? init + r * ld_init : NULL, ld_init,
                       y + r * ldy, ldy);
        const float *ir = init ? init + r * ld_init : NULL;
        if (m - r == 2) panel_rows(wt, 2, 2, x + r * ldx, ldx, pc, pstride, kc, ir, ld_init, y + r * ldy, ldy);
        else if (m - r == 1) panel_rows(wt, 1, 2, x + r * ldx, ldx, pc, pstride, kc, ir, ld_init, y + r * ldy, ldy);
        return;
    }
    int64_t r = 0;
    for (; r + MR <= m; r += MR)
        panel_rows(wt, MR, 1, x + r * ldx, ldx, pc, pstride, kc, init ? init + r * ld_init : NULL, ld_init,
                   y + r * ldy, ldy);
    const float *ir = init ? init + r * ld_init : NULL;
    const float *xr = x + r * ldx;
    float *yr = y + r * ldy;
    switch (m - r) {  /* the last 1-5 rows, each count its own unrolled code */
        case 1: panel_rows(wt, 1, 1, xr, ldx, pc, pstride, kc, ir, ld_init, yr, ldy); break;
        case 2: panel_rows(wt, 2, 1, xr, ldx, pc, pstride, kc, ir, ld_init, yr, ldy); break;
        case 3: panel_rows(wt, 3, 1, xr, ldx, pc, pstride, kc, ir, ld_init, yr, ldy); break;
        case 4: panel_rows(wt, 4, 1, xr, ldx, pc, pstride, kc, ir, ld_init, yr, ldy); break;
        case 5: panel_rows(wt, 5, 1, xr, ldx, pc, pstride, kc, ir, ld_init, yr, ldy); break;
        default: break;
    }
}

#endif

#if defined(__AVX512F__)
/* With AVX-512 one 16-float vector is a whole panel line and there are 32 vector registers, so a
   pass keeps more rows and panels in registers: up to 24 accumulators (rows x panels) with the
   panel vectors beside them. Each output still sums over k in order, so results are bit for bit
   those of the AVX2 path. On a 2-core Xeon with AVX-512 (one thread, 2026-12-02) the 256-bit
   passes ran cache-resident linears at 104-117 GFLOP/s from 32 rows up, these at 167-198
   (MKL 101-187); at one row the 256-bit pass stayed faster (8 independent accumulators
   against 4), so one row keeps it. */
typedef float v16 __attribute__((vector_size(64), aligned(4), may_alias));
#define MR16 12   /* rows per pass with two panels (24 accumulators) */

static inline v16 splat16(float s) { v16 v = {s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; return v; }

static inline __attribute__((always_inline)) v16 load_w16(const int wt, const void *base, int64_t i) {
#if HAVE_F16
    if (TYPE(wt) == WT_F16)
        return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)));
#endif
    if (TYPE(wt) == WT_BF16)
        return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i))), 16);
    if (TYPE(wt) == WT_I8)
        return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)base + i))));
    return *(const v16 *)((const float *)base + i);
}

static inline __attribute__((always_inline)) void panel_rows16(const int wt, const int rows, const int g,
        const float *x, int64_t ldx, const void *pc, int64_t pstride, int64_t kc, const float *init, int64_t ld_init,
        float *y, int64_t ldy) {
    v16 a[MR16][4];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < g; j++)
            a[r][j] = init ? *(const v16 *)(init + r * ld_init + j * NR) : splat16(0.f);
    for (int64_t k = 0; k < kc; k++) {
        v16 w[4];
        for (int j = 0; j < g; j++) {
            const int64_t q = wt & WT_GROUPED ? j * NR + k * (GROUP_PANELS * NR) : j * pstride + k * NR;
            prefetch_panel(wt, rows, k, pc, q);
            w[j] = load_w16(wt, pc, q);
        }
        for (int r = 0; r < rows; r++) {
            v16 xb = splat16(x[r * ldx + k]);
            for (int j = 0; j < g; j++)
                a[r][j] += xb * w[j];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < g; j++)
            *(v16 *)(y + r * ldy + j * NR) = a[r][j];
}

/* case labels turning a row count (1 .. 6, 7 .. 12) into a compile-time constant */
#define ROWS_1_6(G, ...) \
    case 1: panel_rows16(wt, 1, G, __VA_ARGS__); break;  case 2: panel_rows16(wt, 2, G, __VA_ARGS__); break; \
    case 3: panel_rows16(wt, 3, G, __VA_ARGS__); break;  case 4: panel_rows16(wt, 4, G, __VA_ARGS__); break; \
    case 5: panel_rows16(wt, 5, G, __VA_ARGS__); break;  case 6: panel_rows16(wt, 6, G, __VA_ARGS__); break;
#define ROWS_7_12(G, ...) \
    case 7: panel_rows16(wt, 7, G, __VA_ARGS__); break;  case 8: panel_rows16(wt, 8, G, __VA_ARGS__); break; \
    case 9: panel_rows16(wt, 9, G, __VA_ARGS__); break;  case 10: panel_rows16(wt, 10, G, __VA_ARGS__); break; \
    case 11: panel_rows16(wt, 11, G, __VA_ARGS__); break; case 12: panel_rows16(wt, 12, G, __VA_ARGS__); break;

/* one chunk of k for all m rows of g adjacent panels: g == 4 for up to 12 rows (up to 6: every panel line
   read once for all of them; 7 to 12: two groups of rows, the second reading the chunk from the L2), else
   rows in groups of 12 over g (2 or 1) panels. Two groups over four panels against one group of 7-12 rows
   over two, streamed Qwen3-0.6B-shaped 1024 -> 3072 weights (60 in turn, one thread, dev EPYC Zen 4,
   2026-12-07, best of 5 passes, three alternating builds): 7 rows 0.72-0.82 against 0.85-1.07 ms, 8 rows
   0.81-0.95 against 0.91-1.07, 12 rows 0.99-1.13 against 1.10-1.17; random:qwen3-0.6b's batch-8 decode
   step 143-150 against 164-165 ms; the embedded model's cache-resident shapes within 5% either way. A
   software prefetch in the first group (as 7+ row passes have) made those 7-12 row figures 5-15% slower.
   Not timed on the Intel Xeon (where passes of up to 6 rows prefetch: pf_few) nor with int8 panels.
   Grouped panels (WT_GROUPED) go four at a time whatever m: more than 12 rows in groups of 6 (above). */
static inline __attribute__((always_inline)) void panel_chunk(const int wt, int g, const float *x, int64_t ldx,
        const void *pc, int64_t pstride, int64_t m,
                        int64_t kc, const float *init, int64_t ld_init, float *y, int64_t ldy) {
    if (m == 1) {  /* the 256-bit pass: faster at one row (8 independent accumulators, not 4) */
        if (g == 4) panel_rows(wt, 1, 4, x, ldx, pc, pstride, kc, init, ld_init, y, ldy);
        else panel_rows(wt, 1, 1, x, ldx, pc, pstride, kc, init, ld_init, y, ldy);
        return;
    }
    if (g == 4) {  /* m <= 12: one group of rows, or two of m / 2 (rounded up, then down) over the same panels;
                      more rows (grouped panels only): groups of 6 */
        const int64_t first = m <= 6 ? m : m <= 12 ? (m + 1) / 2 : 6;
        for (int64_t r = 0; r < m;) {
            const int64_t n = !r ? first : m <= 12 ? m - r : m - r < 6 ? m - r : 6;
            const float *xr = x + r * ldx, *ir = init ? init + r * ld_init : NULL;
            float *yr = y + r * ldy;
            switch (n) { ROWS_1_6(4, xr, ldx, pc, pstride, kc, ir, ld_init, yr, ldy) default: break; }
            r += n;
        }
        return;
    }
    for (int64_t r = 0; r < m; r += MR16) {
        const int64_t n = m - r < MR16 ? m - r : MR16;
        const float *xr = x + r * ldx, *ir = init ? init + r * ld_init : NULL;
        float *yr = y + r * ldy;
        if (g == 2)
            switch (n) { ROWS_1_6(2, xr, ldx, pc, pstride, kc, ir, ld_init, yr, ldy)
                         ROWS_7_12(2, xr, ldx, pc, pstride, kc, ir, ld_init, yr, ldy) default: break; }
        else
            switch (n) { ROWS_1_6(1, xr, ldx, pc, pstride, kc, ir, ld_init, yr, ldy)
                         ROWS_7_12(1, xr, ldx, pc, pstride, kc, ir, ld_init, yr, ldy) default: break; }
    }
}
#define PANEL_GROUP(m) ((m) <= 12 ? 4 : 2)
#else
#define PANEL_GROUP(m) ((m) == 1 ? 4 : (m) <= 6 ? 2 : 1)
#endif

/* one chunk, the weight type a constant in each copy (the compiler specialises the loads) */
typedef void chunk_fn(int g, const float *x, int64_t ldx, const void *pc, int64_t pstride, int64_t m, int64_t kc,
                      const float *init, int64_t ld_init, float *y, int64_t ldy);
#define CHUNK_OF(WT, NAME) \
    static void NAME(int g, const float *x, int64_t ldx, const void *pc, int64_t pstride, int64_t m, int64_t kc, \
                     const float *init, int64_t ld_init, float *y, int64_t ldy) { \
        panel_chunk(WT, g, x, ldx, pc, pstride, m, kc, init, ld_init, y, ldy); }
CHUNK_OF(WT_F32, chunk_f32)
CHUNK_OF(WT_BF16, chunk_bf16)
CHUNK_OF(WT_I8, chunk_i8)
CHUNK_OF(WT_I8G, chunk_i8g)
CHUNK_OF(WT_F32 | WT_GROUPED, chunk_f32g)
CHUNK_OF(WT_BF16 | WT_GROUPED, chunk_bf16g)
#if HAVE_F16
CHUNK_OF(WT_F16, chunk_f16)
CHUNK_OF(WT_F16 | WT_GROUPED, chunk_f16g)
#endif

/* ---- Greedy sampling inside the LM head -----------------------------------------------------
   A plain greedy decode step samples each row's first maximum of the logits the LM head's GEMM has
   just written. Read back by a separate pass (argmax_rows_f32 in cpu_fused_f32.c, the same rule)
   they come from beyond the L2, which the head's weights streamed through since: ~53 us of the
   embedded model's batch-32 step (dev EPYC, 2026-12-04). panel_gemm_greedy_w scans each panel
   group's outputs right after they are written, still in L1: per row, a vector of running maxima
   (one lane per column of a panel) with the column of each lane's first maximum (a strict >: the
   panels go left to right), and the sum of x * 0, NaN exactly when some x is NaN or +-inf; the
   lanes are combined at the end by value, then lowest column. */
#define GREEDY_MAX_ROWS 256
typedef float gvf __attribute__((vector_size(NR * 4)));
typedef int32_t gvi __attribute__((vector_size(NR * 4)));

typedef struct {
    gvf *best;        /* [m] running maxima */
    gvi *col;         /* [m] the column of each lane's first maximum */
    gvf *nonfinite;   /* [m] sums of x * 0 */
    int64_t cols;     /* columns that are logits (the rest: the head's padding) */
} greedy_rows;

/* The outputs of panels b .. b + g - 1 (y's columns 16 b .. 16 (b + g) - 1) into the running state */
static void greedy_scan(greedy_rows *gr, const float *y, int64_t ldy, int64_t m, int64_t b, int g) {
    for (int j = 0; j < g; j++) {
        const int64_t c0 = (b + j) * NR;
        if (c0 >= gr->cols)
            return;
        const int64_t n = gr->cols - c0 < NR ? gr->cols - c0 : NR;
        gvi at;
        for (int i = 0; i < NR; i++) at[i] = (int32_t)c0 + i;
        for (int64_t r = 0; r < m; r++) {
            const float *yr = y + r * ldy + c0;
            if (n == NR) {
                gvf v;
                memcpy(&v, yr, sizeof v);
                const gvi gt = v > gr->best[r];
                gr->best[r] = (gvf)(((gvi)v & gt) | ((gvi)gr->best[r] & ~gt));
                gr->col[r] = (at & gt) | (gr->col[r] & ~gt);
                gr->nonfinite[r] += v * 0.f;
            } else {  /* the last panel, part padding */
                for (int64_t i = 0; i < n; i++) {
                    gr->nonfinite[r][i] += yr[i] * 0.f;
                    if (yr[i] > gr->best[r][i]) {
                        gr->best[r][i] = yr[i];
                        gr->col[r][i] = (int32_t)(c0 + i);
                    }
                }
            }
        }
    }
}

/* y[m, 16 b0 .. 16 b1) = x [m, k] @ W^T (+ bias) for panels b0 .. b1 - 1 of P, whose values are of
   type wt (WT_*); with gr, each panel group's outputs go through greedy_scan once written. */
static void panel_gemm_range(int wt, const float *x, int64_t ldx, const void *p, const float *scale, const float *bias,
                             int64_t m, int64_t k, float *y, int64_t ldy, int64_t b0, int64_t b1, greedy_rows *gr) {
    if (m <= 0)
        return;
    /* Many rows of a long k (a prefill's rows of Qwen3-0.6B: 256 rows of 1024-3072 values are 1-3 MiB)
       go through every panel in blocks of about X_BLOCK_BYTES of x, so a block's rows stay in the L2
       while the panels pass; each output still sums over k in the same order (the same bits). */
    if (!gr) {
        int64_t rows_per_block = X_BLOCK_BYTES / ((int64_t)sizeof(float) * (k > 0 ? k : 1)) / 12 * 12;
        rows_per_block = rows_per_block < 24 ? 24 : rows_per_block;
        if (m > rows_per_block) {
            for (int64_t r0 = 0; r0 < m; r0 += rows_per_block)
                panel_gemm_range(wt, x + r0 * ldx, ldx, p, scale, bias,
                                 m - r0 < rows_per_block ? m - r0 : rows_per_block, k, y + r0 * ldy, ldy, b0, b1, NULL);
            return;
        }
    }
    if (TYPE(wt) == WT_F16 && !HAVE_F16)
        __builtin_trap();  /* the Python side never sends it (PanelGemm.panel_dtypes): a bug, not data */
    const int grouped = (wt & WT_GROUPED) != 0;
    chunk_fn *chunk = TYPE(wt) == WT_BF16 ? (grouped ? chunk_bf16g : chunk_bf16) :
#if HAVE_F16
                      TYPE(wt) == WT_F16 ? (grouped ? chunk_f16g : chunk_f16) :
#endif
                      TYPE(wt) == WT_I8 ? (grouped ? chunk_i8g : chunk_i8) : grouped ? chunk_f32g : chunk_f32;
    const int64_t size = WSIZE(wt);
#if defined(__AVX512F__)
    const int group = wt & WT_GROUPED ? GROUP_PANELS : PANEL_GROUP(m);  /* panels read at once */
#else
    const int group = PANEL_GROUP(m);  /* panels read at once: more streams for fewer rows */
#endif
    const int64_t line = grouped ? GROUP_PANELS * NR : NR;  /* values from one k to the next in a panel */
    for (int64_t b = b0; b < b1;) {
        /* the last few panels one at a time; grouped panels in aligned groups only (b0 may split a group) */
        int g = b + group <= b1 && (!grouped || b % group == 0) ? group : 1;
        const char *pb = (const char *)p + (grouped ? (b - b % GROUP_PANELS) * k * NR + b % GROUP_PANELS * NR
                                                    : b * k * NR) * size;
        float *yb = y + b * NR;
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
            int64_t kc = k - k0 < KC ? k - k0 : KC;
            /* first chunk starts from the bias row (ld 0: the same row for every r) or zero; with
               scales the bias comes after them (below) */
            const float *init = k0 ? yb : (bias && !scale ? bias + b * NR : NULL);
            chunk(g, x + k0, ldx, pb + k0 * line * size, k * NR, m, kc, init, k0 ? ldy : 0, yb, ldy);
        }
        if (scale)  /* y = scale * (x . q) + bias, the group's outputs still in L1 */
            for (int64_t r = 0; r < m; r++) {
                float *yr = yb + r * ldy;
                const float *sc = scale + b * NR, *bi = bias ? bias + b * NR : NULL;
                for (int64_t c = 0; c < (int64_t)g * NR; c++)
                    yr[c] = bi ? yr[c] * sc[c] + bi[c] : yr[c] * sc[c];
            }
        if (gr)
            greedy_scan(gr, y, ldy, m, b, g);
        b += g;
    }
}

/* y[m, 16 b0 .. 16 b1) = x [m, k] @ W^T (+ bias) for panels b0 .. b1 - 1 of P, whose values are of
   type wt (WT_*). x: row stride ldx (floats), unit stride along k. y: row stride ldy, written, not
   read before. bias: NULL or [N] fp32. scale: NULL, or for int8 panels (WT_I8, WT_I8G) of a weight
   W = Q * scale[:, None] (per-output-channel symmetric quantisation) the [N] fp32 scales: then
   y = scale * (x @ Q^T) + bias, each int8 value widened to float32 as it is read (weight-only: x
   stays float32). With WT_GROUPED the panels are grouped (above; nb a multiple of GROUP_PANELS, b0 and
   b1 need not be). Separate panel ranges may run on separate threads at once. */
void panel_gemm_w(int wt, const float *x, int64_t ldx, const void *p, const float *scale, const float *bias,
                  int64_t m, int64_t k, float *y, int64_t ldy, int64_t b0, int64_t b1) {
    panel_gemm_range(wt, x, ldx, p, scale, bias, m, k, y, ldy, b0, b1, NULL);
}

/* panel_gemm_w over all nb panels on the calling thread, and ids[r] = the column of row r's first
   maximum among y's first `cols` columns, or -1 when one of them is NaN or +-inf (greedy sampling of
   logits, above). Returns 0, or -1 without computing anything for m above GREEDY_MAX_ROWS or cols
   outside 1 .. 16 nb (or above INT32_MAX). */
int64_t panel_gemm_greedy_w(int wt, const float *x, int64_t ldx, const void *p, const float *bias, int64_t m,
                            int64_t k, float *y, int64_t ldy, int64_t nb, int64_t cols, int64_t *ids) {
    if (m < 0 || m > GREEDY_MAX_ROWS || cols < 1 || cols > nb * NR || cols > INT32_MAX)
        return -1;
    gvf best[GREEDY_MAX_ROWS], nonfinite[GREEDY_MAX_ROWS];
    gvi col[GREEDY_MAX_ROWS];
    gvf low, zero;
    gvi first;
    for (int i = 0; i < NR; i++) {
        low[i] = -__builtin_inff();
        zero[i] = 0.f;
        first[i] = i;
    }
    for (int64_t r = 0; r < m; r++) {
        best[r] = low;
        nonfinite[r] = zero;
        col[r] = first;
    }
    greedy_rows gr = {best, col, nonfinite, cols};
    panel_gemm_range(wt, x, ldx, p, NULL, bias, m, k, y, ldy, 0, nb, &gr);
    for (int64_t r = 0; r < m; r++) {
        float top = best[r][0], bad = 0.f;
        int64_t at = col[r][0];
        for (int i = 0; i < NR; i++) {
            if (best[r][i] > top || (best[r][i] == top && col[r][i] < at)) {
                top = best[r][i];
                at = col[r][i];
            }
            bad += nonfinite[r][i];
        }
        ids[r] = bad == 0.f ? at : -1;
    }
    return 0;
}

/* ---- the split over threads ------------------------------------------------------------------
   A persistent pool of POSIX threads. Waking a sleeping thread costs ~200 us on the dev VM (a
   Python thread pool, ~110 us), more than a decode step's matmul of a 4 MiB weight takes, so a
   worker that finishes a part keeps polling for the next task for up to SPIN_NS before it sleeps
   on a condition variable: within a decode step the next linear comes sooner than that. The poll
   is bounded (torch's OpenMP threads, by default, spin much longer), so a worker costs no CPU
   once the engine is idle. One parallel call at a time: a second caller arriving meanwhile
   (another Python thread) runs its call on its own thread. A forked child starts with an empty
   pool and unlocked locks (pthread_atfork): the parent's threads did not fork, and a lock held
   by one of them at the fork would otherwise stay held in the child. */
#include <time.h>
#define MAX_PARTS 64
#define SPIN_NS 200000

typedef void part_fn(void *ctx, int part, int parts);

typedef struct {
    const float *x, *bias, *scale;  /* scale: NULL, or int8 panels' (WT_I8, WT_I8G) */
    const void *p;
    int wt;
    float *y;
    int64_t ldx, m, k, ldy, nb;
    int parts;
    part_fn *fn;   /* non-NULL: a caller's task (native_parallel_run), not a GEMM */
    void *ctx;
} task_t;

static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER;   /* one parallel call at a time */
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;   /* guards sleepers and the waits */
static pthread_cond_t work_cv = PTHREAD_COND_INITIALIZER, done_cv = PTHREAD_COND_INITIALIZER;
static task_t task;            /* written by the caller before it publishes `word` */
static uint64_t word;          /* (task number << 8) | parts, read atomically: a worker whose id is
                                  not below parts never reads `task`, which the next call may be
                                  rewriting; a worker whose id is below it is waited for */
static int pending, workers, sleepers;
static uint64_t born_at[MAX_PARTS];  /* `word` when each worker was created: it serves later ones */

static void reset_in_child(void) {
    pthread_mutex_t m0 = PTHREAD_MUTEX_INITIALIZER, m1 = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c0 = PTHREAD_COND_INITIALIZER, c1 = PTHREAD_COND_INITIALIZER;
    call_mu = m0; pool_mu = m1; work_cv = c0; done_cv = c1;
    workers = sleepers = pending = 0;
}

__attribute__((constructor)) static void register_fork_handler(void) {
    pthread_atfork(NULL, NULL, reset_in_child);
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* polls *addr until it differs from `old`, for at most SPIN_NS; returns the last value read */
static uint64_t poll_u64(const uint64_t *addr, uint64_t old) {
    uint64_t v = __atomic_load_n(addr, __ATOMIC_ACQUIRE);
    int64_t start = now_ns();
    for (int i = 1; v == old; i++) {
        relax();
        if ((i & 63) == 0 && now_ns() - start > SPIN_NS)
            break;
        v = __atomic_load_n(addr, __ATOMIC_ACQUIRE);
    }
    return v;
}

static void run_part(const task_t *t, int part) {
    if (t->fn) {
        t->fn(t->ctx, part, t->parts);
        return;
    }
    /* grouped panels split at whole groups (nb is a multiple of GROUP_PANELS for them) */
    const int64_t unit = t->wt & WT_GROUPED ? GROUP_PANELS : 1, units = t->nb / unit;
    panel_gemm_w(t->wt, t->x, t->ldx, t->p, t->scale, t->bias, t->m, t->k, t->y, t->ldy,
                 units * part / t->parts * unit, units * (part + 1) / t->parts * unit);
}

static void *worker_main(void *arg) {
    int id = (int)(intptr_t)arg;  /* runs part id of every task with more than id parts */
    uint64_t seen = born_at[id];  /* not the current word: the first task may be published before we run */
    for (;;) {
        uint64_t w = poll_u64(&word, seen);
        if (w == seen) {
            pthread_mutex_lock(&pool_mu);
            sleepers++;
            while ((w = __atomic_load_n(&word, __ATOMIC_ACQUIRE)) == seen)
                pthread_cond_wait(&work_cv, &pool_mu);
            sleepers--;
            pthread_mutex_unlock(&pool_mu);
        }
        seen = w;
        if (id < (int)(w & 0xff)) {
            task_t t = task;
            run_part(&t, id);
            if (__atomic_sub_fetch(&pending, 1, __ATOMIC_ACQ_REL) == 0) {
                pthread_mutex_lock(&pool_mu);
                pthread_cond_signal(&done_cv);
                pthread_mutex_unlock(&pool_mu);
            }
        }
    }
    return NULL;
}

/* workers 1 .. parts - 1 exist (fewer if the system refuses threads); returns how many parts
   can run. Called with call_mu held. */
static int ensure_workers(int parts) {
    while (workers < parts - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        born_at[workers + 1] = word;  /* word changes only under call_mu, held here */
        int rc = pthread_create(&th, &attr, worker_main, (void *)(intptr_t)(workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
        workers++;
    }
    return parts < workers + 1 ? parts : workers + 1;
}

/* Publishes t (t.parts parts, workers 1 .. t.parts - 1 existing), runs part 0, and returns when
   every part has returned. Called with call_mu held; releases it. */
static void run_task(task_t t) {
    task = t;
    __atomic_store_n(&pending, t.parts - 1, __ATOMIC_RELAXED);
    __atomic_store_n(&word, ((word >> 8) + 1) << 8 | (uint64_t)t.parts, __ATOMIC_RELEASE);
    pthread_mutex_lock(&pool_mu);  /* a worker checks `word` under this lock before it sleeps */
    if (sleepers)
        pthread_cond_broadcast(&work_cv);
    pthread_mutex_unlock(&pool_mu);
    run_part(&t, 0);
    int64_t start = now_ns();
    for (int i = 1; __atomic_load_n(&pending, __ATOMIC_ACQUIRE) > 0; i++) {
        relax();
        if ((i & 63) == 0 && now_ns() - start > SPIN_NS) {
            pthread_mutex_lock(&pool_mu);
            while (__atomic_load_n(&pending, __ATOMIC_ACQUIRE) > 0)
                pthread_cond_wait(&done_cv, &pool_mu);
            pthread_mutex_unlock(&pool_mu);
            break;
        }
    }
    pthread_mutex_unlock(&call_mu);
}

/* panel_gemm_w over all nb panels, split into `parts` ranges run at once (part 0 on the
   calling thread). Returns when every part is written. */
void panel_gemm_parallel_w(int wt, const float *x, int64_t ldx, const void *p, const float *scale, const float *bias,
                           int64_t m, int64_t k, float *y, int64_t ldy, int64_t nb, int parts) {
    if (parts > MAX_PARTS)
        parts = MAX_PARTS;
    if (parts > nb)
        parts = (int)nb;
    if (parts <= 1 || pthread_mutex_trylock(&call_mu) != 0) {
        panel_gemm_w(wt, x, ldx, p, scale, bias, m, k, y, ldy, 0, nb);
        return;
    }
    parts = ensure_workers(parts);
    task_t t = {x, bias, scale, p, wt, y, ldx, m, k, ldy, nb, parts, NULL, NULL};
    run_task(t);
}

/* fn(ctx, part, n) for every part 0 .. n - 1 on the same pool (part 0 on the calling thread), n
   being `parts` or fewer (as many as the pool can run; fn takes n as given). For the CPU
   decode attention (another library, passing its function's address): one set of threads
   serves every split call of a step, still polling between them, where a second pool (Python
   threads) woke its own thread for each layer's attention while this one's polled on the
   same cores. With another call in progress (another Python thread), every part runs here,
   in order. Returns when every part has returned. */
void native_parallel_run(part_fn *fn, void *ctx, int parts) {
    if (parts > MAX_PARTS)
        parts = MAX_PARTS;
    if (parts <= 1 || pthread_mutex_trylock(&call_mu) != 0) {
        for (int part = 0; part < parts; part++)
            fn(ctx, part, parts);
        return;
    }
    parts = ensure_workers(parts);
    task_t t = {0};
    t.parts = parts;
    t.fn = fn;
    t.ctx = ctx;
    run_task(t);
}

/* Packed twins for a CPU graph's replay in C (packed_call.h) */
PACKED(panel_gemm_parallel_w) {
    panel_gemm_parallel_w((int)ARG_I(0), ARG_P(1), ARG_I(2), ARG_P(3), ARG_P(4), ARG_P(5), ARG_I(6), ARG_I(7), ARG_P(8),
                          ARG_I(9), ARG_I(10), (int)ARG_I(11));
    return 0;
}
PACKED(native_parallel_run) {
    native_parallel_run((part_fn *)ARG_P(0), ARG_P(1), (int)ARG_I(2));
    return 0;
}
