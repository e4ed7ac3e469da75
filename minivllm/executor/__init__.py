"""Process management for tensor parallelism: the rank-0 model runner (``tp_runner``), the
worker loop every other rank runs (``worker``, also ``python -m minivllm.executor.worker``)
and how the processes are started and connected (``launch``).

The layers never import from here: they only need the per-process rank state and the
collectives in ``minivllm.distributed``.
"""
