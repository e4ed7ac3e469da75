/* Paged attention for short queries on the CPU, fp32 (decode: one query token per sequence;
   draft verification and short chunks: a few, causal), keys and values read in place from the
   paged KV cache through the block table (no gathered copy, no mask).
   Part of minivllm; built at first use by minivllm/layers/attention/cpu_decode.py and called
   through ctypes (which releases the GIL, so chunks of sequences can run on several threads).

   Per query row: scores for every head in one sweep over its K slots (a slot holds all KV heads
   of one token, so each slot is read once), a max-subtracted softmax per head, then one sweep
   over its V slots accumulating every head's output. */
#include <stdint.h>
#include <math.h>
#include <string.h>

#include "../../csrc/vec_exp_f32.h"

/* For each query row r (a token; rows of one sequence share its block table) and head h
   (kv head h / qpk):
     out[r, h, :] = softmax_j(scale * q[r, h, :] . K_j[h / qpk, :]) @ V_j[h / qpk, :]
   over the row's first row_lens[r] keys, read in place from the paged cache through block table
   row_seq[r]: key j is slot j % block_size of block block_tables[row_seq[r], j / block_size].
   A decode step has one row per sequence with its whole context; a short causal query (draft
   verification) has one row per token, each seeing the keys up to its own position.
   Layouts (contiguous fp32): q, out [R, H, D]; k_cache, v_cache [num_blocks, block_size, Hk, D];
   block_tables int32 [S, table_stride]; row_seq, row_lens int32 [R]; scratch >= H * max(row_lens). */
/* Software prefetch of the next query row's K and V while this row is processed. Read from DRAM,
   the sweeps below ran at ~5 GB/s (the embedded model's batch-32 layer: 0.85 ms in the engine,
   0.35 ms with its KV in cache), far below a streaming read: a sequence's blocks are 8 KiB
   pieces at scattered addresses and the hardware prefetcher does not follow a block table (nor
   cross a 4 KiB page). The cursor walks the next row's K blocks then its V blocks, a 64-byte
   line per hint, at the pace this row reads its own (so about a row ahead). */
typedef struct {
    const float *k_cache, *v_cache;
    const int32_t *table;      /* the next row's block-table row; NULL: nothing (left) to prefetch */
    int64_t num_blocks, block_floats, block, offset, in_v;
} prefetch_cursor;

static inline void prefetch_advance(prefetch_cursor *c, int64_t floats) {
    while (floats > 0 && c->table) {
        const float *base = (c->in_v ? c->v_cache : c->k_cache) + (int64_t)c->table[c->block] * c->block_floats;
        const int64_t take = c->block_floats - c->offset < floats ? c->block_floats - c->offset : floats;
        for (int64_t i = 0; i < take; i += 16) __builtin_prefetch(base + c->offset + i, 0, 2);
        c->offset += take;
        floats -= take;
        if (c->offset == c->block_floats) {
            c->offset = 0;
            if (++c->block == c->num_blocks) {
                c->block = 0;
                if (c->in_v++) c->table = NULL;  /* K and V both done */
            }
        }
    }
}

void paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                                const int32_t *block_tables, int64_t table_stride,
                                const int32_t *row_seq, const int32_t *row_lens, float *out,
                                int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                int64_t block_size, float scale, float *scratch) {
    const int64_t qpk = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim;  /* floats per slot: all kv heads of one token */
    for (int64_t r = 0; r < num_rows; r++) {
        const int64_t len = row_lens[r];
        const int32_t *table = block_tables + (int64_t)row_seq[r] * table_stride;
        const float *qg = q + r * num_heads * head_dim;
        float *s = scratch;  /* scores [H, len] */
        prefetch_cursor pf = {k_cache, v_cache, NULL, 0, block_size * row, 0, 0, 0};
        if (r + 1 < num_rows && row_seq[r + 1] != row_seq[r]) {  /* a new sequence's blocks next */
            pf.table = block_tables + (int64_t)row_seq[r + 1] * table_stride;
            pf.num_blocks = (row_lens[r + 1] + block_size - 1) / block_size;
        }
        /* Pass 1: every head's scores, one sweep over the sequence's K slots. Four slots at a
           time: four independent dot products per head keep the FMA units busy (one dot alone
           is a chain of dependent adds) and each query row is loaded once per four keys. */
        for (int64_t j0 = 0; j0 < len; j0 += block_size) {
            const float *kb = k_cache + (int64_t)table[j0 / block_size] * block_size * row;
            const int64_t n = len - j0 < block_size ? len - j0 : block_size;
            int64_t t = 0;
            for (; t + 4 <= n; t += 4) {
                prefetch_advance(&pf, 4 * row);
                for (int64_t h = 0; h < num_heads; h++) {
                    const float *qh = qg + h * head_dim, *k0 = kb + t * row + (h / qpk) * head_dim;
                    const float *k1 = k0 + row, *k2 = k1 + row, *k3 = k2 + row;
                    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
                    #pragma omp simd reduction(+:a0, a1, a2, a3)
                    for (int64_t d = 0; d < head_dim; d++) {
                        a0 += qh[d] * k0[d]; a1 += qh[d] * k1[d]; a2 += qh[d] * k2[d]; a3 += qh[d] * k3[d];
                    }
                    float *sh = s + h * len + j0 + t;
                    sh[0] = a0 * scale; sh[1] = a1 * scale; sh[2] = a2 * scale; sh[3] = a3 * scale;
                }
            }
            for (; t < n; t++) {
                const float *kr = kb + t * row;
                prefetch_advance(&pf, row);
                for (int64_t h = 0; h < num_heads; h++) {
                    const float *qh = qg + h * head_dim, *kh = kr + (h / qpk) * head_dim;
                    float acc = 0.f;
                    #pragma omp simd reduction(+:acc)
                    for (int64_t d = 0; d < head_dim; d++) acc += qh[d] * kh[d];
                    s[h * len + j0 + t] = acc * scale;
                }
            }
        }
        /* Softmax of each head's row, in place (max subtracted: exp never overflows), exp
           vectorised in chunks: with libm's expf, one value at a time, a layer of 32 sequences
           of 200-260 keys (the embedded model's shapes, caches hot) took 0.67-0.94 ms, with this
           0.66-0.76 ms in the same runs (dev EPYC, one thread, 2026-12-01). */
        for (int64_t h = 0; h < num_heads; h++) {
            float *sh = s + h * len, m = -INFINITY, sum = 0.f, gap[EXP_CHUNK];
            for (int64_t j = 0; j < len; j++) m = sh[j] > m ? sh[j] : m;
            for (int64_t j0 = 0; j0 < len; j0 += EXP_CHUNK) {
                const int64_t n = len - j0 < EXP_CHUNK ? len - j0 : EXP_CHUNK;
                #pragma omp simd
                for (int64_t j = 0; j < n; j++) gap[j] = m - sh[j0 + j];
                exp_neg_f32(gap, sh + j0, n);
            }
            #pragma omp simd reduction(+:sum)
            for (int64_t j = 0; j < len; j++) sum += sh[j];
            const float inv = 1.f / sum;
            #pragma omp simd
            for (int64_t j = 0; j < len; j++) sh[j] *= inv;
        }
        /* Pass 2: weighted sum of V, one sweep over the V slots for all heads, four slots per
           update of each head's output row. */
        float *og = out + r * num_heads * head_dim;
        memset(og, 0, num_heads * head_dim * sizeof(float));
        for (int64_t j0 = 0; j0 < len; j0 += block_size) {
            const float *vb = v_cache + (int64_t)table[j0 / block_size] * block_size * row;
            const int64_t n = len - j0 < block_size ? len - j0 : block_size;
            int64_t t = 0;
            for (; t + 4 <= n; t += 4) {
                prefetch_advance(&pf, 4 * row);
                for (int64_t h = 0; h < num_heads; h++) {
                    const float *ph = s + h * len + j0 + t, *v0 = vb + t * row + (h / qpk) * head_dim;
                    const float *v1 = v0 + row, *v2 = v1 + row, *v3 = v2 + row;
                    const float p0 = ph[0], p1 = ph[1], p2 = ph[2], p3 = ph[3];
                    float *oh = og + h * head_dim;
                    #pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) oh[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
                }
            }
            for (; t < n; t++) {
                const float *vr = vb + t * row;
                prefetch_advance(&pf, row);
                for (int64_t h = 0; h < num_heads; h++) {
                    const float p = s[h * len + j0 + t], *vh = vr + (h / qpk) * head_dim;
                    float *oh = og + h * head_dim;
                    #pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) oh[d] += p * vh[d];
                }
            }
        }
    }
}

/* Write each token's new K and V into the paged cache: token t's row (all kv heads, ``row``
   floats, unit stride) goes to slot slots[t] of both caches ([num_slots, row] each); slot -1 is
   skipped (a padded row of a decode graph). Returns the first token whose slot is outside
   [-1, num_slots), nothing written from it on, or -1 when all were in range. */
int64_t paged_store_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                           const int64_t *slots, int64_t tokens, int64_t row, float *k_cache, float *v_cache,
                           int64_t num_slots) {
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t s = slots[t];
        if (s == -1) continue;
        if (s < -1 || s >= num_slots) return t;
        memcpy(k_cache + s * row, k + t * k_stride, row * sizeof(float));
        memcpy(v_cache + s * row, v + t * v_stride, row * sizeof(float));
    }
    return -1;
}
