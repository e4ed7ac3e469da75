"""Roofline accounting: FLOPs and bytes moved by one engine step, and MFU / MBU.

The numbers are computed from the model config and the step's shape, not
measured by counters. They are the *work the step must do* (an idealised
minimum), which is what utilisation figures are defined against:

* FLOPs. A dense matmul ``(t, k) @ (k, n)`` costs ``2 t k n`` FLOPs (one
  multiply and one add per weight per token), so the linear layers cost
  ``2 N`` FLOPs per token for ``N`` non-embedding matmul parameters (Kaplan et
  al. 2020, "Scaling Laws for Neural Language Models", sec. 2.1, ``C ~ 2N``
  per token forward). Attention adds ``QK^T`` and ``PV``: ``2 d`` FLOPs each
  per (query head, key) pair, i.e. ``4 d H`` per query token per key attended,
  with causal masking (a token at position ``p`` attends to ``p + 1`` keys).
  The LM head costs ``2 D V`` per row whose logits are computed (one per
  sampled sequence; a speculative decode's verification computes one per token it
  checks, its drafts and the next).
* Bytes. Every weight matrix is read from memory once per step, whatever the
  batch (that is why batching decode is cheap); the embedding table is only
  read for the rows looked up. The KV cache is read for every key/value the
  step's tokens attend to (each cached position once per sequence per layer)
  and written for every new token.
* Arithmetic intensity ``I = FLOPs / bytes``. The roofline model (Williams,
  Waterman & Patterson 2009, "Roofline: an insightful visual performance model
  for multicore architectures", CACM 52(4)) bounds attainable FLOP/s by
  ``min(peak_flops, I * peak_bandwidth)``: below the ridge point
  ``peak_flops / peak_bandwidth`` a step is memory-bound, above it compute-bound.
* MFU (model FLOPs utilisation, Chowdhery et al. 2022, "PaLM", sec. 4.1 and
  appendix B) = model FLOPs per second achieved / peak FLOP/s. MBU (model
  bandwidth utilisation; Databricks' "LLM Inference Performance Engineering: Best
  Practices", Oct. 2023) is the same ratio for bytes: bytes / s / peak bytes/s.
  Both use the step's wall time, so host overhead lowers them, as it should.

What is ignored (documented so nobody reads more into the numbers):
activations (hidden states, MLP intermediates, attention scores, logits) are
assumed to stay in cache/SRAM or to be small next to weights and KV; norms,
rotary, SiLU and softmax FLOPs (O(D) per token against O(D^2)); re-reads of KV
by tiled attention kernels beyond the first read; sampling. Sliding-window
attention is not modelled (Qwen3 dense checkpoints ship
``use_sliding_window=false``); mixture-of-experts configs are refused.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from operator import attrgetter
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from minivllm.telemetry.peaks import Peaks
from minivllm.utils import cdiv
from minivllm.utils.dtypes import DTYPES, canonical_dtype_name

__all__ = [
    "ModelCost",
    "Peaks",
    "engine_cost",
    "step_cost",
    "entries_from_record",
    "fill_step_record",
    "arithmetic_intensity",
    "attended_keys",
    "dtype_nbytes",
]

def dtype_nbytes(dtype: Any) -> int:
    """Bytes per element of ``dtype``: a ``torch.dtype``, a name ("bfloat16",
    "fp32", "torch.float16", ...) or a positive int (taken as the byte count).

    Raises:
        ValueError: a bool, a non-positive count, or a name that is no dtype (naming it)."""
    if isinstance(dtype, bool):
        raise ValueError(f"dtype must be a torch dtype, a dtype name or a byte count, got {dtype!r}")
    if isinstance(dtype, numbers.Integral):  # numpy integers too (they have an itemsize of their own)
        if dtype <= 0:
            raise ValueError(f"dtype byte count must be positive, got {dtype!r}")
        return int(dtype)
    itemsize = getattr(dtype, "itemsize", None)  # torch.dtype has .itemsize (torch >= 2.1)
    if isinstance(itemsize, int) and not isinstance(dtype, str):
        return itemsize
    name = canonical_dtype_name(str(dtype))
    if name is None:
        raise ValueError(f"unknown dtype {dtype!r}; expected e.g. 'float32', 'bfloat16' or a torch.dtype")
    return DTYPES[name][0]


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


@dataclass(frozen=True)
class ModelCost:
    """Static cost figures of a Qwen3-style dense decoder, per tensor-parallel rank.

    With ``tp_size > 1`` the attention heads, MLP columns and vocabulary are
    split across ranks (Megatron-style), so every figure here is what *one*
    rank computes and moves (KV heads are replicated when ``num_kv_heads <
    tp_size``); compare it with one device's peaks.

    Attributes (counts are elements, bytes are bytes):
        hidden_size (D), intermediate_size (F), num_layers (L), num_heads (H),
        num_kv_heads (Hkv), head_dim (d), vocab_size (V): from the config, with
            H, Hkv, F, V already divided by ``tp_size``.
        tie_word_embeddings: LM head shares the embedding matrix.
        weight_bytes / kv_dtype_bytes: bytes per weight element / per KV element.
        layer_matmul_params: ``D*(H*d) + 2*D*(Hkv*d) + (H*d)*D + 3*D*F``
            (+ biases when ``attention_bias``): q, k, v, o, gate, up, down.
        matmul_params: ``L * layer_matmul_params`` (the "N" of 2N per token).
        norm_params: ``L * (2*D + 2*d) + D`` (input/post-attention RMSNorm, q/k
            RMSNorm per head, final norm); read but not counted as FLOPs.
        lm_head_params: ``D * V``; embedding_params: ``V * D``.
        kv_bytes_per_token: ``2 * L * Hkv * d * kv_dtype_bytes`` (K and V, every layer).
        quantization: None, or ``"int8"``: every matmul weight of the layers (and the LM head
            when ``quantize_lm_head``) is read as 1 byte plus one fp32 scale per output
            channel (:mod:`minivllm.quantization.int8`); norms, biases and the embedding
            rows stay at ``weight_bytes``.
        quantize_lm_head: whether the LM head is int8 under ``quantization="int8"``.
        matmul_weight_bytes / lm_head_weight_bytes: bytes per element of the layers' matmul
            weights / the LM head as the engine holds them, where that differs from
            ``weight_bytes`` (a float32 model whose weights are float16 values keeps them in
            16-bit panels on the CPU: 2); ``None``: ``weight_bytes``. Int8 layers (and an int8
            LM head) follow their own formula instead.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool
    weight_bytes: int
    kv_dtype_bytes: int
    tp_size: int = 1
    quantization: str | None = None
    quantize_lm_head: bool = True
    matmul_weight_bytes: float | None = None
    lm_head_weight_bytes: float | None = None

    @classmethod
    def from_config(
        cls,
        config: Any,
        dtype: Any = "float32",
        tp_size: int = 1,
        kv_dtype: Any = None,
        quantization: str | None = None,
        quantize_lm_head: bool = True,
        weight_storage: tuple[float, float] | None = None,
    ) -> "ModelCost":
        """Build from a ``transformers`` Qwen3 config (or any object / dict with
        the same attribute names). ``dtype``: weight dtype (torch dtype, name or
        byte count); ``kv_dtype`` defaults to ``dtype``; ``quantization`` /
        ``quantize_lm_head``: as the engine arguments of the same names; ``weight_storage``:
        bytes per element of the layers' matmul weights and of the LM head as held, if not
        ``dtype``'s (:func:`minivllm.layers.prepack.matmul_bytes_per_weight`; ``None`` for either
        part: ``dtype``'s).

        Raises:
            ValueError: a bad tp_size, config value or quantization (names it)."""
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
            raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
        if quantization not in (None, "int8"):
            raise ValueError(f"quantization={quantization!r}: ModelCost knows None and 'int8'")
        if _get(config, "num_experts") or _get(config, "num_local_experts"):
            raise ValueError("mixture-of-experts configs are not modelled by ModelCost")
        D = _get(config, "hidden_size")
        F = _get(config, "intermediate_size")
        L = _get(config, "num_hidden_layers")
        H = _get(config, "num_attention_heads")
        Hkv = _get(config, "num_key_value_heads") or H
        V = _get(config, "vocab_size")
        d = _get(config, "head_dim")
        if d is None:
            if isinstance(D, numbers.Integral) and isinstance(H, numbers.Integral) and H > 0 and D % H:
                raise ValueError(f"config.hidden_size={D} is not divisible by num_attention_heads={H} "
                                 "and the config gives no head_dim")
            d = D // H if isinstance(D, numbers.Integral) and isinstance(H, numbers.Integral) and H > 0 else None
        for name, val in (("hidden_size", D), ("intermediate_size", F), ("num_hidden_layers", L),
                          ("num_attention_heads", H), ("num_key_value_heads", Hkv), ("vocab_size", V),
                          ("head_dim", d)):
            if not isinstance(val, numbers.Integral) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"config.{name} must be a positive int, got {val!r}")
        D, F, L, H, Hkv, V, d = map(int, (D, F, L, H, Hkv, V, d))  # numpy integers from a dict config
        flags = {}
        for name in ("tie_word_embeddings", "attention_bias"):
            val = _get(config, name, False)
            if not isinstance(val, (bool, np.bool_)) and val not in (0, 1, None):
                raise ValueError(f"config.{name} must be a bool, got {val!r}")
            flags[name] = bool(val)
        if H % tp_size:
            raise ValueError(f"num_attention_heads={H} is not divisible by tp_size={tp_size}")
        wb = dtype_nbytes(dtype)
        kvb = dtype_nbytes(kv_dtype) if kv_dtype is not None else wb
        return cls(
            hidden_size=D,
            intermediate_size=cdiv(F, tp_size),
            num_layers=L,
            num_heads=H // tp_size,
            num_kv_heads=max(1, Hkv // tp_size),
            head_dim=d,
            vocab_size=cdiv(V, tp_size),
            tie_word_embeddings=flags["tie_word_embeddings"],
            attention_bias=flags["attention_bias"],
            weight_bytes=wb,
            kv_dtype_bytes=kvb,
            tp_size=tp_size,
            quantization=quantization,
            quantize_lm_head=bool(quantize_lm_head),
            matmul_weight_bytes=None if weight_storage is None or weight_storage[0] is None
            else float(weight_storage[0]),
            lm_head_weight_bytes=None if weight_storage is None or weight_storage[1] is None
            else float(weight_storage[1]),
        )

    # --- parameter counts (elements, per rank) ---
    @property
    def layer_matmul_params(self) -> int:
        """One layer's matmul weights (q, k, v, o projections, gate / up / down; biases if any)."""
        D, F, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        n = D * q + 2 * D * kv + q * D + 3 * D * F
        if self.attention_bias:
            n += q + 2 * kv  # bias adds are O(1) per output; counted as weights to read
        return n

    @property
    def matmul_params(self) -> int:
        """``N`` of Kaplan's 2N FLOPs per token: every layer's matmul weights (not the LM head)."""
        return self.num_layers * self.layer_matmul_params

    @property
    def norm_params(self) -> int:
        """RMSNorm weights: two per layer, Qwen3's q / k norms (``head_dim`` each), and the final norm."""
        return self.num_layers * (2 * self.hidden_size + 2 * self.head_dim) + self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """The LM head's ``D x V`` weights (this rank's share of the vocabulary)."""
        return self.hidden_size * self.vocab_size

    @property
    def embedding_params(self) -> int:
        """The embedding table's ``V x D`` weights."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All parameters of this rank (the tied matrix counted once)."""
        n = self.matmul_params + self.norm_params + self.embedding_params
        return n if self.tie_word_embeddings else n + self.lm_head_params

    # --- bytes ---
    @property
    def layer_bias_params(self) -> int:
        """Bias elements per layer (q, k, v with ``attention_bias``; else 0)."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.attention_bias else 0

    @property
    def layer_output_channels(self) -> int:
        """Output rows of a layer's matmuls (``H*d + 2*Hkv*d + D + 2*F + D``): one int8 scale each."""
        D, F, d = self.hidden_size, self.intermediate_size, self.head_dim
        return (self.num_heads + 2 * self.num_kv_heads) * d + D + 2 * F + D

    @property
    def body_weight_bytes(self) -> int:
        """Bytes of the decoder layers + final norm, read once by every step. With int8:
        ``L * ((matmul weights) * 1 + output_channels * 4 + biases * weight_bytes) + norms * weight_bytes``."""
        if self.quantization != "int8":
            if self.matmul_weight_bytes is None:
                return (self.matmul_params + self.norm_params) * self.weight_bytes
            bias = self.num_layers * self.layer_bias_params  # biases are not packed
            return round((self.matmul_params - bias) * self.matmul_weight_bytes) \
                + (bias + self.norm_params) * self.weight_bytes
        from minivllm.quantization.int8 import SCALE_BYTES

        bias = self.layer_bias_params
        per_layer = (self.layer_matmul_params - bias) + self.layer_output_channels * SCALE_BYTES \
            + bias * self.weight_bytes
        return self.num_layers * per_layer + self.norm_params * self.weight_bytes

    @property
    def lm_head_bytes(self) -> int:
        """Bytes of the LM head matrix, read once by a step that computes any logits
        (int8 head: ``D * V + V * 4``, one fp32 scale per vocabulary row)."""
        if self.quantization == "int8" and self.quantize_lm_head:
            from minivllm.quantization.int8 import SCALE_BYTES

            return self.lm_head_params + self.vocab_size * SCALE_BYTES
        if self.lm_head_weight_bytes is not None:
            return round(self.lm_head_params * self.lm_head_weight_bytes)
        return self.lm_head_params * self.weight_bytes

    @property
    def held_weight_bytes(self) -> float:
        """Bytes per element of the layers' matmul weights as held: ``matmul_weight_bytes`` where set
        (16-bit panels of a float32 model: 2), else ``weight_bytes`` (int8 layers: see ``body_weight_bytes``)."""
        return self.matmul_weight_bytes if self.matmul_weight_bytes is not None else self.weight_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token adds to the cache: ``2 x layers x KV heads x head_dim x KV dtype bytes``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    def to_dict(self) -> dict:
        """Every field and the derived counts: JSON-ready."""
        d = asdict(self)
        for k in ("layer_matmul_params", "matmul_params", "norm_params", "lm_head_params",
                  "embedding_params", "num_params", "body_weight_bytes", "lm_head_bytes",
                  "held_weight_bytes", "kv_bytes_per_token"):
            d[k] = getattr(self, k)
        return d


def engine_cost(engine: Any, tp_size: int = 1) -> ModelCost:
    """The :class:`ModelCost` of the model as ``engine`` holds it: its dtype, its KV cache's, int8 quantisation
    (``quantization`` / ``quantize_lm_head``) and 16-bit panels (``engine.weight_storage``). With
    the default ``tp_size=1`` the whole model: what benchmarks and widgets that fill step records
    themselves should use, so their bytes per step count the weights as the engine holds them
    (``engine.model_cost``, which the engine builds with its ``tensor_parallel_size``, is one
    rank's share, its figures already divided)."""
    args = getattr(engine, "args", None)
    return ModelCost.from_config(engine.source.hf_config, dtype=engine.config.dtype, tp_size=tp_size,
                                 kv_dtype=getattr(engine.config, "kv_cache_dtype", None),
                                 quantization=getattr(args, "quantization", None),
                                 quantize_lm_head=getattr(args, "quantize_lm_head", True),
                                 weight_storage=getattr(engine, "weight_storage", None))


def attended_keys(num_new_tokens: int, context_len_after: int) -> int:
    """Sum over the step's new tokens of the number of keys each attends to (causal).

    The new tokens sit at positions ``c - n .. c - 1`` (``c`` = context length
    after the step, ``n`` = new tokens), and the token at position ``p`` attends
    to ``p + 1`` keys, so the sum is ``sum_{p=c-n}^{c-1} (p + 1) = n*c - n*(n-1)/2``.

    Raises:
        ValueError: not ``0 <= num_new_tokens <= context_len_after`` (naming both).
    """
    n, c = num_new_tokens, context_len_after
    if not 0 <= n <= c:
        raise ValueError(f"attended_keys({n!r}, {c!r}): need 0 <= num_new_tokens <= context_len_after")
    return n * c - n * (n - 1) // 2


def _check_entries(entries: Iterable[Sequence[int]]) -> list[tuple[int, int]]:
    out = []
    for i, e in enumerate(entries):
        try:
            n, c = e[0], e[1]
        except (TypeError, IndexError, KeyError):
            n = c = None
        if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in (n, c)):  # 1.5 was taken as 1
            raise ValueError(f"entry {i} must be (num_new_tokens, context_len_after), two ints, got {e!r}")
        n, c = int(n), int(c)
        if n < 0 or c < n:
            raise ValueError(
                f"entry {i}: need 0 <= num_new_tokens <= context_len_after, got {e!r}")
        out.append((n, c))
    return out


