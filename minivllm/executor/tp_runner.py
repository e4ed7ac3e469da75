"""Rank 0 of a tensor-parallel engine: the model runner the engine talks to when
``tensor_parallel_size > 1``.

``TPModelRunner`` is a ``ModelRunner`` (same ``run(plan) -> RunnerOutput``,
``num_kv_blocks``, ``backend``, ``shutdown()``) whose model is one shard of ``tp``. One
step, as the engine sees it, is unchanged::

    run(plan): prepare_input(plan)          # rank 0 only: the scheduler lives here
               forward_logits(inp):
                   broadcast the inputs     # -> every worker rebuilds the same ModelInput
                   model forward            # all ranks, all-reduces inside the layers
                   compute_logits           # all-gather over the vocabulary shards
               sampler(logits)              # rank 0 only

Where the other ranks come from (``launch.py``): on one machine they are started here, as
fresh ``python -m minivllm.executor.worker`` processes; across machines (or under
``torchrun``) every rank is started outside and the engine joins the process group.

Failure handling: a worker that dies closes its sockets and the next collective raises at
once (gloo); rank 0 then reports which worker failed and how (its traceback when it
raised), stops the others and refuses further steps. Workers exit by themselves when rank
0 goes away, however it goes (see ``worker._watch_parent``). An interrupt (Ctrl-C, a Jupyter
kernel interrupt) is different: it is held while rank 0 takes part in the step's collectives
and raised as soon as they are done, so the ranks stay in step and the engine rolls the step
back as it does any interrupted step (``interrupts_held``).
"""
from __future__ import annotations

import logging
import signal
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist

from minivllm.distributed.parallel_state import tp_scope
from minivllm.executor import launch
from minivllm.executor.launch import Connection
from minivllm.executor.worker import COMPILE, CPU_FUSED, HEADER_LEN, SHUTDOWN, ShardRunner, WorkerConfig, pack_step, serve
from minivllm.engine.model_runner import ModelInput
from minivllm.engine.runner_config import RunnerConfig

logger = logging.getLogger("minivllm")


def check_tp_config(hf_config, tp_size: int) -> None:
    """Refuse a model that cannot be split ``tp_size`` ways.

    Raises:
        ValueError: attention heads, KV heads or the MLP width not divisible by ``tp_size``
            (names the field and its value).
    """
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(hf_config, name)
        if value % tp_size != 0:
            raise ValueError(f"tensor_parallel_size={tp_size} does not divide the model's {name}={value}: "
                             f"each rank must hold a whole number of them")


