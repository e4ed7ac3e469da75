/* The decode rows and the KV store of paged_decode_f32.c for one element type of the KV cache. Included there once
   per type, with these defined:
     KV_T          the cache's element type (float, or uint16_t holding bfloat16 bits)
     KV_LOAD(p)    VW consecutive elements at p as a vecf of floats
     KV_PAIRED     1 where KV_LOAD_PAIRED exists (see decode_row_tiled), else 0
     KV_LOAD_PAIRED(p, odd)  of the 2 VW elements at p, the even-numbered (odd == 0) or odd-numbered ones
     KV_FLOAT(x)   one element as a float
     KV_STORE_ROW(dst, src, n)  n floats at src written as elements at dst
     KV_NAME(f)    f with the type's suffix (paged_decode_attention_f32, ..._bf16)
   Everything is computed in float32 whatever the cache holds: a 16-bit cache only halves the bytes
   a decode step reads, which is what bounds it (docs/benchmarks.md). Part of minivllm. */

/* One query row, any head_dim and GQA ratio: scores of every head in one sweep over the K slots,
   softmax, one sweep over the V slots. s: scores scratch [H, len]; og: the row's output [H, D]. */
static void KV_NAME(decode_row_generic)(const float *qg, const KV_T *k_cache, const KV_T *v_cache,
                                        const int32_t *table, int64_t len, float *og, float *s, int64_t num_heads,
                                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                        prefetch_cursor *pf) {
    const int64_t qpk = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim;  /* elements per slot: all kv heads of one token */
    /* Pass 1: every head's scores, one sweep over the sequence's K slots. Four slots at a
       time: four independent dot products per head keep the FMA units busy (one dot alone
       is a chain of dependent adds) and each query row is loaded once per four keys. */
    for (int64_t j0 = 0; j0 < len; j0 += block_size) {
        const KV_T *kb = k_cache + (int64_t)table[j0 / block_size] * block_size * row;
        const int64_t n = len - j0 < block_size ? len - j0 : block_size;
        int64_t t = 0;
        for (; t + 4 <= n; t += 4) {
            prefetch_advance(pf, 4 * row * (int64_t)sizeof(KV_T));
            for (int64_t h = 0; h < num_heads; h++) {
                const float *qh = qg + h * head_dim;
                const KV_T *k0 = kb + t * row + (h / qpk) * head_dim;
                const KV_T *k1 = k0 + row, *k2 = k1 + row, *k3 = k2 + row;
                float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
                #pragma omp simd reduction(+:a0, a1, a2, a3)
                for (int64_t d = 0; d < head_dim; d++) {
                    a0 += qh[d] * KV_FLOAT(k0[d]); a1 += qh[d] * KV_FLOAT(k1[d]);
                    a2 += qh[d] * KV_FLOAT(k2[d]); a3 += qh[d] * KV_FLOAT(k3[d]);
                }
                float *sh = s + h * len + j0 + t;
                sh[0] = a0 * scale; sh[1] = a1 * scale; sh[2] = a2 * scale; sh[3] = a3 * scale;
            }
        }
        for (; t < n; t++) {
            const KV_T *kr = kb + t * row;
            prefetch_advance(pf, row * (int64_t)sizeof(KV_T));
            for (int64_t h = 0; h < num_heads; h++) {
                const float *qh = qg + h * head_dim;
                const KV_T *kh = kr + (h / qpk) * head_dim;
                float acc = 0.f;
                #pragma omp simd reduction(+:acc)
                for (int64_t d = 0; d < head_dim; d++) acc += qh[d] * KV_FLOAT(kh[d]);
                s[h * len + j0 + t] = acc * scale;
            }
        }
    }
    /* Softmax of each head's row, in place */
    for (int64_t h = 0; h < num_heads; h++) softmax_f32(s + h * len, len);
    /* Pass 2: weighted sum of V, one sweep over the V slots for all heads, four slots per
       update of each head's output row. */
    memset(og, 0, num_heads * head_dim * sizeof(float));
    for (int64_t j0 = 0; j0 < len; j0 += block_size) {
        const KV_T *vb = v_cache + (int64_t)table[j0 / block_size] * block_size * row;
        const int64_t n = len - j0 < block_size ? len - j0 : block_size;
        int64_t t = 0;
        for (; t + 4 <= n; t += 4) {
            prefetch_advance(pf, 4 * row * (int64_t)sizeof(KV_T));
            for (int64_t h = 0; h < num_heads; h++) {
                const float *ph = s + h * len + j0 + t;
                const KV_T *v0 = vb + t * row + (h / qpk) * head_dim;
                const KV_T *v1 = v0 + row, *v2 = v1 + row, *v3 = v2 + row;
                const float p0 = ph[0], p1 = ph[1], p2 = ph[2], p3 = ph[3];
                float *oh = og + h * head_dim;
                #pragma omp simd
                for (int64_t d = 0; d < head_dim; d++)
                    oh[d] += p0 * KV_FLOAT(v0[d]) + p1 * KV_FLOAT(v1[d]) + p2 * KV_FLOAT(v2[d]) + p3 * KV_FLOAT(v3[d]);
            }
        }
        for (; t < n; t++) {
            const KV_T *vr = vb + t * row;
            prefetch_advance(pf, row * (int64_t)sizeof(KV_T));
            for (int64_t h = 0; h < num_heads; h++) {
                const float p = s[h * len + j0 + t];
                const KV_T *vh = vr + (h / qpk) * head_dim;
                float *oh = og + h * head_dim;
                #pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) oh[d] += p * KV_FLOAT(vh[d]);
            }
        }
    }
}

