"""A tensor-parallel worker: holds one shard of the model and runs the steps rank 0 sends.

Ranks ``1..tp-1`` run this loop; rank 0 (the engine's process, see ``tp_runner.py``)
schedules, prepares each step's inputs and broadcasts them here. Every rank then runs
the model on its shard (the layers' all-reduces keep them in lock-step) and only rank 0
samples.

Entry points:

* ``python -m minivllm.executor.worker --store HOST:PORT --rank R --world-size W
  --parent-pid PID``: how the engine starts its local workers (``launch.start_local``).
* ``python -m minivllm.executor.worker`` under ``torchrun`` (``init_method="env://"``),
  or ``python -m minivllm.executor.worker --init-method tcp://HOST:PORT --rank R
  --world-size W``: a rank of a multi-machine job. It needs no model arguments: rank 0
  sends its configuration. (Under torchrun a rank > 0 may instead run the same script as
  rank 0: its ``LLM(...)`` call serves as this worker loop and then exits the process.)

Protocol (control group, gloo, CPU int64 tensors), one step:
``header = [cmd, num_tokens, num_seqs, num_sampling, table_width, payload_len]`` then, for
``cmd == STEP``, a payload of ``input_ids | positions | slot_mapping | q_lens |
context_lens | block_tables (row-major) | logits_indices``. ``COMPILE`` makes the worker
``torch.compile`` the same ops as rank 0 (``ModelRunner.enable_compile``), ``CPU_FUSED`` use the
same C norms, rotary and SiLU (``ModelRunner.enable_cpu_fused_ops``); ``SHUTDOWN`` ends it.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace

import numpy as np
import torch

from minivllm.executor import launch
from minivllm.executor.launch import Connection
from minivllm.engine.model_runner import ModelInput, ModelRunner
from minivllm.engine.runner_config import RunnerConfig

logger = logging.getLogger("minivllm")

STEP, SHUTDOWN, COMPILE, CPU_FUSED = 1, 2, 3, 4
HEADER_LEN = 6
#: Test hook: ``"<rank>:<step>"`` makes that worker raise at that step (exercises error reporting).
FAULT_ENV = "MINIVLLM_TP_TEST_FAULT"


@dataclass
class WorkerConfig:
    """What rank 0 sends every worker before the model is built: rank 0's ``RunnerConfig``
    (each rank replaces its device) and how to reach the other ranks."""

    runner: RunnerConfig
    device_base_index: int      # local launch on CUDA: rank r uses cuda:(base + r)
    dist_backend: str           # "gloo" or "nccl"
    num_threads: int            # torch intra-op threads per worker on CPU
    tag: str


def rank_device(cfg: WorkerConfig, conn: Connection) -> torch.device:
    """This rank's device: CPU, or one GPU per rank (``LOCAL_RANK`` under torchrun)."""
    if cfg.runner.device.type == "cpu":
        return torch.device("cpu")
    index = conn.local_rank if conn.external else cfg.device_base_index + conn.rank
    return torch.device("cuda", index)


