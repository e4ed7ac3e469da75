"""How much int8 weights change a model's outputs, measured (``python -m minivllm.quantization.accuracy``).

Three figures, each against the same model in fp32, each computed through the int8 matmul
paths the engine uses (:class:`minivllm.quantization.int8.Int8Weight`; on the CPU our panel
GEMM's int8 panels, weight-only, where it builds):

The loss and logits figures are given for the device's default int8 path, for torch's fbgemm
dynamic linear (which also quantises activations per token, where torch has it) and for the
``"reference"`` path (dequantised weights, float activations: weight-only), so weight rounding
and activation rounding can be told apart.

* :func:`heldout_loss_change`: the embedded model's mean next-token cross-entropy on its
  held-out documents (the split of ``scripts/train_tiny_model.py``, rebuilt from the Python
  standard library), fp32 vs int8, via transformers' Qwen3 with its ``nn.Linear`` layers
  replaced by int8 ones (:func:`int8_hf_linears`).
* :func:`greedy_agreement`: our engine, ``LLM(model)`` vs ``LLM(model, quantization="int8")``,
  greedy continuations of a fixed prompt set: how many tokens agree before the first
  difference, and how many continuations are identical.
* :func:`logits_error`: on a ``random:`` preset, the logits of one short prompt, fp32 vs
  int8: largest absolute difference, that relative to the largest fp32 logit, and how many
  positions keep their arg-max.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from minivllm.bench.common import format_load
from minivllm.quantization.int8 import Int8Weight

#: prompts of the greedy-agreement check (fixed; a mix of prose and code, as the corpus is)
AGREEMENT_PROMPTS = (
    "The list type", "def ", "Return the", "class Foo:", "import os\n", "The following functions",
    "Raises ValueError if", "This module provides", "for i in range(", "Note: the", "with open(",
    "The return value is", "If the argument is", "A dictionary is", "    def __init__(self", "Example:\n\n",
)


class _Int8HFLinear(nn.Module):
    """A drop-in for ``nn.Linear`` computing through :class:`Int8Weight` (keeps the original
    layer in ``float_linear`` so that :func:`restore_hf_linears` can put it back)."""

    def __init__(self, linear: nn.Linear, kernel: str | None):
        super().__init__()
        self.int8 = Int8Weight(linear.weight.detach(), kernel)
        self.bias = linear.bias
        self.__dict__["float_linear"] = linear  # not a submodule: not in state_dict / modules()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.int8.matmul(x, self.bias)


def int8_hf_linears(model: nn.Module, kernel: str | None = None, lm_head: bool = True) -> int:
    """Replace every ``nn.Linear`` of a transformers model, in place, by an int8 one (the LM
    head too unless ``lm_head=False``; a tied embedding table is left as is). Returns how
    many were replaced."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    count = 0
    for name, m in targets:
        if not lm_head and name.endswith("lm_head"):
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, _Int8HFLinear(m, kernel))
        count += 1
    return count