/* One query row (as decode_row_generic) for D % VW == 0 and VW % qpk == 0; inlined into calls
   with constant D and qpk. Block by block, each KV head g in turn: scores VW dots at a time
   (VW / qpk keys x the qpk heads sharing g), each head's maximum kept as they come; then each
   score's exp(score - maximum); then the weighted sum of V in chunks of 4 vectors x 2 heads of
   output, kept in registers over a block, divided by the weights' sum at the end. */
static inline __attribute__((always_inline)) void KV_NAME(decode_row_tiled)(
        const float *qg, const KV_T *k_cache, const KV_T *v_cache, const int32_t *table, int64_t len,
        float *og, float *s, int64_t Hk, const int64_t D, const int64_t qpk, int64_t block_size, float scale,
        prefetch_cursor *pf) {
    const int64_t row = Hk * D, nk = VW / qpk, DV = D / VW, CH = 4 * VW;
    /* Paired loads (KV_PAIRED, D a multiple of 2 VW): each 2 VW elements of K and V widen as two vectors,
       their even-numbered elements and their odd-numbered ones (for bfloat16: one load, a shift and a
       mask, where a vector of its own in order took a zero-extending load each, the kernel's busiest
       port; 2 VW x 16 bits are VW 32-bit words). Dot products and the weighted sum of V do not care in
       which order the elements come, so the query is put in the same order once per row (qperm) and
       the output back in order at the end. */
    const int pairs = KV_PAIRED && D % (2 * VW) == 0;
#define KV_VEC(p, c) (pairs ? KV_LOAD_PAIRED((p) + VW * ((c) & ~(int64_t)1), (c) & 1) : KV_LOAD((p) + VW * (c)))
    float qperm[pairs ? Hk * qpk * D : 1];
    if (pairs) {
        for (int64_t i = 0; i < Hk * qpk * D; i += 2 * VW)
            deinterleave(qg + i, (vecf *)(qperm + i), (vecf *)(qperm + i + VW));
        qg = qperm;
    }
    vecf most[Hk];  /* lane by lane, the largest score so far of KV head g's tiles (lane k * qpk + hh) */
    for (int64_t g = 0; g < Hk; g++) most[g] = splatv(-INFINITY);
    for (int64_t j0 = 0; j0 < len; j0 += block_size) {
        const KV_T *kb = k_cache + (int64_t)table[j0 / block_size] * block_size * row;
        const int64_t n = len - j0 < block_size ? len - j0 : block_size;
        for (int64_t g = 0; g < Hk; g++) {
            const float *qh = qg + g * qpk * D;
            for (int64_t t = 0; t < n; t += nk) {
                const int64_t m = n - t < nk ? n - t : nk;  /* keys in this tile */
                /* spread out: a burst of hints stalls on a full miss queue */
                prefetch_advance(pf, m * D * (int64_t)sizeof(KV_T));
                vecf acc[VW];
                for (int64_t k = 0; k < nk; k++) {
                    const KV_T *kr = kb + (t + k < n ? t + k : t) * row + g * D;  /* past the block: repeat a key */
                    for (int64_t hh = 0; hh < qpk; hh++) {
                        vecf a = LDV(qh + hh * D) * KV_VEC(kr, 0);
                        for (int64_t c = 1; c < DV; c++) a += LDV(qh + hh * D + VW * c) * KV_VEC(kr, c);
                        acc[k * qpk + hh] = a;
                    }
                }
                const vecf dots = sum_lanes(acc) * splatv(scale);
                most[g] = max_lanes(most[g], m == nk ? dots : first_lanes(dots, m * qpk, -INFINITY));
                for (int64_t k = 0; k < m; k++)
                    for (int64_t hh = 0; hh < qpk; hh++) s[(g * qpk + hh) * len + j0 + t + k] = dots[k * qpk + hh];
            }
        }
    }
    /* Each head's exp(score - its maximum) in place, and 1 / their sum: the weighted sum of V
       below uses them unnormalised and its output is scaled once at the end (a softmax pass
       of its own, for max, exp, sum and scale, took ~a quarter of this function's arithmetic) */
    float inv[Hk * qpk];
    for (int64_t g = 0; g < Hk; g++)
        for (int64_t hh = 0; hh < qpk; hh++) {
            float top = -INFINITY;
            for (int64_t l = hh; l < VW; l += qpk) top = most[g][l] > top ? most[g][l] : top;
            inv[g * qpk + hh] = 1.f / exp_sum_below(s + (g * qpk + hh) * len, len, top);
        }
    for (int64_t j0 = 0; j0 < len; j0 += block_size) {
        const KV_T *vb = v_cache + (int64_t)table[j0 / block_size] * block_size * row;
        const int64_t n = len - j0 < block_size ? len - j0 : block_size;
        for (int64_t g = 0; g < Hk; g++) {
            for (int64_t c0 = 0; c0 < D; c0 += CH) {
                const int64_t cw = D - c0 < CH ? (D - c0) / VW : 4;  /* vectors in this chunk */
                for (int64_t h0 = 0; h0 < qpk; h0 += 2) {
                    const int two = h0 + 1 < qpk;
                    const float *p0 = s + (g * qpk + h0) * len + j0, *p1 = p0 + (two ? len : 0);
                    float *o0 = og + (g * qpk + h0) * D + c0, *o1 = two ? o0 + D : o0;
                    vecf x0 = splatv(0.f), x1 = x0, x2 = x0, x3 = x0, y0 = x0, y1 = x0, y2 = x0, y3 = x0;
                    if (j0) {
                        x0 = LDV(o0); y0 = LDV(o1);
                        if (cw > 1) { x1 = LDV(o0 + VW); y1 = LDV(o1 + VW); }
                        if (cw > 2) { x2 = LDV(o0 + 2 * VW); y2 = LDV(o1 + 2 * VW); }
                        if (cw > 3) { x3 = LDV(o0 + 3 * VW); y3 = LDV(o1 + 3 * VW); }
                    }
                    for (int64_t t = 0; t < n; t++) {
                        if (h0 == 0)  /* a key's lines at a time: the block's 64 at once stalled on the miss queue */
                            prefetch_advance(pf, cw * VW * (int64_t)sizeof(KV_T));
                        const KV_T *vr = vb + t * row + g * D + c0;
                        const vecf w0 = splatv(p0[t]), w1 = splatv(p1[t]), e0 = KV_VEC(vr, 0);
                        x0 += w0 * e0; y0 += w1 * e0;
                        if (cw > 1) { const vecf e1 = KV_VEC(vr, 1); x1 += w0 * e1; y1 += w1 * e1; }
                        if (cw > 2) { const vecf e2 = KV_VEC(vr, 2); x2 += w0 * e2; y2 += w1 * e2; }
                        if (cw > 3) { const vecf e3 = KV_VEC(vr, 3); x3 += w0 * e3; y3 += w1 * e3; }
                    }
                    const vecf xs[4] = {x0, x1, x2, x3}, ys[4] = {y0, y1, y2, y3};
                    for (int64_t i = 0; i < cw; i++) {
                        *(vecf *)(o1 + VW * i) = ys[i];
                        *(vecf *)(o0 + VW * i) = xs[i];
                    }
                }
            }
        }
    }
    for (int64_t h = 0; h < Hk * qpk; h++) {
        float *o = og + h * D;
        if (pairs)
            for (int64_t c = 0; c < D; c += 2 * VW)
                interleave(LDV(o + c) * splatv(inv[h]), LDV(o + c + VW) * splatv(inv[h]), o + c);
        else
            for (int64_t c = 0; c < D; c += VW) *(vecf *)(o + c) = LDV(o + c) * splatv(inv[h]);
    }
#undef KV_VEC
}

