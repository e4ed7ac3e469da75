"""``python -m minivllm bench``: offline throughput against transformers, sweeps, overhead.

Five modes (throughput, ``--sweep``, ``--speculative``, ``--overhead``, ``--quantization``), each a
plain function that returns a result dataclass (``to_dict()`` for
JSON; the notebooks call them directly), and ``main(argv)`` (``cli``) that runs and prints
them. Modules: ``workload`` (prompts and lengths), ``peers`` (transformers, nano-vllm),
``throughput``, ``sweep``, ``overhead`` (the modes), ``report`` (printing and plots),
``cli`` (arguments, threads), ``common`` (engine set-up and summaries shared by the modes), and
``collectives`` (an all-reduce's time against its bytes over local processes; chapter 10 calls it,
not the CLI).

* throughput (default): an offline workload of random-token prompts, greedy,
  ``ignore_eos``, each request with its own output length. minivllm runs it,
  then in the same process Hugging Face transformers runs the same prompts on the
  same weights: ``generate`` on padded batches (each batch runs to its longest
  output; only the requested tokens count towards its throughput) and, where it
  works, transformers' continuous-batching ``generate_batch`` machinery. Prints
  throughput, TTFT/TPOT percentiles, the ratios, roofline MFU/MBU and whether
  the greedy outputs are identical.
* ``--sweep``: decode step time vs batch size and prefill step time vs prompt
  length, each point placed on a roofline (FLOPs and bytes from
  ``minivllm.telemetry.roofline`` against measured peaks); ``--html PATH`` also writes the
  roofline as a plotly HTML (no file is written without it).
* ``--speculative ngram draft``: greedy decode TPOT with and without speculative decoding (prompt
  lookup, and/or the draft model ``--draft-model``, default the embedded ``minivllm-tiny-draft``)
  on prompts whose continuation repeats their context, per batch size, each method against the
  same unmodified engine, with token agreement and the batch size from which speculation stops
  paying (``speculative``).
* ``--overhead``: the engine's own CPU cost (scheduler, block manager, input
  preparation, the sampler's per-row settings, postprocessing) with the model and the
  sampling replaced by a stub that returns a fixed token, in microseconds per sequence per decode step, beside nano-vllm's
  figure from its peer script (``../shared/peers/nanovllm_overhead.py``), loaded into the
  same process: ``--rounds`` rounds (default 5) of each, alternating, and the median of the
  rounds' ratios.
* ``--quantization int8``: batch-1 decode of the float engine and the int8 engine side by side,
  rounds alternating: median ITL of each and their ratio, bytes per step, and greedy agreement
  (``quant``).

Workloads: ``nano`` is nano-vllm's benchmark (256 requests, prompt and output
lengths uniform in 100..1024, random token ids); ``cpu`` is a CPU-sized one
(32 requests, prompts 16..256, outputs 16..128). The default is ``nano`` on a GPU,
``cpu`` otherwise; ``--scale`` multiplies the number of requests.
"""
from minivllm.bench.cli import build_parser, main, run_cli
from minivllm.bench.overhead import OverheadResult, run_overhead
from minivllm.bench.peers import (NanoVllmOverhead, PeerOverhead, PeerUnavailable, load_hf_model,
                                  run_hf_continuous_batching, run_hf_generate)
from minivllm.bench.report import roofline_figure, write_roofline_html
from minivllm.bench.sweep import SweepResult, run_sweep
from minivllm.bench.throughput import ThroughputResult, run_throughput
from minivllm.bench.workload import WORKLOADS, Workload, make_workload

__all__ = ["WORKLOADS", "Workload", "make_workload", "run_throughput", "ThroughputResult", "run_sweep",
           "SweepResult", "run_overhead", "OverheadResult", "NanoVllmOverhead", "PeerOverhead", "PeerUnavailable",
           "load_hf_model", "run_hf_generate", "run_hf_continuous_batching", "roofline_figure",
           "write_roofline_html", "build_parser", "run_cli", "main"]
