"""Starting the tensor-parallel processes and connecting them to each other.

Two ways to get ``tp`` processes that talk:

* **Local** (one machine, the default): the engine's process is rank 0. It opens a
  ``TCPStore`` on ``127.0.0.1`` at a port the OS picks (so two engines on one host never
  collide), then starts ranks ``1..tp-1`` as fresh interpreters running
  ``python -m minivllm.executor.worker --store 127.0.0.1:<port> --rank r ...`` (the
  ``spawn`` start method's semantics: nothing is inherited but the environment; unlike
  ``multiprocessing``'s spawn it does not re-import the caller's ``__main__``, so a script
  without an ``if __name__ == "__main__":`` guard and a Jupyter kernel both work). Process
  groups are built directly on that store and registered nowhere, so several engines
  can live in one process.
* **External** (several machines, or ``torchrun`` on one): every rank is started by someone
  else and they meet through ``torch.distributed.init_process_group(init_method=...)``
  (``"env://"`` under ``torchrun``: ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
  ``WORLD_SIZE``). The rank-0 process runs the engine; the others run the worker loop.

Either way each rank ends up with two process groups:

* ``ctrl``: gloo, CPU tensors, with an effectively unlimited timeout. Rank 0 broadcasts
  each step's inputs on it; workers sit in that broadcast while the engine is idle, for
  as long as it is idle. A rank that dies closes its sockets, and gloo raises "Connection
  closed by peer" in the others at once, so no timeout is needed to notice it.
* ``model``: NCCL on CUDA, gloo on CPU, with a finite timeout (``MINIVLLM_TP_TIMEOUT``
  seconds, default 300); the layers' all-reduces and all-gathers run on it.
"""
from __future__ import annotations

import datetime
import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

#: The control group waits for rank 0's next step however long the engine idles.
CTRL_TIMEOUT = datetime.timedelta(days=365)
#: How long local workers may take to start (import torch, connect) before rank 0 gives up.
STARTUP_TIMEOUT_S = 180.0
ERROR_KEY = "minivllm/error/{rank}"
READY_KEY = "minivllm/ready/{rank}"


def model_timeout() -> datetime.timedelta:
    """Timeout of one model-group collective: ``$MINIVLLM_TP_TIMEOUT`` seconds, default 300."""
    raw = os.environ.get("MINIVLLM_TP_TIMEOUT", "300")
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"MINIVLLM_TP_TIMEOUT={raw!r}: expected a number of seconds") from None
    # gloo takes whole milliseconds in a C int64: inf, nan and 1e300 failed inside it, after the workers started
    if not 0.001 <= seconds <= CTRL_TIMEOUT.total_seconds():  # below a millisecond gloo would read 0
        raise ValueError(f"MINIVLLM_TP_TIMEOUT={raw!r}: must be a positive number of seconds, from 0.001 to "
                         f"{CTRL_TIMEOUT.total_seconds():.0f} (a year)")
    return datetime.timedelta(seconds=seconds)


