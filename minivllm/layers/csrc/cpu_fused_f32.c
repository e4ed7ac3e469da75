/* The small per-layer ops of a Qwen3 decoder layer on the CPU, fp32: RMSNorm (with and without
   the residual add), the rotary embedding and SiLU-and-multiply, one C call each.
   Part of minivllm; built at first use by minivllm/layers/cpu_fused.py and called through ctypes.

   Why: in eager PyTorch each of these is several ATen ops (RMSNorm alone is a cast, a power, a
   mean, a reciprocal square root and two multiplies), and on a small CPU every op costs
   microseconds of dispatch before it touches a byte. At decode sizes (a few to a few dozen
   tokens) that dispatch is the whole cost: 40-110 us per op where the arithmetic takes 1-3 us.
   The math and its order follow minivllm/layers/norm.py, rotary.py and activation.py (the
   reference implementations); results agree to float32 rounding (sums are reassociated). */
#include <stdint.h>
#include <string.h>
#include <math.h>

#include "vec_exp_f32.h"
#include "packed_call.h"

/* Row r of x (r < outer * inner) starts at x + (r / inner) * s_outer + (r % inner) * s_inner
   (elements): a [T, H, D] view cut from a fused projection (q_norm, k_norm) or a plain [T, D]
   matrix (inner = 1). out is contiguous [outer * inner, dim]:
     out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)) */
static inline void rms_norm_row(const float *xr, const float *w, float eps, float *o, int64_t dim) {
    float ss = 0.f;
    #pragma omp simd reduction(+:ss)
    for (int64_t d = 0; d < dim; d++) ss += xr[d] * xr[d];
    const float inv = 1.f / sqrtf(ss / (float)dim + eps);
    #pragma omp simd
    for (int64_t d = 0; d < dim; d++) o[d] = w[d] * (xr[d] * inv);
}

void rms_norm_f32(const float *x, int64_t outer, int64_t inner, int64_t s_outer, int64_t s_inner,
                  const float *w, float *out, int64_t dim, float eps) {
    for (int64_t r = 0; r < outer * inner; r++)
        rms_norm_row(x + (r / inner) * s_outer + (r % inner) * s_inner, w, eps, out + r * dim, dim);
}

/* sum = x + residual (the residual stream for the next block), out = rms_norm(sum) as above.
   x, residual, sum, out: contiguous [rows, dim]. */
void add_rms_norm_f32(const float *x, const float *residual, const float *w, float *sum, float *out,
                      int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim, *rr = residual + r * dim;
        float *sr = sum + r * dim, *o = out + r * dim, ss = 0.f;
        #pragma omp simd reduction(+:ss)
        for (int64_t d = 0; d < dim; d++) { sr[d] = xr[d] + rr[d]; ss += sr[d] * sr[d]; }
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        #pragma omp simd
        for (int64_t d = 0; d < dim; d++) o[d] = w[d] * (sr[d] * inv);
    }
}

/* Rotate-half RoPE of every head of x [tokens, heads, dim] (strides s_tok, s_head, 1) by the
   token's position: with c, s = cos_sin[pos, :dim/2], cos_sin[pos, dim/2:] and halves x1, x2,
     out = cat(x1 * c - x2 * s, x2 * c + x1 * s)          (out contiguous [tokens, heads, dim])
   Returns -1, or the first token whose position is outside [0, max_position): nothing is read
   through it (its rows of out are left unwritten). */
static inline void rope_row(const float *x1, const float *c, const float *s, float *o1, int64_t half) {
    const float *x2 = x1 + half;
    float *o2 = o1 + half;
    #pragma omp simd
    for (int64_t d = 0; d < half; d++) {
        o1[d] = x1[d] * c[d] - x2[d] * s[d];
        o2[d] = x2[d] * c[d] + x1[d] * s[d];
    }
}

/* The cos half of position pos's row of the table cos_sin [max_position, dim] (the sin half follows
   at + dim / 2), or NULL for a position outside the table. */
static inline const float *rope_table_row(const float *cos_sin, int64_t pos, int64_t max_position, int64_t dim) {
    return pos < 0 || pos >= max_position ? NULL : cos_sin + pos * dim;
}

int64_t rope_f32(const float *x, int64_t tokens, int64_t heads, int64_t s_tok, int64_t s_head,
                 const int64_t *positions, const float *cos_sin, int64_t max_position, float *out, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = rope_table_row(cos_sin, positions[t], max_position, dim);
        if (!c) return t;
        const float *s = c + half;
        for (int64_t h = 0; h < heads; h++)
            rope_row(x + t * s_tok + h * s_head, c, s, out + (t * heads + h) * dim, half);
    }
    return -1;
}