def restore_hf_linears(model: nn.Module) -> int:
    """Undo :func:`int8_hf_linears` (the float layers back in place). Returns how many."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, _Int8HFLinear)]
    for name, m in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, m.float_linear)
    return len(targets)


#: the embedded model's training script (a source checkout's; an installed wheel has no scripts/)
TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_tiny_model.py"


def _train_script():
    path = TRAIN_SCRIPT
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the held-out split is rebuilt by the training script "
                                "(run from a source checkout)")
    spec = importlib.util.spec_from_file_location("_train_tiny_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def heldout_ids() -> tuple[list[int], int]:
    """The embedded model's held-out token stream and its ``seq_len`` (training window).

    Raises:
        ValueError: the corpus rebuilt here differs from the one recorded at training (another
            CPython release): the split would not be the held-out one.
    """
    from tokenizers import Tokenizer

    from minivllm.utils.model_source import EMBEDDED_MODEL_DIR

    script = _train_script()
    record = json.loads((EMBEDDED_MODEL_DIR / "training_record.json").read_text())
    docs = script.collect_corpus()
    sha = script.corpus_sha256(docs)
    if sha != record["corpus"]["sha256"]:
        raise ValueError(f"corpus sha256 {sha} differs from the training record's {record['corpus']['sha256']} "
                         f"(Python {sys.version.split()[0]}; trained with {record['versions']['python']})")
    _, held = script.split_corpus(docs)
    tok = Tokenizer.from_file(str(EMBEDDED_MODEL_DIR / "tokenizer.json"))
    ids = script.encode_docs(tok, held, tok.token_to_id(script.EOS))
    return ids, int(record["hyperparameters"]["seq_len"])


@torch.no_grad()
def mean_loss(model: nn.Module, ids: list[int], seq_len: int, batch: int = 8) -> float:
    """Mean next-token cross-entropy (nats/token) over non-overlapping ``seq_len`` windows of
    ``ids`` (the tail as one shorter window), as the training script evaluates."""
    import torch.nn.functional as F

    data = torch.tensor(ids, dtype=torch.long)
    n_full = (len(data) - 1) // seq_len
    windows = [data[i * seq_len: i * seq_len + seq_len + 1] for i in range(n_full)]
    groups = [torch.stack(windows[i: i + batch]) for i in range(0, len(windows), batch)]
    tail = data[n_full * seq_len:]
    if len(tail) >= 2:
        groups.append(tail[None])
    total, count = 0.0, 0
    for x in groups:
        logits = model(input_ids=x[:, :-1]).logits.float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
    return total / count


def _kernels(kernels) -> list[str]:
    from minivllm.quantization.int8 import cpu_int8_unavailable_reason, default_kernel

    if kernels is None:  # the default path, fbgemm where torch has it, the reference
        kernels = (None, "fbgemm-dynamic", "reference") if cpu_int8_unavailable_reason() is None else (None, "reference")
    return list(dict.fromkeys(default_kernel("cpu") if k is None else k for k in kernels))


def heldout_loss_change(kernels=None, lm_head: bool = True) -> dict:
    """Held-out loss of the embedded model in fp32 and with int8 linears (nats/token), once per
    int8 matmul path in ``kernels`` (``None`` in it: the CPU's default path; ``"reference"`` is
    weight-only, so beside ``"fbgemm-dynamic"`` it separates weight from activation quantisation;
    ``kernels=None``: the default path, fbgemm where torch has it, and the reference).
    Returns ``{"tokens", "seq_len", "fp32", "int8": {kernel: loss}, "change": {kernel: int8 - fp32}}``."""
    from transformers import AutoModelForCausalLM

    from minivllm.utils.model_source import EMBEDDED_MODEL_DIR

    ids, seq_len = heldout_ids()
    model = AutoModelForCausalLM.from_pretrained(str(EMBEDDED_MODEL_DIR), dtype=torch.float32).eval()
    fp32 = mean_loss(model, ids, seq_len)
    out = {"tokens": len(ids), "seq_len": seq_len, "fp32": fp32, "int8": {}, "change": {}}
    for kernel in _kernels(kernels):
        int8_hf_linears(model, kernel, lm_head)
        out["int8"][kernel] = mean_loss(model, ids, seq_len)
        out["change"][kernel] = out["int8"][kernel] - fp32
        restore_hf_linears(model)
    return out


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare_greedy(reference, candidate, prompts=AGREEMENT_PROMPTS, max_tokens: int = 32) -> dict:
    """Greedy continuations (``ignore_eos``) of ``prompts`` from two ``LLM`` instances.

    Returns ``prefix_agreement`` (tokens before the first difference / all tokens),
    ``position_agreement`` (equal tokens at equal positions / all tokens), ``identical``
    (continuations equal throughout) out of ``num_prompts``.
    """
    from minivllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ref, got = ([list(o.outputs[0].token_ids) for o in llm.generate(list(prompts), sp, use_tqdm=False)]
                for llm in (reference, candidate))
    total = sum(len(t) for t in ref)
    prefix = sum(_prefix(a, b) for a, b in zip(ref, got))
    same_pos = sum(x == y for a, b in zip(ref, got) for x, y in zip(a, b))
    return {"num_prompts": len(prompts), "max_tokens": max_tokens, "prefix_agreement": prefix / total,
            "position_agreement": same_pos / total, "identical": sum(a == b for a, b in zip(ref, got))}


def greedy_agreement(model: str | None = None, prompts=AGREEMENT_PROMPTS, max_tokens: int = 32,
                     quantize_lm_head: bool = True, **engine_args) -> dict:
    """:func:`compare_greedy` of ``LLM(model)`` (reference) and ``LLM(model, quantization="int8")``."""
    from minivllm import LLM

    base = LLM(model, **engine_args)
    try:
        quant = LLM(model, quantization="int8", quantize_lm_head=quantize_lm_head, **engine_args)
        try:
            return compare_greedy(base, quant, prompts, max_tokens)
        finally:
            quant.shutdown()
    finally:
        base.shutdown()


@torch.no_grad()
def logits_error(model: str = "random:qwen3-0.6b", prompt_len: int = 16, seed: int = 0,
                 kernels=None) -> dict:
    """Logits of one ``prompt_len``-token prompt (token ids drawn with ``seed``) from a
    ``random:`` preset's weights in fp32 and with int8 linears (transformers' Qwen3 holding
    our random weights), once per int8 path in ``kernels`` (as :func:`heldout_loss_change`).
    Returns, per path (``{"by_kernel": {kernel: {...}}}``), the largest absolute difference,
    that divided by the largest |fp32 logit|, the mean absolute difference, and the fraction of
    positions whose arg-max token is unchanged."""
    from transformers import AutoModelForCausalLM

    from minivllm.bench.peers import hf_state_from_ours
    from minivllm.engine.model_runner import build_model
    from minivllm.utils.model_source import resolve_model

    src = resolve_model(model)
    if src.checkpoint_dir is not None:
        raise ValueError(f"model={model!r}: logits_error expects a 'random:' preset")
    ours = build_model(src, torch.device("cpu"), torch.float32, seed)
    hf = AutoModelForCausalLM.from_config(src.hf_config, dtype=torch.float32)
    hf.load_state_dict(hf_state_from_ours(ours, src.hf_config), strict=False)
    if src.hf_config.tie_word_embeddings:
        hf.tie_weights()
    del ours
    hf.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, src.hf_config.vocab_size, (1, prompt_len), generator=gen)
    ref = hf(input_ids=ids).logits.float()[0]
    out = {"model": model, "prompt_len": prompt_len, "max_abs_logit": ref.abs().max().item(), "by_kernel": {}}
    for kernel in _kernels(kernels):
        int8_hf_linears(hf, kernel)
        got = hf(input_ids=ids).logits.float()[0]
        restore_hf_linears(hf)
        diff = (got - ref).abs()
        out["by_kernel"][kernel] = {
            "max_abs_error": diff.max().item(), "rel_error": (diff.max() / ref.abs().max()).item(),
            "mean_abs_error": diff.mean().item(),
            "argmax_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m minivllm.quantization.accuracy",
                                description="How much int8 weights change a model's outputs, measured against "
                                            "the same model in fp32.")
    p.add_argument("--random-model", default="random:qwen3-0.6b",
                   help="random-weight model at a real shape for the logits comparison (default random:qwen3-0.6b)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens for the logits comparison (default 16)")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="greedy tokens generated per prompt for the agreement figure (default 32)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--skip", nargs="*", default=(), choices=("loss", "agreement", "logits"),
                   help="figures not to compute")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out: dict = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "command": " ".join(sys.argv),
                 "loadavg_start": list(os.getloadavg()), "torch": torch.__version__,
                 "threads": torch.get_num_threads()}
    threads = out["threads"]
    print(f"{out['date_utc']} UTC, torch {torch.__version__}, {threads} thread{'s' if threads != 1 else ''}, "
          f"load {format_load(out['loadavg_start'])}")
    if "loss" not in args.skip and not TRAIN_SCRIPT.is_file():
        print(f"embedded model held-out loss: skipped ({TRAIN_SCRIPT} rebuilds the held-out split: run from a "
              "source checkout)")
    elif "loss" not in args.skip:
        r = out["heldout_loss"] = heldout_loss_change()
        for k, loss in r["int8"].items():
            print(f"embedded model held-out loss ({r['tokens']} tokens), int8 via {k}: fp32 {r['fp32']:.4f}, "
                  f"int8 {loss:.4f}, change {r['change'][k]:+.4f} nats/token")
    if "agreement" not in args.skip:
        r = out["greedy_agreement"] = greedy_agreement(max_tokens=args.max_tokens)
        print(f"embedded model greedy agreement ({r['num_prompts']} prompts x {r['max_tokens']} tokens): "
              f"{r['prefix_agreement']:.1%} of tokens before the first difference, {r['position_agreement']:.1%} "
              f"position-wise, {r['identical']}/{r['num_prompts']} continuations identical")
    if "logits" not in args.skip:
        r = out["logits_error"] = logits_error(args.random_model, args.prompt_len)
        for k, e in r["by_kernel"].items():
            print(f"{r['model']} logits, {r['prompt_len']}-token prompt, int8 via {k}: max |int8 - fp32| "
                  f"{e['max_abs_error']:.4f} ({e['rel_error']:.2%} of max |logit| {r['max_abs_logit']:.3f}), "
                  f"mean {e['mean_abs_error']:.4f}, arg-max kept at {e['argmax_agreement']:.0%} of positions")
    out["loadavg_end"] = list(os.getloadavg())
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