def step_cost(cost: ModelCost, entries: Iterable[Sequence[int]], num_sampled: int) -> tuple[float, float]:
    """FLOPs and bytes moved by one forward step, for one rank.

    Args:
        cost: the model's static figures.
        entries: one ``(num_new_tokens, context_len_after)`` per sequence in the
            step (a decode is ``(1, c)``; a prefill chunk ``(n, c)`` with ``c - n``
            tokens already in the cache, e.g. from a prefix-cache hit or earlier chunks).
        num_sampled: rows whose logits are computed: one per sequence sampled this step, and for
            a speculative decode one per token it verifies (``1 + drafts``); at most the step's
            tokens.

    Returns ``(flops, bytes)``, with (T = total new tokens, A = sum of
    :func:`attended_keys`, K = sum of context_len_after over the entries with new tokens
    (an entry with none runs nothing), S = num_sampled)::

        flops = 2 * matmul_params * T                  # Kaplan et al. 2020: 2N per token
              + 4 * d * H * L * A                      # QK^T and PV, causal
              + 2 * D * V * S                          # LM head
        bytes = body_weight_bytes                      # every layer weight read once
              + lm_head_bytes * (S > 0)
              + T * D * weight_bytes                   # embedding rows looked up
              + K * kv_bytes_per_token                 # KV read: every cached position once per sequence
              + T * kv_bytes_per_token                 # KV written for the new tokens

    A step with no new tokens (T = 0) runs no forward: ``(0.0, 0.0)``, weights included.
    Activations are ignored (see the module docstring).

    Raises:
        ValueError: ``num_sampled`` not a non-negative int or above the step's tokens, or a
            malformed entry (naming it).
    """
    if not isinstance(num_sampled, int) or isinstance(num_sampled, bool) or num_sampled < 0:
        raise ValueError(f"num_sampled must be a non-negative int, got {num_sampled!r}")
    ents = _check_entries(entries)
    T = sum(n for n, _ in ents)
    if num_sampled > T:
        raise ValueError(f"num_sampled={num_sampled} exceeds the step's {T} tokens")
    A = sum(attended_keys(n, c) for n, c in ents if n)
    K = sum(c for n, c in ents if n)
    return _cost_from_sums(cost, T, A, K, num_sampled)