# -- the step message ----------------------------------------------------------------------------
def pack_step(inp: ModelInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0: a step's ``ModelInput`` -> (header int64 ``[6]``, payload int64 ``[payload_len]``), on CPU.

    Everything a worker needs to rebuild the same ``ModelInput`` (the sampling sequences
    stay on rank 0; workers only need how many there are).
    """
    meta = inp.meta
    n_seqs, width = meta.block_tables.shape
    lens = torch.tensor(meta.q_lens_cpu + meta.context_lens_cpu, dtype=torch.int64)
    if inp.host is not None:  # the host arrays the runner uploaded: no device read-back
        ids, pos, slots, rows, tables = inp.host
        payload = torch.from_numpy(np.concatenate([ids, pos, slots, lens.numpy(), tables.reshape(-1), rows]))
    else:
        parts = [inp.input_ids, inp.positions, meta.slot_mapping, lens, meta.block_tables.reshape(-1),
                 inp.logits_indices]
        payload = torch.cat([p.to("cpu", torch.int64) for p in parts])
    header = torch.tensor([STEP, inp.input_ids.numel(), n_seqs, inp.logits_indices.numel(), width,
                           payload.numel()], dtype=torch.int64)
    return header, payload


def unpack_step(runner: ModelRunner, header: torch.Tensor, payload: torch.Tensor) -> ModelInput:
    """Worker: rebuild rank 0's ``ModelInput`` (same tensors, same ``AttentionMetadata``,
    made by the runner's own ``_metadata``)."""
    _, n_tok, n_seqs, n_sample, width, _ = header.tolist()
    ids, pos, slots, q_lens, ctx_lens, tables, rows = payload.split(
        [n_tok, n_tok, n_tok, n_seqs, n_seqs, n_seqs * width, n_sample])
    dev = runner.device
    prefaulter = getattr(runner, "kv_prefaulter", None)
    if prefaulter is not None and n_tok:  # a worker has no block manager: the step's highest slot says how far
        prefaulter.note(int(slots.max()) // runner.block_size)
    meta = runner._metadata(q_lens.tolist(), ctx_lens.tolist(), slots.to(dev),
                            tables.view(n_seqs, width).tolist())
    return ModelInput(input_ids=ids.to(dev), positions=pos.to(dev), meta=meta, logits_indices=rows.to(dev),
                      sampling_seqs=[None] * n_sample)


# -- a shard runner (used by workers, and as the base of rank 0's TPModelRunner) -----------------
class ShardRunner(ModelRunner):
    """A ``ModelRunner`` holding one tensor-parallel shard.

    The only change to set-up: the KV pool size must be the same on every rank (the
    block manager on rank 0 hands out block ids for all of them), so after all ranks have
    loaded their weights each proposes a size and all take the smallest. With an explicit
    ``num_kvcache_blocks`` or a byte budget the proposals are equal anyway; with
    ``gpu_memory_utilization`` the GPU with least room decides.
    """

    def __init__(self, conn: Connection, config: RunnerConfig):
        self.conn = conn
        super().__init__(replace(config, tp_size=conn.world_size))

    def _size_kv_cache(self) -> int:
        launch.all_reduce_min(self.conn.ctrl, 0)  # barrier: every rank has its weights
        try:
            mine = super()._size_kv_cache()
            error = None
        except ValueError as e:
            mine, error = 0, e
        agreed = launch.all_reduce_min(self.conn.ctrl, mine)
        if error is not None:
            raise error
        if agreed < 1:
            raise ValueError("KV cache budget too small for one block on some tensor-parallel rank")
        if agreed < mine:
            logger.info("rank %d: KV cache %d blocks (another rank has room for fewer than %d)",
                        self.conn.rank, agreed, mine)
        return agreed


class Worker:
    """Rank > 0: build the shard from rank 0's configuration, then serve steps until told to stop."""

    def __init__(self, conn: Connection):
        from minivllm.distributed import set_tp

        self.conn = conn
        cfg: WorkerConfig = launch.broadcast_object(conn.ctrl, None, conn.rank)
        conn.tag = cfg.tag
        self.device = rank_device(cfg, conn)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(cfg.num_threads)
        conn.model = launch.create_model_group(conn, cfg.dist_backend, self.device)
        set_tp(conn.rank, conn.world_size, conn.model)
        self.runner = ShardRunner(conn, replace(cfg.runner, device=self.device))
        if self.runner.kv_prefaulter is not None:  # this rank's pool: its first pages now, in the background
            self.runner.kv_prefaulter.note(-1)
        fault = os.environ.get(FAULT_ENV, "")
        rank, _, step = fault.partition(":")
        self.fault_step = int(step) if fault and int(rank) == conn.rank else None

    def serve(self) -> None:
        """Run steps until rank 0 sends SHUTDOWN (or dies: then the broadcast raises)."""
        ctrl = self.conn.ctrl
        step = 0
        while True:
            header = launch.broadcast(ctrl, torch.zeros(HEADER_LEN, dtype=torch.int64))
            cmd = int(header[0])
            if cmd == SHUTDOWN:
                return
            if cmd == COMPILE:
                self.runner.enable_compile()
                continue
            if cmd == CPU_FUSED:
                self.runner.enable_cpu_fused_ops()
                continue
            if cmd != STEP:
                raise RuntimeError(f"worker rank {self.conn.rank}: unknown command {cmd}")
            payload = launch.broadcast(ctrl, torch.empty(int(header[5]), dtype=torch.int64))
            if step == self.fault_step:
                raise RuntimeError(f"injected fault ({FAULT_ENV}) at step {step}")
            self.runner.forward_logits(unpack_step(self.runner, header, payload))
            self.runner._sync()
            step += 1


def serve(conn: Connection) -> None:
    """Build a worker on ``conn`` and serve until shutdown. On an exception the error is left
    for rank 0 (local launches) and re-raised."""
    try:
        Worker(conn).serve()
    except BaseException:
        launch.report_error(conn, f"rank {conn.rank} (pid {os.getpid()}):\n{traceback.format_exc()}")
        raise


def _watch_parent(parent_pid: int, interval_s: float = 0.2) -> None:
    """Exit this process as soon as its parent (the engine) is gone, even if it was SIGKILLed
    (a Jupyter kernel restart): then we are re-parented and ``os.getppid()`` changes."""
    def loop():
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(interval_s)

    threading.Thread(target=loop, name="minivllm-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minivllm.executor.worker",
                                     description="A minivllm tensor-parallel worker (rank > 0).")
    parser.add_argument("--store", help="HOST:PORT of rank 0's store (local launch by the engine)")
    parser.add_argument("--init-method", help="torch.distributed init_method, e.g. tcp://HOST:PORT "
                                              "(default under torchrun: env://)")
    parser.add_argument("--rank", type=int, help="this rank (default: $RANK)")
    parser.add_argument("--world-size", type=int, help="tensor_parallel_size (default: $WORLD_SIZE)")
    parser.add_argument("--parent-pid", type=int, help="exit when this process is no longer our parent")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s minivllm-worker %(message)s")
    if args.parent_pid is not None:
        _watch_parent(args.parent_pid)
    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", -1))
    world = args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", 0))
    if rank < 1 or world < 2 or rank >= world:
        parser.error(f"need 1 <= rank < world_size, got rank={rank} world_size={world}")
    if args.store:
        # rank 0 controls us; a Ctrl-C aimed at the notebook/terminal must not kill a shard
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        conn = launch.connect_to_parent(args.store, rank, world)
    else:
        conn = launch.connect_external(args.init_method, world, rank)
    try:
        serve(conn)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: destroying process groups whose peers are gone can block.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