/* silu_and_mul_f32 (below) for VEC_W values (vec_exp_f32.h) at a time, in registers: the steps of
   exp_neg_f32 and of the tail loop's last line, in the same order (the same bits), in one pass over
   the row instead of three loops through stack buffers (2-core Xeon, one thread, 2026-12-06, two
   builds alternating: 32 rows of 768 18.3 -> 15.1 us, 4693 rows 3.01 -> 2.27 ms). */
static inline vec_f32 silu_mul_vec(vec_f32 g, vec_f32 u) {
    const vec_f32 lo = vec_splat(-87.f), hi = vec_splat(88.f);
    vec_f32 x = -g;
    x = (vec_f32)(((vec_i32)x & ~(x < lo)) | ((vec_i32)lo & (x < lo)));
    x = (vec_f32)(((vec_i32)x & ~(x > hi)) | ((vec_i32)hi & (x > hi)));
    const vec_f32 e = vec_exp_clamped(x);
    const vec_i32 under = g < -88.f;
    const vec_f32 s = (vec_f32)(((vec_i32)(g * 0.f) & under) | ((vec_i32)(g / (1.f + e)) & ~under));
    return s * u;
}

/* x [rows, 2 * inter] (gate | up, row stride s_row), out contiguous [rows, inter]:
     out = silu(gate) * up,  silu(g) = g / (1 + exp(-g))
   For g < -88, exp(-g) overflows float32 (the reference's sigmoid is then 0): g * 0, which is -0 for
   a finite g and NaN for -inf, as in torch. */
void silu_and_mul_f32(const float *x, int64_t rows, int64_t s_row, float *out, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * s_row, *u = g + inter;
        float *o = out + r * inter;
        int64_t d = 0;
        for (; d + VEC_W <= inter; d += VEC_W)
            *(vec_f32 *)(o + d) = silu_mul_vec(*(const vec_f32 *)(g + d), *(const vec_f32 *)(u + d));
        for (int64_t d0 = d; d0 < inter; d0 += EXP_CHUNK) {
            const int64_t n = inter - d0 < EXP_CHUNK ? inter - d0 : EXP_CHUNK;
            exp_neg_f32(g + d0, o + d0, n);  /* o holds exp(-g) until the next line */
            #pragma omp simd
            for (int64_t d = d0; d < d0 + n; d++)  /* past the clamp exp(-g) is inf: silu(g) = g * 0 */
                o[d] = (g[d] < -88.f ? g[d] * 0.f : g[d] / (1.f + o[d])) * u[d];
        }
    }
}

/* The token embedding's lookup: out[t] = table[ids[t]] for a contiguous table [vocab, dim] and out
   [n, dim]. Returns the first t whose id is outside [0, vocab), nothing written from it on, or -1.
   (F.embedding in a CPU graph's replay is an ATen dispatch that, right after a step has streamed
   the KV cache and the weights, ran from cold caches: 100-150 us for 32 rows of the embedded model.) */
int64_t embedding_f32(const float *table, int64_t vocab, int64_t dim, const int64_t *ids, int64_t n, float *out) {
    for (int64_t t = 0; t < n; t++) {
        const int64_t id = ids[t];
        if (id < 0 || id >= vocab) return t;
        memcpy(out + t * dim, table + id * dim, (size_t)dim * sizeof(float));
    }
    return -1;
}

/* Greedy sampling's argmax over rows of logits x [rows, cols >= 1] (row stride s_row): out[r] is the
   index of row r's first maximum, or -1 when the row holds a NaN or an infinity (the sampler then
   ends that request with an error). One pass: ACCS vectors of running maxima, each lane keeping the
   index of its first maximum (a strict >), combined at the end by value then lowest index; beside
   them the sum of x * 0, which is NaN exactly when some x is NaN or +-inf. (numpy's argmax and its
   non-finite check took ~95 us for 32 rows of 4,096 logits in the embedded model's batch-32 step;
   warm, 31 us against 16 us for this pass, dev EPYC, 2026-12-04.) */
#if defined(__AVX512F__)
#define AW 16  /* lanes */
#else
#define AW 8
#endif
typedef float argf __attribute__((vector_size(AW * 4)));
typedef int32_t argi __attribute__((vector_size(AW * 4)));
#define ACCS 4

void argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t s_row, int64_t *out) {
    argi lane;
    for (int i = 0; i < AW; i++) lane[i] = i;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * s_row;
        float m = xr[0], nonfinite = 0.f;
        int64_t best = 0, j = 0;
        if (cols >= ACCS * AW && cols <= INT32_MAX) {
            argf mv[ACCS], nf[ACCS];
            argi iv[ACCS];
            for (int a = 0; a < ACCS; a++) {
                memcpy(&mv[a], xr + a * AW, sizeof(argf));
                iv[a] = lane + a * AW;
                nf[a] = mv[a] * 0.f;
            }
            for (j = ACCS * AW; j + ACCS * AW <= cols; j += ACCS * AW) {
                for (int a = 0; a < ACCS; a++) {
                    argf v;
                    memcpy(&v, xr + j + a * AW, sizeof(argf));
                    const argi gt = v > mv[a];  /* strict: a lane keeps its first maximum */
                    mv[a] = (argf)(((argi)v & gt) | ((argi)mv[a] & ~gt));
                    iv[a] = ((lane + (int32_t)(j + a * AW)) & gt) | (iv[a] & ~gt);
                    nf[a] += v * 0.f;
                }
            }
            m = mv[0][0];
            best = iv[0][0];
            for (int a = 0; a < ACCS; a++) {
                for (int i = 0; i < AW; i++) {
                    const float v = mv[a][i];
                    if (v > m || (v == m && iv[a][i] < best)) { m = v; best = iv[a][i]; }
                    nonfinite += nf[a][i];
                }
            }
        }
        for (; j < cols; j++) {  /* the tail (or a short row) */
            nonfinite += xr[j] * 0.f;
            if (xr[j] > m) { m = xr[j]; best = j; }
        }
        out[r] = nonfinite == 0.f ? best : -1;
    }
}

/* Qwen3's per-head q_norm and k_norm followed by the rotary embedding of q and k, one call for a
   step's tokens (four calls otherwise: each norm, then RoPE of each). q [tokens, q_heads, dim]
   (strides qs_tok, qs_head, 1) and k likewise, both usually views of the fused QKV projection's
   output; q_out and k_out contiguous. Per head row: rms_norm_row with its weight (wq or wk, eps_q
   or eps_k) into a row buffer, then rope_row by the token's position: the arithmetic of the four
   calls. Returns -1, or the first token whose position is outside [0, max_position) (its rows and
   later ones are left unwritten). dim even, <= 1024. */
static inline void norm_rope_row(const float *x, const float *w, float eps, const float *c, const float *s,
                                 float *o, int64_t dim, float *buf) {
    rms_norm_row(x, w, eps, buf, dim);
    rope_row(buf, c, s, o, dim / 2);
}

int64_t qk_norm_rope_f32(const float *q, int64_t q_heads, int64_t qs_tok, int64_t qs_head,
                         const float *k, int64_t k_heads, int64_t ks_tok, int64_t ks_head,
                         int64_t tokens, int64_t dim, const float *wq, float eps_q, const float *wk, float eps_k,
                         const int64_t *positions, const float *cos_sin, int64_t max_position,
                         float *q_out, float *k_out) {
    float buf[1024];
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = rope_table_row(cos_sin, positions[t], max_position, dim);
        if (!c) return t;
        const float *s = c + half;
        for (int64_t h = 0; h < q_heads; h++)
            norm_rope_row(q + t * qs_tok + h * qs_head, wq, eps_q, c, s, q_out + (t * q_heads + h) * dim, dim, buf);
        for (int64_t h = 0; h < k_heads; h++)
            norm_rope_row(k + t * ks_tok + h * ks_head, wk, eps_k, c, s, k_out + (t * k_heads + h) * dim, dim, buf);
    }
    return -1;
}

/* ---- Packed twins for a CPU graph's replay in C (packed_call.h): the same arguments, in order;
   non-zero where the function reports bad input (its ctypes wrapper then raises the error) ---- */