class _Closer:
    """Stops the workers of one engine; idempotent. Holds no reference to the runner, so it
    can run from ``weakref.finalize`` (garbage collection, interpreter exit)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.closed = False

    def close(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        conn = self.conn
        if graceful and all(p.poll() is None for p in conn.procs):
            try:
                header = torch.zeros(HEADER_LEN, dtype=torch.int64)
                header[0] = SHUTDOWN
                launch.broadcast(conn.ctrl, header, timeout=launch.model_timeout())
            except Exception:  # a worker already gone: nothing to tell it
                graceful = False
        launch.kill_workers(conn.procs, grace_s=5.0 if graceful else 0.0)
        conn.model = conn.ctrl = conn.store = None
        if conn.owns_default_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # at interpreter exit torch may already be tearing down
                pass


class TPModelRunner(ShardRunner):
    """The engine's model runner for ``tensor_parallel_size > 1`` (rank 0).

    Args:
        config: as ``ModelRunner``, with ``tp_size`` the number of ranks (>= 2). Sent to every
            rank; on CUDA each rank uses its own GPU.
        init_method: ``torch.distributed`` init method for an externally launched job
            (e.g. ``"tcp://10.0.0.1:29500"``). None: join ``torchrun``'s job when its
            environment says so (``WORLD_SIZE`` > 1, ``init_method="env://"``), else start
            the workers locally.

    On a rank > 0 of an external launch the constructor does not return: it serves as
    that rank's worker until rank 0 shuts down, then raises ``SystemExit(0)``.

    Raises:
        ValueError: the model does not split ``tp_size`` ways, or (CUDA) fewer GPUs than ranks.
        RuntimeError: a worker failed to start or to load its shard (with its error).
    """

    def __init__(self, config: RunnerConfig, init_method: str | None = None):
        tp_size, device = config.tp_size, config.device
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 2:
            raise ValueError(f"tensor_parallel_size={tp_size!r}: TPModelRunner needs at least 2 ranks")
        check_tp_config(config.source.hf_config, tp_size)
        external = launch.external_launch(init_method, tp_size)
        base_index = 0
        if device.type == "cuda" and not external:
            base_index = device.index if device.index is not None else torch.cuda.current_device()
            available = torch.cuda.device_count()
            if base_index + tp_size > available:
                raise ValueError(f"tensor_parallel_size={tp_size} on {device}: needs one GPU per rank, "
                                 f"cuda:{base_index}..cuda:{base_index + tp_size - 1}, but this machine has "
                                 f"{available} GPU(s)")
        conn = launch.connect_external(init_method, tp_size) if external else launch.start_local(tp_size)
        if conn.rank != 0:
            # a script written for vLLM's external launcher expects every rank to get the outputs
            logger.warning("rank %d of %d: this LLM(...) call serves as the rank's worker and does not return "
                           "(only rank 0 runs the script on; a collective of the script's own after it, such "
                           "as dist.barrier(), would leave rank 0 waiting)", conn.rank, tp_size)
            serve(conn)
            if conn.owns_default_group:
                dist.destroy_process_group()
            raise SystemExit(0)
        if device.type == "cuda":
            config = replace(config, device=torch.device("cuda", conn.local_rank if external else base_index))
            torch.cuda.set_device(config.device)  # NCCL and Triton use the current device, not the tensors'
        self.conn = conn  # ShardRunner sets it too; the guard below needs it first
        self._closer = _Closer(conn)
        self._finalizer = weakref.finalize(self, self._closer.close)
        self._failure: str | None = None
        try:
            self._send_timeout = launch.model_timeout()  # a step's messages to the workers, as its collectives
            cfg = WorkerConfig(config, base_index, "nccl" if device.type == "cuda" else "gloo",
                               max(1, torch.get_num_threads() // tp_size), conn.tag)
            launch.broadcast_object(conn.ctrl, cfg, 0)
            with self._guard("while starting"):  # a worker dead here left a bare store timeout, naming no rank
                conn.model = launch.create_model_group(conn, cfg.dist_backend, config.device)
            with self._guard("while starting"), tp_scope(0, tp_size, conn.model):
                super().__init__(conn, config)
        except BaseException:
            self._closer.close(graceful=False)
            raise
        logger.info("tensor parallel: %d ranks (%s, %s launch), KV cache %d blocks per rank", tp_size,
                    cfg.dist_backend, "external" if external else "local", self.num_kv_blocks)

    # -- introspection ---------------------------------------------------------------------------
    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the locally started workers (ranks 1..tp-1); empty for external launches."""
        return [p.pid for p in self.conn.procs]

    # -- optimisations ------------------------------------------------------------------------------
    def enable_compile(self) -> None:
        """``torch.compile`` the small fused ops on every rank (replicated ops such as the norms
        must compute the same values everywhere)."""
        self._check_usable()
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[0] = COMPILE
        with self._guard("enabling torch.compile"):
            launch.broadcast(self.conn.ctrl, header, timeout=self._send_timeout)
        super().enable_compile()

    def enable_cpu_fused_ops(self) -> bool:
        """Our C norms, rotary and SiLU on every rank, or on none: replicated ops must compute
        the same values everywhere, so rank 0 tells the workers only once its own ops loaded
        (each worker then builds or loads the same source; one that cannot keeps torch's ops,
        which agree to float32 rounding)."""
        self._check_usable()
        if not super().enable_cpu_fused_ops():
            return False
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[0] = CPU_FUSED
        with self._guard("enabling the CPU fused ops"):
            launch.broadcast(self.conn.ctrl, header, timeout=self._send_timeout)
        return True

    def enable_cuda_graphs(self, *args, **kwargs) -> None:
        raise NotImplementedError("CUDA graphs are not supported with tensor_parallel_size > 1")

    # -- one step ----------------------------------------------------------------------------------
    def forward_logits(self, inp: ModelInput) -> torch.Tensor:
        """Send the step to the workers, then run rank 0's shard; fp32 logits ``[num_sampling, vocab_size]``.

        Raises:
            KeyboardInterrupt: an interrupt that came during the collectives, once they are done
                (the ranks in step: the engine rolls the step back and can go on).
            RuntimeError: a worker failed, or this engine did before (it then refuses every step)."""
        self._check_usable()
        header, payload = pack_step(inp)
        with interrupts_held(), self._guard("during a step"):
            launch.broadcast(self.conn.ctrl, header, timeout=self._send_timeout)
            launch.broadcast(self.conn.ctrl, payload, timeout=self._send_timeout)
            with tp_scope(0, self.conn.world_size, self.conn.model):
                return super().forward_logits(inp)

    def _sync(self) -> None:
        """Wait for the device; on CUDA poll, so that a dead worker (whose NCCL peer would
        otherwise block the stream until the collective times out) is noticed."""
        if self.device.type != "cuda":
            return
        with interrupts_held(), self._guard("during a step"):
            done = torch.cuda.Event()
            done.record()
            last_check = time.monotonic()
            while not done.query():
                time.sleep(5e-5)
                if time.monotonic() - last_check > 0.05:
                    last_check = time.monotonic()
                    if self._dead_worker() is not None:
                        abort = getattr(self.conn.model, "abort", None)
                        if abort is not None:
                            abort()
                        raise RuntimeError("a tensor-parallel worker exited during the step")

    def _dead_worker(self) -> str | None:
        if self._closer.closed:
            return "the workers have been stopped"
        if any(p.poll() is not None for p in self.conn.procs):
            return launch.worker_failure(self.conn.store, self.conn.procs)
        return None

    def _check_usable(self) -> None:
        if self._failure is None:
            dead = self._dead_worker()
            if dead is not None:
                self._fail(f"tensor-parallel worker failed: {dead}")
        if self._failure is not None:
            raise RuntimeError(f"{self._failure}\n(this engine cannot run further steps; create a new LLM)")

    def _fail(self, message: str) -> None:
        self._failure = message
        self._closer.close(graceful=False)

    @contextmanager
    def _guard(self, when: str):
        """Any exception inside a collective leaves the ranks out of step: stop the workers,
        refuse further steps, and say which worker failed if one did."""
        try:
            yield
        except BaseException as e:
            if self._failure is not None:
                raise
            described = None
            try:
                if not self.conn.external and isinstance(e, RuntimeError):
                    deadline = time.monotonic() + 3.0  # let a dying worker finish its report and exit
                    while described is None and time.monotonic() < deadline:
                        described = launch.worker_failure(self.conn.store, self.conn.procs)
                        if described is None:
                            time.sleep(0.02)
            finally:  # also when an interrupt cuts the wait short: the workers are mid-step, out of step
                self._fail(f"tensor-parallel worker failed {when}: {described}" if described
                           else f"tensor-parallel engine failed {when}: {type(e).__name__}: {e}".rstrip(": "))
            if described or (self.conn.external and isinstance(e, RuntimeError)):
                raise RuntimeError(self._failure) from e
            raise

    # -- shutdown -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the workers (SHUTDOWN message, then wait, then terminate) and free this shard."""
        self._finalizer()
        super().shutdown()


@contextmanager
def interrupts_held():
    """Hold SIGINT (Ctrl-C, a Jupyter kernel interrupt) for the duration, then deliver it as the
    handler that was in place would have: a ``KeyboardInterrupt`` raised when the block ends.

    A ``KeyboardInterrupt`` inside a collective would leave rank 0 out of step with the workers
    (they finish the collective, rank 0 does not), and the engine could run no further step; held
    until rank 0's part of the step is done, it lands where the engine rolls the step back. Only
    the main thread receives signals, so elsewhere (an engine stepped from another thread) this
    changes nothing. A second interrupt while one is held changes nothing either: the first is
    raised when the block ends; an exception the block itself raises goes on instead."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    # here only when the block ended normally: an exception already on its way stops the caller anyway
    if held and previous not in (signal.SIG_IGN, None):
        if callable(previous):
            previous(signal.SIGINT, held[0])  # Python's default handler raises KeyboardInterrupt
        else:  # SIG_DFL: what the default action would have done to this process
            signal.raise_signal(signal.SIGINT)