def _env_int(name: str, default: int | None = None) -> int | None:
    """``$name`` as an int (``default`` when unset).

    Raises:
        ValueError: naming the variable and its value."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a whole number (torchrun's variable)") from None


#: the rendezvous schemes torch.distributed knows
INIT_SCHEMES = ("env://", "tcp://", "file://")


def check_init_method(init_method) -> None:
    """``init_method`` is None or a rendezvous URL torch.distributed knows.

    Raises:
        ValueError: naming the value ("bogus" failed later with "No rendezvous handler for ://")."""
    if init_method is not None and (not isinstance(init_method, str) or not init_method.startswith(INIT_SCHEMES)):
        raise ValueError(f"init_method={init_method!r}: expected a URL starting with one of {list(INIT_SCHEMES)} "
                         f"(e.g. 'tcp://10.1.1.20:23456'), or None for a local launch")


@dataclass
class Connection:
    """One rank's view of the tensor-parallel job.

    Attributes:
        rank, world_size: this rank and the number of ranks (= tensor_parallel_size).
        local_rank: index among the ranks on this machine (picks the GPU).
        ctrl: gloo group for step broadcasts (CPU tensors).
        model: the group the layers' collectives use (set by :func:`create_model_group`).
        store: the local launch's ``TCPStore`` (workers leave error reports there); None
            for external launches.
        external: True when the ranks were started by torchrun / the user.
        tag: a name unique to this engine (used for NCCL group names).
        owns_default_group: this engine created the default process group (external
            launch), so it destroys it at shutdown.
        procs: the locally started worker processes (rank 0 of a local launch).
    """

    rank: int
    world_size: int
    local_rank: int
    ctrl: object
    store: object | None
    external: bool
    tag: str
    model: object | None = None
    owns_default_group: bool = False
    procs: list = field(default_factory=list)


# -- which launch -------------------------------------------------------------------------------
def external_launch(init_method: str | None, tp_size: int) -> bool:
    """True when the ranks are started by someone else: an explicit ``init_method``, or
    ``torchrun``'s environment (``WORLD_SIZE`` > 1).

    Raises:
        ValueError: ``WORLD_SIZE`` disagrees with ``tensor_parallel_size`` or is not a number, or a
            bad ``$MINIVLLM_TP_TIMEOUT`` (checked here, before any worker starts; ``init_method`` was
            checked by ``EngineArgs``).
    """
    model_timeout()  # a bad $MINIVLLM_TP_TIMEOUT named before any worker starts (EngineArgs checked init_method)
    world = _env_int("WORLD_SIZE")
    if world is not None and world > 1:
        if world != tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} but WORLD_SIZE={world}: launch exactly "
                             f"tensor_parallel_size ranks (minivllm has no other kind of parallelism)")
        return True
    return init_method is not None


def connect_external(init_method: str | None, tp_size: int, rank: int | None = None) -> Connection:
    """Join (or create) the default process group and make the control group.

    ``rank`` defaults to ``$RANK``, else 0 (the engine's process is rank 0 unless torchrun
    says otherwise). A default group that already exists is reused.
    """
    check_init_method(init_method)
    rank = _env_int("RANK", 0) if rank is None else rank
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo", init_method=init_method or "env://", rank=rank, world_size=tp_size,
                                timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    if dist.get_world_size() != tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} but the process group has "
                         f"{dist.get_world_size()} ranks")
    rank = dist.get_rank()
    ctrl = dist.new_group(backend="gloo", timeout=CTRL_TIMEOUT)
    local_rank = _env_int("LOCAL_RANK", rank)
    return Connection(rank, tp_size, local_rank, ctrl, None, True, tag="minivllm-external",
                      owns_default_group=owns)


# -- local launch (rank 0 side) -----------------------------------------------------------------
def _worker_env() -> dict:
    """The caller's environment, with this copy of minivllm importable first."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in sys.path if p] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # torchrun variables in our environment would make the worker think it is external
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def start_local(tp_size: int) -> Connection:
    """Rank 0 of a local launch: open a store on a free port, start the workers, wait until
    every one has connected, build the control group.

    Raises:
        RuntimeError: a worker exited or reported an error while starting (its message is
            included), or did not connect within ``STARTUP_TIMEOUT_S``.
    """
    store = dist.TCPStore("127.0.0.1", 0, tp_size, True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    port = store.port
    procs = []
    env = _worker_env()
    try:
        for r in range(1, tp_size):
            cmd = [sys.executable, "-m", "minivllm.executor.worker", "--store", f"127.0.0.1:{port}",
                   "--rank", str(r), "--world-size", str(tp_size), "--parent-pid", str(os.getpid())]
            # A session of its own: a Jupyter kernel asked to shut down signals the children in its process group
            # and waits until none is left, but the workers it kills stay zombies until this process reaps them
            # after that wait (~29 s: ipykernel's SIGTERM, then SIGKILL, rounds). Outside the group they are
            # stopped by this engine's shutdown at exit, and exit by themselves when this process dies (--parent-pid).
            procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True))
        wait_ready(store, procs, READY_KEY, STARTUP_TIMEOUT_S, "tensor-parallel worker")
        ctrl = dist.ProcessGroupGloo(dist.PrefixStore("ctrl", store), 0, tp_size, CTRL_TIMEOUT)
    except BaseException:
        kill_workers(procs)
        raise
    return Connection(0, tp_size, 0, ctrl, store, False, tag=f"minivllm-{os.getpid()}-{port}", procs=procs)


def wait_ready(store, procs, ready_key: str, timeout_s: float, what: str) -> None:
    """Wait until every local process ``procs[r - 1]`` has set ``ready_key.format(rank=r)`` in
    ``store`` (``r`` from 1), watching them meanwhile: a process that exits or reports an error
    first is raised at once, not after the timeout.

    Raises:
        RuntimeError: ``"<what> failed to start: <worker_failure's description>"``, or
            ``"<what>s [ranks] did not connect within <timeout_s> s"``.
    """
    deadline = time.monotonic() + timeout_s
    waiting = set(range(1, len(procs) + 1))
    while waiting:
        waiting = {r for r in waiting if not store.check([ready_key.format(rank=r)])}
        failure = worker_failure(store, procs)
        if failure:
            raise RuntimeError(f"{what} failed to start: {failure}")
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"{what}s {sorted(waiting)} did not connect within {timeout_s:.0f} s")
        if waiting:
            time.sleep(0.02)


