/* The packed form of our C calls, for a CPU graph's replay in C (minivllm/layers/cpu_graph.py,
   csrc/cpu_graph_replay.c). Part of minivllm.

   A graph records each call with its arguments; replaying them from Python pays ctypes'
   argument conversion on every call (about a microsecond each, dozens of calls a step). So each
   function a decode graph records also has a twin, NAME_packed, taking the same arguments in the
   same order from one array of 8-byte slots (integers and pointers as int64, floats as double),
   and returning 0, or non-zero when the call found bad input (the caller then makes the call
   again through ctypes, whose wrapper raises the error that names it). */
#ifndef MINIVLLM_PACKED_CALL_H
#define MINIVLLM_PACKED_CALL_H
#include <stdint.h>

typedef union { int64_t i; double f; } packed_arg;
typedef int64_t packed_fn(const packed_arg *a);

#define PACKED(name) int64_t name##_packed(const packed_arg *a)
#define ARG_I(k) (a[k].i)
#define ARG_P(k) ((void *)(intptr_t)a[k].i)
#define ARG_F(k) ((float)a[k].f)

#endif