PACKED(rms_norm_f32) {
    rms_norm_f32(ARG_P(0), ARG_I(1), ARG_I(2), ARG_I(3), ARG_I(4), ARG_P(5), ARG_P(6), ARG_I(7), ARG_F(8));
    return 0;
}
PACKED(add_rms_norm_f32) {
    add_rms_norm_f32(ARG_P(0), ARG_P(1), ARG_P(2), ARG_P(3), ARG_P(4), ARG_I(5), ARG_I(6), ARG_F(7));
    return 0;
}
PACKED(rope_f32) {
    return rope_f32(ARG_P(0), ARG_I(1), ARG_I(2), ARG_I(3), ARG_I(4), ARG_P(5), ARG_P(6), ARG_I(7), ARG_P(8),
                    ARG_I(9)) >= 0;
}
PACKED(silu_and_mul_f32) {
    silu_and_mul_f32(ARG_P(0), ARG_I(1), ARG_I(2), ARG_P(3), ARG_I(4));
    return 0;
}
PACKED(embedding_f32) {
    return embedding_f32(ARG_P(0), ARG_I(1), ARG_I(2), ARG_P(3), ARG_I(4), ARG_P(5)) >= 0;
}
PACKED(qk_norm_rope_f32) {
    return qk_norm_rope_f32(ARG_P(0), ARG_I(1), ARG_I(2), ARG_I(3), ARG_P(4), ARG_I(5), ARG_I(6), ARG_I(7), ARG_I(8),
                            ARG_I(9), ARG_P(10), ARG_F(11), ARG_P(12), ARG_F(13), ARG_P(14), ARG_P(15), ARG_I(16),
                            ARG_P(17), ARG_P(18)) >= 0;
}

/* ---- int8 activations per token (the CPU int8 path, minivllm/quantization/int8.py) -------------
   torch's dynamic int8 linear quantises its input with one range for the whole call, so a token's
   grid would depend on the other rows. int8_rows_in_f32 maps each row of x [m, k] (row stride ldx)
   affinely onto [-1, 1] (its minimum to -1, its maximum to 1: x = mid + half * x') into out's first
   m rows, and writes range rows after them holding exactly -1 and 1 (one row alternating them, or
   two rows of one value each when k == 1), so every call's range is [-1, 1]. A row with a NaN or an
   infinity gets x' = 0 (the others keep their grid) and mid = NaN, so its outputs are NaN.
   out: contiguous [m + (k == 1 ? 2 : 1), k]; mid, half: [m]. */
void int8_rows_in_f32(const float *x, int64_t ldx, int64_t m, int64_t k, float *out, float *mid, float *half) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * ldx;
        float *o = out + r * k;
        float lo = INFINITY, hi = -INFINITY, bad = 0.f;
        #pragma omp simd reduction(min:lo) reduction(max:hi) reduction(+:bad)
        for (int64_t i = 0; i < k; i++) {
            lo = xr[i] < lo ? xr[i] : lo;
            hi = xr[i] > hi ? xr[i] : hi;
            bad += xr[i] * 0.f;  /* NaN exactly when some value is NaN or +-inf */
        }
        if (bad != 0.f) {
            memset(o, 0, (size_t)k * sizeof(float));
            mid[r] = NAN;
            half[r] = 1.f;
            continue;
        }
        /* halves first: hi + lo and hi - lo overflow from |x| ~ 1.7e38 */
        const float c = 0.5f * hi + 0.5f * lo, d = 0.5f * hi - 0.5f * lo, h = d > 1e-30f ? d : 1e-30f;
        #pragma omp simd
        for (int64_t i = 0; i < k; i++) {
            const float v = (xr[i] - c) / h;
            o[i] = v < -1.f ? -1.f : v > 1.f ? 1.f : v;
        }
        mid[r] = c;
        half[r] = h;
    }
    float *range = out + m * k;
    if (k == 1) {
        range[0] = -1.f;
        range[1] = 1.f;
        return;
    }
    for (int64_t i = 0; i < k; i++) range[i] = i % 2 ? 1.f : -1.f;
}

/* Undoes the map on the output y [m, n] (contiguous) of x' @ W^T in place:
   y[r, j] = half[r] * y[r, j] + mid[r] * row_sums[j] (+ bias[j]); bias may be NULL. */
void int8_rows_out_f32(float *y, int64_t m, int64_t n, const float *mid, const float *half, const float *row_sums,
                       const float *bias) {
    for (int64_t r = 0; r < m; r++) {
        float *yr = y + r * n;
        const float c = mid[r], h = half[r];
        if (bias) {
            #pragma omp simd
            for (int64_t j = 0; j < n; j++) yr[j] = h * yr[j] + c * row_sums[j] + bias[j];
        } else {
            #pragma omp simd
            for (int64_t j = 0; j < n; j++) yr[j] = h * yr[j] + c * row_sums[j];
        }
    }
}
