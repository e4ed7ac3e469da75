"""Peers run side by side with minivllm: Hugging Face transformers (``generate`` on padded
batches, and its continuous-batching manager) on the same weights, and nano-vllm's engine
overhead through its measurement script, in rounds alternating with minivllm's."""
from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minivllm.bench.common import sync
from minivllm.bench.workload import Workload


def hf_state_from_ours(model, config) -> dict:
    """Our Qwen3 state dict in Hugging Face names: split the packed ``qkv_proj`` (rows
    q | k | v) and ``gate_up_proj`` (rows gate | up) back into their parts."""
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q = config.num_attention_heads * d
    kv = config.num_key_value_heads * d
    out = {}
    for name, t in model.state_dict().items():
        if ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv], dim=0)):
                out[name.replace("qkv_proj", part)] = piece
        elif ".gate_up_proj." in name:
            gate, up = t.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = t
    return out


def load_hf_model(engine):
    """The same weights as ``engine``'s model, as a transformers model on the same device
    and dtype: loaded from the checkpoint directory, or (random models) copied from ours."""
    from transformers import AutoModelForCausalLM

    from transformers.utils import logging as hf_logging

    src, dev, dt = engine.source, engine.config.device, engine.config.dtype
    if src.checkpoint_dir is not None:
        hf_logging.disable_progress_bar()  # a loading bar per benchmark run is noise in logs and notebooks
        try:
            hf = AutoModelForCausalLM.from_pretrained(str(src.checkpoint_dir), dtype=dt)
        finally:
            hf_logging.enable_progress_bar()
    else:
        hf = AutoModelForCausalLM.from_config(src.hf_config, dtype=dt)
        sd = hf_state_from_ours(engine.runner.model, src.hf_config)
        missing, unexpected = hf.load_state_dict(sd, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and src.hf_config.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(f"weight layout mismatch copying to transformers: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
    return hf.to(dev).eval()


def run_hf_generate(hf, workload: Workload, batch_size: int, pad_token_id: int, device) -> dict:
    """transformers ``generate`` on padded batches in request order (left padding, greedy,
    eos disabled so every row runs to the batch's longest output). Throughput counts only
    the tokens each request asked for."""
    import torch

    outputs: list[list[int]] = []
    n = workload.num_requests
    sync(device)
    t0 = time.perf_counter()
    for start in range(0, n, batch_size):
        prompts = workload.prompts[start:start + batch_size]
        outs = workload.output_lens[start:start + batch_size]
        width, m = max(len(p) for p in prompts), max(outs)
        ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            gen = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                              max_new_tokens=m, eos_token_id=None, pad_token_id=pad_token_id)
        if gen.shape[1] != width + m:
            raise RuntimeError(f"transformers generate stopped at {gen.shape[1] - width} of {m} new tokens")
        new = gen[:, width:].tolist()
        outputs.extend(row[:k] for row, k in zip(new, outs))
    sync(device)
    t1 = time.perf_counter()
    return {"seconds": t1 - t0, "outputs": outputs, "batch_size": batch_size}


def run_hf_continuous_batching(hf, workload: Workload, device) -> dict:
    """transformers' continuous batching manager (the machinery behind ``generate_batch``),
    one request per prompt with its own ``max_new_tokens``, eos disabled. The manager's set-up
    (cache allocation; on CUDA its own warm-up) is outside the timed region; ``run_throughput``
    warms it up first as it does minivllm."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cuda = device.type == "cuda"
    total = workload.num_prompt_tokens + workload.num_output_tokens
    page = 256 if cuda else 16
    cb_kwargs: dict[str, Any] = {"auto_switch_to_flash": False}  # flash kernels come from the Hub: offline
    if not cuda:  # automatic sizing probes device memory; on CPU give it the whole workload
        cb_kwargs.update(page_size=page, num_blocks=total // page + 2 * workload.num_requests + 8,
                         max_batch_tokens=2048)
    cb_config = ContinuousBatchingConfig(**cb_kwargs)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens), eos_token_id=-1,
                                  pad_token_id=0)
    results: dict[str, Any] = {}
    with torch.inference_mode(), hf.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=10,
            warmup=cuda) as manager:
        sync(device)
        t0 = time.perf_counter()
        rids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
                for i, (p, n) in enumerate(zip(workload.prompts, workload.output_lens))]
        while len(results) < len(rids):
            res = manager.get_result(timeout=1)
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching loop stopped unexpectedly")
                continue
            if res.is_finished():
                if res.error:
                    raise RuntimeError(f"transformers continuous batching: {res.error}")
                results[res.request_id] = res
        sync(device)
        t1 = time.perf_counter()
    return {"seconds": t1 - t0, "outputs": [list(results[r].generated_tokens) for r in rids]}


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Identical requests, and the mean fraction of each output before the first differing token."""
    same = 0
    prefix_fracs = []
    for a, b in zip(ours, theirs):
        if a == b:
            same += 1
            prefix_fracs.append(1.0)
            continue
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix_fracs.append(k / max(len(a), 1))
    return {"identical_requests": same, "num_requests": len(ours),
            "mean_matching_prefix": statistics.fmean(prefix_fracs) if prefix_fracs else None}


def default_nanovllm_script() -> Path:
    """``../shared/peers/nanovllm_overhead.py`` next to the repository root (where the project's
    shared peers live), from this file's location."""
    return Path(__file__).resolve().parents[3] / "shared" / "peers" / "nanovllm_overhead.py"


@dataclass
class PeerOverhead:
    """nano-vllm's engine overhead from its peer script, measured in this process in rounds
    that alternate with minivllm's (:class:`NanoVllmOverhead`).

    Attributes:
        available: whether every round ran and printed its JSON.
        us_per_seq_step: batch size -> median over the rounds of each round's median us per
            sequence per decode step of schedule + prepare + postprocess + prepare_sample (the
            figure comparable with minivllm's step time per sequence, per the peer's README).
        rounds: batch size -> each round's median, in the order they ran.
        reason: why not available (missing script, failure), else "".
        script: the script path; seconds: the time spent in it, all rounds together.
    """

    available: bool
    us_per_seq_step: dict[int, float] = field(default_factory=dict)
    reason: str = ""
    script: str = ""
    seconds: float = 0.0
    rounds: dict[int, list[float]] = field(default_factory=dict)

    def add_round(self, batch_size: int, us: float, seconds: float) -> None:
        """Record one round's figure for ``batch_size``."""
        runs = self.rounds.setdefault(batch_size, [])
        runs.append(us)
        self.us_per_seq_step[batch_size] = statistics.median(runs)
        self.seconds += seconds


@contextlib.contextmanager
def _imports_restored():
    """``sys.path`` and the ``nanovllm`` modules as they were before the block."""
    path = list(sys.path)
    before = {k: v for k, v in sys.modules.items() if k == "nanovllm" or k.startswith("nanovllm.")}
    try:
        yield
    finally:
        sys.path[:] = path
        for k in [k for k in sys.modules if k == "nanovllm" or k.startswith("nanovllm.")]:
            if k not in before:
                del sys.modules[k]
        sys.modules.update(before)


class PeerUnavailable(RuntimeError):
    """nano-vllm's peer script is missing, failed, or printed something unreadable."""


class NanoVllmOverhead:
    """nano-vllm's overhead script (default :func:`default_nanovllm_script`) loaded into this
    process, run one batch size and one round at a time through its own ``main(argv)``, its
    figure read from the JSON line it prints. One round between two of minivllm's keeps both
    under the same load: on the shared 2-core machine the two measured minutes apart (the
    script in a subprocess after minivllm's whole run) gave ratios from 0.7x to 3x in
    consecutive runs.

    Raises:
        PeerUnavailable: from the constructor when the script is missing or does not import,
            from :meth:`measure` when a round fails (the message names why).
    """

    FIGURE = "sched_prepare_post_incl_sample"

    def __init__(self, script: str | Path | None = None):
        import importlib.util

        self.path = Path(script) if script is not None else default_nanovllm_script()
        if not self.path.is_file():
            raise PeerUnavailable(f"peer script not found: {self.path}")
        spec = importlib.util.spec_from_file_location("minivllm_peer_nanovllm_overhead", self.path)
        module = importlib.util.module_from_spec(spec)
        try:
            with _imports_restored():
                spec.loader.exec_module(module)
        except BaseException as e:  # noqa: BLE001  (a script that exits at import is a missing peer)
            if isinstance(e, KeyboardInterrupt):
                raise
            raise PeerUnavailable(f"{self.path.name} did not import: {type(e).__name__}: {e}") from None
        self._main = getattr(module, "main", None)
        if not callable(self._main):
            raise PeerUnavailable(f"{self.path.name} has no main(argv)")

    def measure(self, batch_size: int, steps: int, threads: int, block_size: int | None = None) -> tuple[float, float]:
        """One round at ``batch_size``: ``max(steps, 50)`` timed decode steps of one fresh scheduler
        (the script's ``--reps 1``; at least 50 so that its median is not a handful of steps) on ``threads`` torch threads, with KV blocks of
        ``block_size`` tokens (the script's own default, nano-vllm's 256, when None: a block
        boundary costs an allocation and a block hash, so the two engines are compared at
        the same block size). Returns (median us per
        sequence per decode step, seconds the round took). The script's ``nanovllm`` package
        and its ``sys.path`` entry are taken out again afterwards (a real nano-vllm install
        imported later in the process is not shadowed); in-process, a peer that hangs hangs the
        benchmark (the script is the project's own, in ``../shared/peers``)."""
        import io

        out = io.StringIO()
        argv = ["--batch", str(batch_size), "--steps", str(max(steps, 50)), "--reps", "1", "--threads", str(threads)]
        if block_size is not None:
            argv += ["--block-size", str(block_size)]
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(out), _imports_restored():
                self._main(argv)
        except BaseException as e:  # noqa: BLE001  (argparse and the script stop with SystemExit)
            if isinstance(e, KeyboardInterrupt):
                raise
            raise PeerUnavailable(f"{self.path.name} {' '.join(argv)} failed: {type(e).__name__}: {e}") from None
        seconds = time.perf_counter() - t0
        lines = out.getvalue().strip().splitlines()
        try:
            rows = json.loads(lines[-1])["results"]
            return float(next(r for r in rows if int(r["B"]) == batch_size)[self.FIGURE]["median"]), seconds
        except (IndexError, ValueError, KeyError, TypeError, StopIteration) as e:
            raise PeerUnavailable(f"unreadable peer output ({type(e).__name__}: {e})") from None