def _coefficients(cost: ModelCost) -> tuple[int, ...]:
    """Per-unit constants of :func:`step_cost`, computed once per ModelCost (steps are hot)."""
    coef = cost.__dict__.get("_coef")
    if coef is None:
        coef = (2 * cost.matmul_params, 4 * cost.head_dim * cost.num_heads * cost.num_layers,
                2 * cost.hidden_size * cost.vocab_size, cost.body_weight_bytes, cost.lm_head_bytes,
                cost.hidden_size * cost.weight_bytes, cost.kv_bytes_per_token)
        object.__setattr__(cost, "_coef", coef)  # a cache on a frozen dataclass
    return coef


def _cost_from_sums(cost: ModelCost, T: int, A: int, K: int, S: int) -> tuple[float, float]:
    """The formulas of :func:`step_cost` from its sums T, A, K, S."""
    lin, att, head, body, lm, emb, kv = _coefficients(cost)
    flops = lin * T + att * A + head * S
    nbytes = (body + (lm if S else 0) + emb * T + kv * (K + T)) if T else 0
    return float(flops), float(nbytes)


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOPs per byte moved (Williams et al. 2009). ``inf`` when nothing is moved.

    Raises:
        ValueError: a count that is not a real number, NaN, or negative (naming both)."""
    if not all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in (flops, nbytes)) \
            or math.isnan(flops) or math.isnan(nbytes) or nbytes < 0 or flops < 0:
        raise ValueError(f"flops and bytes must be non-negative, got {flops!r}, {nbytes!r}")
    return float("inf") if nbytes == 0 else flops / nbytes


def entries_from_record(record: Any) -> tuple[list[tuple[int, int]], int]:
    """``(entries, num_sampled)`` of a ``StepRecord``: each scheduled entry gives
    ``(num_tokens, first_position + num_tokens)``; ``num_sampled`` counts the logit rows
    (:func:`_logit_rows`)."""
    entries = [(e.num_tokens, e.first_position + e.num_tokens) for e in record.scheduled]
    return entries, sum(_logit_rows(e) for e in record.scheduled)


def _logit_rows(e) -> int:
    """Logit rows a scheduled entry computes: none unless it samples; a prefill chunk its last
    position's; a decode each of its tokens (more than one: a speculative verification)."""
    return 0 if not e.sampled else 1 if e.is_prefill else e.num_tokens