def worker_failure(store, procs) -> str | None:
    """A description of the first failed local worker (its error report, else its exit
    status), or None while all are running."""
    for r, p in enumerate(procs, start=1):
        code = p.poll()
        report = read_error(store, r)
        if report is not None:
            return f"rank {r} (pid {p.pid}) raised:\n{report}"
        if code is not None:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            return f"rank {r} (pid {p.pid}) {how}"
    return None


def read_error(store, rank: int) -> str | None:
    if store is None:
        return None
    key = ERROR_KEY.format(rank=rank)
    try:
        if store.check([key]):
            return store.get(key).decode(errors="replace")
    except Exception:  # the store lives in rank 0; a broken connection means nothing to read
        return None
    return None


def kill_workers(procs, grace_s: float = 5.0) -> None:
    """Wait up to ``grace_s`` for the workers to exit, then SIGTERM, then SIGKILL; reaps them."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# -- local launch (worker side) -----------------------------------------------------------------
def connect_to_parent(address: str, rank: int, world_size: int) -> Connection:
    """A local worker: connect to rank 0's store at ``host:port``, say ready, build the
    control group (which waits for every rank)."""
    host, _, port = address.rpartition(":")
    store = dist.TCPStore(host, int(port), world_size, False, timeout=datetime.timedelta(seconds=60))
    store.set(READY_KEY.format(rank=rank), b"1")
    ctrl = dist.ProcessGroupGloo(dist.PrefixStore("ctrl", store), rank, world_size, CTRL_TIMEOUT)
    return Connection(rank, world_size, rank, ctrl, store, False, tag=f"minivllm-{os.getppid()}-{port}")


def report_error(conn: Connection, text: str) -> None:
    """Leave a worker's error for rank 0 to show (local launches only)."""
    if conn.store is not None:
        try:
            conn.store.set(ERROR_KEY.format(rank=conn.rank), text.encode())
        except Exception:
            pass


# -- the model group ----------------------------------------------------------------------------
def create_model_group(conn: Connection, backend: str, device: torch.device) -> object:
    """Build the group the layers' collectives run on ("nccl" or "gloo"); every rank calls it."""
    timeout = model_timeout()
    if conn.external:
        return dist.new_group(backend=backend, timeout=timeout)
    store = dist.PrefixStore("model", conn.store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, conn.rank, conn.world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.group_name = conn.tag
        opts.global_ranks_in_group = list(range(conn.world_size))
        with torch.cuda.device(device):
            return dist.ProcessGroupNCCL(store, conn.rank, conn.world_size, opts)
    raise ValueError(f"distributed backend {backend!r}: expected 'nccl' or 'gloo'")


# -- control-plane messages (gloo, CPU) ----------------------------------------------------------
def broadcast(group, tensor: torch.Tensor, root: int = 0, timeout: datetime.timedelta | None = None) -> torch.Tensor:
    """Broadcast a CPU tensor from ``root`` in place; returns it. ``timeout``: for the sender (the
    control group itself waits a year, for workers idling until the next step), so that a worker
    that stopped taking messages fails the engine instead of blocking it for good.

    Raises:
        RuntimeError: not every rank took the message within ``timeout`` (saying so)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    work = group.broadcast([tensor], opts)
    if timeout is None:
        work.wait()
        return tensor
    try:
        work.wait(timeout)
    except RuntimeError as e:
        raise RuntimeError(f"a tensor-parallel worker did not take rank 0's message within "
                           f"{timeout.total_seconds():g} s (MINIVLLM_TP_TIMEOUT): stopped or hung? ({e})") from e
    return tensor


def broadcast_object(group, obj, rank: int, root: int = 0):
    """Pickle ``obj`` on ``root`` and return the same object on every rank."""
    if rank == root:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        broadcast(group, torch.tensor([data.numel()], dtype=torch.int64), root)
        broadcast(group, data, root)
        return obj
    size = broadcast(group, torch.zeros(1, dtype=torch.int64), root)
    data = broadcast(group, torch.empty(int(size), dtype=torch.uint8), root)
    return pickle.loads(data.numpy().tobytes())


def all_reduce_min(group, value: int) -> int:
    """The smallest ``value`` over all ranks, on every rank."""
    t = torch.tensor([value], dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    group.allreduce([t], opts).wait()
    return int(t)
