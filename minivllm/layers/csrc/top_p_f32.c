/* Top-p's kept set for one row of logits on the CPU, without sorting the row: the bucket split of
   minivllm/layers/cpu_sampling.py (_top_p_ids: its first split and the sort of the cut bucket) in
   one call. Part of minivllm; built at first use by minivllm/layers/top_p_native.py and called
   through ctypes.

   Given each token's key (the largest logit minus its logit, >= 0) and its fp32 probability, the
   tokens go into 1024 buckets of key * scale (a bucket is a run of the sorted order); the buckets'
   masses, added up from the top in fp64, find the bucket where the mass reaches the threshold; the
   buckets above it are kept, and that bucket is sorted (logit descending, then id) and cut where
   the mass before a token reaches the threshold. Every step is the numpy path's, operation for
   operation (fp32 products and clip, fp64 sums in the same order), so both keep the same ids. */
#include <stdint.h>
#include <stdlib.h>

#define BUCKETS 1024

typedef struct {
    float neg;   /* -logit: ascending = most likely first */
    int64_t id;
} ranked;

static int by_rank(const void *a, const void *b) {
    const ranked *x = (const ranked *)a, *y = (const ranked *)b;
    if (x->neg != y->neg) return x->neg < y->neg ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* numpy's np.clip(key * scale, 0, BUCKETS - 1).astype(intp) for one fp32 value */
static inline int64_t bucket_of(float key, float scale) {
    float x = key * scale;
    x = x < 0.f ? 0.f : (x > (float)(BUCKETS - 1) ? (float)(BUCKETS - 1) : x);
    return (int64_t)x;
}

/* y, key, probs: the row's fp32 logits, keys and probabilities [v] (no NaN); scale: fp32 buckets
   per nat of key (finite, > 0); threshold: top_p less the slack. Writes the kept ids (in no
   particular order) to out [v] and returns how many; returns -1, writing nothing of use, when the
   cut bucket holds more than sort_at_most tokens but not all of them (the caller splits it
   further). scratch: room for v ranked entries and v buckets (18 bytes a token). */
int64_t top_p_row_f32(const float *y, const float *key, const float *probs, int64_t v, float scale,
                      double threshold, int64_t sort_at_most, int64_t *out, void *scratch) {
    double mass[BUCKETS] = {0};
    int64_t count[BUCKETS] = {0};
    uint16_t *bucket = (uint16_t *)((ranked *)scratch + v);  /* each token's bucket, found once (a vector loop) */
    for (int64_t j = 0; j < v; j++) bucket[j] = (uint16_t)bucket_of(key[j], scale);
    for (int64_t j = 0; j < v; j++) {
        mass[bucket[j]] += (double)probs[j];
        count[bucket[j]]++;
    }
    double cum = 0.0, above = 0.0;
    int64_t c = -1;
    for (int64_t i = 0; i < BUCKETS; i++) {
        const double before = cum;
        cum += mass[i];
        if (cum >= threshold) {
            c = i;
            above = i > 0 ? before : 0.0;
            break;
        }
    }
    if (c < 0) {  /* fp32 rounding left the mass below top_p: every token */
        for (int64_t j = 0; j < v; j++) out[j] = j;
        return v;
    }
    ranked *inside = (ranked *)scratch;
    int64_t kept = 0, m = 0;
    if (count[c] == v) {  /* no split (equal keys): sort the whole row */
        above = 0.0;
        for (int64_t j = 0; j < v; j++) inside[m++] = (ranked){-y[j], j};
    } else {
        if (count[c] > sort_at_most) return -1;
        for (int64_t j = 0; j < v; j++) {
            if (bucket[j] < c) out[kept++] = j;
            else if (bucket[j] == c) inside[m++] = (ranked){-y[j], j};
        }
    }
    qsort(inside, (size_t)m, sizeof(ranked), by_rank);
    double run = 0.0;
    for (int64_t t = 0; t < m; t++) {  /* keep while the mass before the token is below the threshold */
        const double p = (double)probs[inside[t].id];
        run += p;
        if ((run - p) + above < threshold || (t == 0 && above == 0.0)) out[kept++] = inside[t].id;
    }
    return kept;
}

/* top_p_row_f32 for rows r = 0 .. rows - 1 of [rows, v] arrays: row r with scales[r] and
   thresholds[r], its kept ids to out + r * v and their number to counts[r] (-1: as
   top_p_row_f32's -1, or scales[r] <= 0, a row left to the caller). scratch: as top_p_row_f32's. */
void top_p_rows_f32(const float *y, const float *key, const float *probs, int64_t rows, int64_t v,
                    const float *scales, const double *thresholds, int64_t sort_at_most, int64_t *out,
                    int64_t *counts, void *scratch) {
    for (int64_t r = 0; r < rows; r++)
        counts[r] = scales[r] > 0.f ? top_p_row_f32(y + r * v, key + r * v, probs + r * v, v, scales[r], thresholds[r],
                                                    sort_at_most, out + r * v, scratch)
                                    : -1;
}
