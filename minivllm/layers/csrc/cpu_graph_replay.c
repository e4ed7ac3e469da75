/* A CPU graph's replay in C: the recorded calls' packed twins (packed_call.h), one after another,
   in one ctypes call. Part of minivllm; built at first use by minivllm/layers/cpu_graph.py.

   Why: replayed from Python, each recorded call pays ctypes' conversion of its arguments (about
   a microsecond for ten of them) and a Python loop step; a decode step of the embedded model
   records 43 calls. */
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "packed_call.h"

/* Calls fns[i](args + starts[i]) for i = 0 .. n - 1 (fns: packed_fn addresses). Returns -1, or the
   first i whose call returned non-zero (the calls after it are not made). */
int64_t cpu_graph_replay(const int64_t *fns, const int64_t *starts, const packed_arg *args, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        packed_fn *fn = (packed_fn *)(intptr_t)fns[i];
        if (fn(args + starts[i]))
            return i;
    }
    return -1;
}

/* cpu_graph_replay, with each call's wall time in ns[i] (CLOCK_MONOTONIC, read between the calls: what
   `bench --sweep` reports of where a step's time goes); ns[i] of a call not made (after a bad one) is
   left as it was. */
int64_t cpu_graph_replay_timed(const int64_t *fns, const int64_t *starts, const packed_arg *args, int64_t n,
                               int64_t *ns) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int64_t i = 0; i < n; i++) {
        packed_fn *fn = (packed_fn *)(intptr_t)fns[i];
        const int64_t bad = fn(args + starts[i]);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        ns[i] = (int64_t)(t1.tv_sec - t0.tv_sec) * 1000000000 + (t1.tv_nsec - t0.tv_nsec);
        t0 = t1;
        if (bad)
            return i;
    }
    return -1;
}

/* memmove(dst, src, bytes) as a packed call: a graph's copy into its static output */
int64_t copy_bytes_packed(const packed_arg *a) {
    memmove(ARG_P(0), ARG_P(1), (size_t)ARG_I(2));
    return 0;
}