#define ROW_TILED(DD, QQ)                                                                                     \
    if (head_dim == DD && qpk == QQ) {                                                                        \
        KV_NAME(decode_row_tiled)(qg, k_cache, v_cache, table, len, og, scratch, num_kv_heads, DD, QQ,         \
                                  block_size, scale, &pf);                                                    \
        continue;                                                                                             \
    }

/* For each query row r (a token; rows of one sequence share its block table) and head h
   (kv head h / qpk):
     out[r, h, :] = softmax_j(scale * q[r, h, :] . K_j[h / qpk, :]) @ V_j[h / qpk, :]
   over the row's first row_lens[r] keys, read in place from the paged cache through block table
   row_seq[r]: key j is slot j % block_size of block block_tables[row_seq[r], j / block_size].
   A decode step has one row per sequence with its whole context; a short causal query (draft
   verification) has one row per token, each seeing the keys up to its own position.
   Layouts (contiguous; q, out fp32, the caches KV_T): q, out [R, H, D]; k_cache, v_cache
   [num_blocks, block_size, Hk, D];
   block_tables int32 [S, table_stride]; row_seq, row_lens int32 [R]; scratch >= H * max(row_lens). */
void KV_NAME(paged_decode_attention)(const float *q, const KV_T *k_cache, const KV_T *v_cache,
                                     const int32_t *block_tables, int64_t table_stride,
                                     const int32_t *row_seq, const int32_t *row_lens, float *out,
                                     int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                     int64_t block_size, float scale, float *scratch) {
    const int64_t qpk = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim;
    /* at most 8 vectors a dot: beyond, the query rows no longer fit the registers (AVX2, head_dim
       128, 4 query heads per KV head: 15% slower than the generic loops) */
    const int tiled = paged_decode_tile_width(num_heads, num_kv_heads, head_dim) != 0;
    for (int64_t r = 0; r < num_rows; r++) {
        const int64_t len = row_lens[r];
        const int32_t *table = block_tables + (int64_t)row_seq[r] * table_stride;
        const float *qg = q + r * num_heads * head_dim;
        float *og = out + r * num_heads * head_dim;
        prefetch_cursor pf = {(const char *)k_cache, (const char *)v_cache, NULL, 0,
                              block_size * row * (int64_t)sizeof(KV_T), 0, 0, 0};
        if (r + 1 < num_rows && row_seq[r + 1] != row_seq[r]) {  /* a new sequence's blocks next */
            pf.table = block_tables + (int64_t)row_seq[r + 1] * table_stride;
            pf.num_blocks = (row_lens[r + 1] + block_size - 1) / block_size;
        }
        if (!tiled) {
            KV_NAME(decode_row_generic)(qg, k_cache, v_cache, table, len, og, scratch, num_heads, num_kv_heads,
                                        head_dim, block_size, scale, &pf);
            continue;
        }
        /* the common shapes as constants, so the compiler unrolls the head_dim and head loops */
        ROW_TILED(64, 1) ROW_TILED(64, 2) ROW_TILED(64, 4) ROW_TILED(64, 8)
        ROW_TILED(128, 1) ROW_TILED(128, 2) ROW_TILED(128, 4) ROW_TILED(128, 8)
        KV_NAME(decode_row_tiled)(qg, k_cache, v_cache, table, len, og, scratch, num_kv_heads, head_dim, qpk,
                                  block_size, scale, &pf);
    }
}

#undef ROW_TILED

/* Write each token's new K and V into the paged cache: token t's row (all kv heads, ``row``
   floats, unit stride) goes to slot slots[t] of both caches ([num_slots, row] elements each), as
   KV_STORE_ROW writes it; slot -1 is skipped (a padded row of a decode graph). Returns the first
   token whose slot is outside [-1, num_slots), nothing written from it on, or -1 when all were in
   range. */
int64_t KV_NAME(paged_store_kv)(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                                const int64_t *slots, int64_t tokens, int64_t row, KV_T *k_cache, KV_T *v_cache,
                                int64_t num_slots) {
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t s = slots[t];
        if (s == -1) continue;
        if (s < -1 || s >= num_slots) return t;
        KV_STORE_ROW(k_cache + s * row, k + t * k_stride, row);
        KV_STORE_ROW(v_cache + s * row, v + t * v_stride, row);
    }
    return -1;
}
