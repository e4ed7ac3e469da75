/* Top-p's kept set for rows of logits on the CPU, without sorting the rows: the bucket splits of
   minivllm/layers/cpu_sampling.py (_top_p_ids) in one call. Part of minivllm; built at first use
   by minivllm/layers/top_p_native.py and called through ctypes.

   Given each token's key (the largest logit minus its logit, >= 0) and its fp32 probability, the
   tokens go into 1024 buckets of key over the range lo .. hi (a bucket is a run of the sorted
   order); the buckets' masses, added up from the top in fp64, find the bucket where the mass
   reaches the threshold; the buckets above it are kept, the ones below dropped, and that bucket
   is split again the same way while it holds more than sort_at_most tokens; then it is sorted
   (logit descending, then id) and cut where the mass before a token reaches the threshold. Every
   step is the numpy path's, operation for operation (fp32 differences, products and clip, fp64
   sums in the same order, the range's bounds in fp64), so both keep the same ids. */
#include <float.h>
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

/* numpy's np.clip((key - lo) * scale, 0, BUCKETS - 1).astype(intp) for one fp32 value */
static inline uint16_t bucket_of(float key, float lo, float scale) {
    float x = (key - lo) * scale;
    x = x < 0.f ? 0.f : (x > (float)(BUCKETS - 1) ? (float)(BUCKETS - 1) : x);
    return (uint16_t)(int64_t)x;
}

/* One row. y, key, probs: its fp32 logits, keys and probabilities [v] (no NaN); hi: the range's
   top, min(max key, the span), >= 0; threshold: top_p less the slack. Writes the kept ids (in no
   particular order) to out [v] and returns how many; -1 if memory ran out. Its working memory is
   malloc'd at the sizes a row needs, not handed in: numpy asks for 2 MiB pages for arrays of 4 MiB
   or more, and touching one page of such a buffer zeroes 2 MiB (8 rows of 151,936: ~2 ms a call). */
static int64_t top_p_row(const float *y, const float *key, const float *probs, int64_t v, double hi,
                         double threshold, int64_t sort_at_most, int64_t *out) {
    uint16_t *bucket = (uint16_t *)malloc((size_t)v * sizeof(uint16_t));
    int64_t *lists[2] = {NULL, NULL};
    ranked *sorted = NULL;
    int64_t kept = -1;
    if (!bucket) goto done;
    /* cur[0 .. n): the tokens of the bucket holding the cut; NULL: every token (ids 0 .. v - 1) */
    const int64_t *cur = NULL;
    int64_t n = v, which = 0;
    double lo = 0.0, above = 0.0;  /* above: the mass of the tokens ranked before them */
    kept = 0;
    while ((cur == NULL || n > sort_at_most) && hi > lo) {
        const double wide = BUCKETS / (hi - lo);
        if (wide > FLT_MAX) break;  /* a range too narrow for fp32 to split: sort what is left */
        const float scale = (float)wide, lo32 = (float)lo;
        double mass[BUCKETS] = {0};
        int64_t count[BUCKETS] = {0};
        for (int64_t i = 0; i < n; i++) bucket[i] = bucket_of(key[cur ? cur[i] : i], lo32, scale);
        for (int64_t i = 0; i < n; i++) {
            mass[bucket[i]] += (double)probs[cur ? cur[i] : i];
            count[bucket[i]]++;
        }
        double cum = 0.0, before_mass = 0.0;
        int64_t c = -1;
        for (int64_t b = 0; b < BUCKETS; b++) {  /* numpy: mass_above + cumsum, compared with the threshold */
            cum += mass[b];
            if (above + cum >= threshold) {
                c = b;
                break;
            }
            before_mass = above + cum;
        }
        if (c < 0) {  /* fp32 rounding left the mass below top_p: keep every token left */
            for (int64_t i = 0; i < n; i++) out[kept++] = cur ? cur[i] : i;
            goto done;
        }
        if (count[c] == n) break;  /* no split (equal keys): sort them */
        if (!lists[which] && !(lists[which] = (int64_t *)malloc((size_t)count[c] * sizeof(int64_t)))) {
            kept = -1;
            goto done;
        }
        int64_t *next = lists[which], m = 0;
        for (int64_t i = 0; i < n; i++) {
            const int64_t id = cur ? cur[i] : i;
            if (bucket[i] < c) out[kept++] = id;
            else if (bucket[i] == c) next[m++] = id;
        }
        if (c > 0) above = before_mass;
        cur = next;
        which ^= 1;  /* the next split writes the other list; each split keeps fewer tokens than the one before,
                        so a list reused two splits later is long enough */
        n = m;
        const double step = hi - lo;
        hi = lo + (double)(c + 1) * step / BUCKETS;
        lo = lo + (double)c * step / BUCKETS;
    }
    if (!(sorted = (ranked *)malloc((size_t)(n > 0 ? n : 1) * sizeof(ranked)))) {
        kept = -1;
        goto done;
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = cur ? cur[i] : i;
        sorted[i] = (ranked){-y[id], id};
    }
    qsort(sorted, (size_t)n, sizeof(ranked), by_rank);
    double run = 0.0;
    for (int64_t t = 0; t < n; t++) {  /* keep while the mass before the token is below the threshold */
        const double p = (double)probs[sorted[t].id];
        run += p;
        if ((run - p) + above < threshold || (t == 0 && above == 0.0)) out[kept++] = sorted[t].id;
    }
done:
    free(bucket);
    free(lists[0]);
    free(lists[1]);
    free(sorted);
    return kept;
}

/* For rows r = 0 .. rows - 1 of [rows, v] arrays (C-contiguous), row r with his[r] and
   thresholds[r] (see top_p_row): its kept ids to out + r * v and their number to counts[r].
   Returns 0, or -1 if memory ran out (the counts from that row on are not set). */
int top_p_rows_f32(const float *y, const float *key, const float *probs, int64_t rows, int64_t v,
                   const double *his, const double *thresholds, int64_t sort_at_most, int64_t *out,
                   int64_t *counts) {
    for (int64_t r = 0; r < rows; r++) {
        counts[r] = top_p_row(y + r * v, key + r * v, probs + r * v, v, his[r], thresholds[r], sort_at_most,
                              out + r * v);
        if (counts[r] < 0) return -1;
    }
    return 0;
}