_NUM_TOKENS, _FIRST_POSITION, _SAMPLED = attrgetter("num_tokens"), attrgetter("first_position"), attrgetter("sampled")


def _entry_sums(entries) -> tuple[int, int, int, int]:
    """The sums of :func:`step_cost` (tokens, attended keys, keys read, sampled rows) over a step
    record's entries; this runs every engine step. A step of one token per entry (every decode
    step) in C-level passes: a token at position p attends p + 1 keys, so A == K."""
    counts = list(map(_NUM_TOKENS, entries))
    T = sum(counts)
    if counts.count(1) == len(counts):
        K = sum(map(_FIRST_POSITION, entries)) + T
        return T, K, K, sum(map(_SAMPLED, entries))
    A = K = S = 0
    for e in entries:
        n = e.num_tokens
        if n:
            c = e.first_position + n
            K += c
            A += c if n == 1 else n * c - n * (n - 1) // 2
        S += _logit_rows(e)
    return T, A, K, S


def fill_step_record(record: Any, cost: ModelCost, peaks: Peaks | None = None,
                     seconds: float | None = None, sums: tuple[int, int, int, int] | None = None) -> Any:
    """Set ``record.flops`` and ``record.bytes_moved`` from its scheduled entries,
    and with ``peaks`` ``record.mfu`` / ``record.mbu`` (``None`` for a step that took no time or did
    no work; without ``peaks`` they are left as they are)::

        mfu = flops / seconds / peaks.flops_per_s     # PaLM's MFU (Chowdhery et al. 2022)
        mbu = bytes / seconds / peaks.mbu_bytes_per_s  # the measured read bandwidth (a step's
                                                       # bytes are nearly all reads), else the copy's

    ``seconds`` defaults to the step's wall time (``record.wall_ms / 1e3``). ``sums``: the
    caller's ``(T, A, K, S)`` of :func:`step_cost` (tokens, attended keys, keys read, sampled
    rows), when it has them at hand (the engine, for a step of plain decodes), else they are
    summed from ``record.scheduled``.
    Returns the record (modified in place).
    """
    T, A, K, S = sums if sums is not None else _entry_sums(record.scheduled)
    flops, nbytes = _cost_from_sums(cost, T, A, K, S)
    record.flops = flops
    record.bytes_moved = nbytes
    if seconds is None:
        seconds = record.wall_ms / 1e3
    if peaks is not None:
        work = seconds > 0 and flops > 0  # else None, not a figure left from an earlier call
        record.mfu = flops / seconds / peaks.flops_per_s if work else None
        record.mbu = nbytes / seconds / peaks.mbu_bytes_per_s if work else None
    return record
