"""The draft-model proposer (vLLM's ``"draft_model"`` method).

A smaller model with the target's vocabulary guesses the next k tokens of every decoding
sequence, one token at a time, as one batch: a first forward catches the draft's KV cache up
with the sequence (the tokens accepted since its last proposal, or the whole context the
first time) and proposes d_1, then k - 1 single-token forwards propose d_2 .. d_k. The
target then scores all k in one pass (``minivllm/spec_decode/verify.py``); nothing in the
target's path changes.

Greedy requests get the draft's argmax. Requests with temperature > 0 get a draw from the
draft's own distribution q after the request's temperature, top-k, top-p and min-p, and q
travels with the drafts, so rejection sampling accepts with min(1, p/q) and resamples from
norm(max(0, p - q)): exact for any q, and the closer the draft is to the target, the more is
accepted. The draw's randomness is a pure function of the request's committed state
(its seed, or the engine's with its id, and its length): a rolled-back step proposes the
same drafts again, and a seeded request stays reproducible.

Cost: k draft forwards per step (eager; no CUDA graphs), plus its KV cache
(``minivllm/spec_decode/draft_cache.py``), sized to hold as many tokens as the target's pool.
"""
from __future__ import annotations

import hashlib
import logging
import random
import zlib

import torch

from minivllm.engine.kv_cache import kv_bytes_per_token
from minivllm.engine.runner_config import RunnerConfig
from minivllm.layers.sampler import SamplingBatch, argmax_rows, exponential_race, filtered_probs
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.draft_cache import DraftCache
from minivllm.spec_decode.proposal import NO_PROPOSAL, Proposal, may_speculate
from minivllm.utils import cdiv
from minivllm.utils.model_source import EMBEDDED_DRAFT_NAME, resolve_model

logger = logging.getLogger("minivllm")


def draft_generator(seq, base_seed: int, device: torch.device) -> torch.Generator:
    """The generator of ``seq``'s draft draws this step: seeded from its ``SamplingParams.seed``
    (or ``base_seed`` and its request id) and its current length, so it is the same whenever the
    sequence is in the same state, and independent of the target's draws."""
    seed = seq.params.seed
    material = f"seed:{seed}:{len(seq.token_ids)}" if seed is not None else \
        f"engine:{base_seed}:{zlib.crc32(seq.request_id.encode())}:{len(seq.token_ids)}"
    value = int.from_bytes(hashlib.blake2b(material.encode(), digest_size=8).digest(), "little") >> 1
    return torch.Generator(device=device).manual_seed(value)


class DraftModelProposer:
    """``proposer([(seq, max_tokens), ...]) -> [Proposal, ...]`` for ``method="draft_model"``.

    Args:
        config: the speculative config (``model``, ``num_speculative_tokens``).
        target_vocab_size: the target model's vocabulary size.
        target_config: the target's ``RunnerConfig`` (device, dtype, attention backend, block
            size, seed are reused for the draft).
        num_tokens: token slots of the target's KV pool; the draft's pool holds as many plus
            ``k`` per sequence.

    Raises:
        ValueError: the draft's vocabulary size differs from the target's (both named).
        FileNotFoundError: no such draft checkpoint.
    """

    def __init__(self, config: SpeculativeConfig, target_vocab_size: int, target_config: RunnerConfig,
                 num_tokens: int):
        from minivllm.engine.model_runner import ModelRunner

        try:
            source = resolve_model(config.model)
        except FileNotFoundError as e:  # say it is the draft, and which draft ships with the package
            raise FileNotFoundError(f"speculative_config model={config.model!r} (the draft model): {e} The embedded "
                                    f"target's draft is {EMBEDDED_DRAFT_NAME!r}.") from None
        vocab = source.hf_config.vocab_size
        if vocab != target_vocab_size:
            raise ValueError(f"speculative_config model={config.model!r}: the draft's vocabulary has {vocab} "
                             f"tokens, the target's {target_vocab_size}; a draft model must share the target's "
                             f"vocabulary")
        self.k = config.num_speculative_tokens
        # a draft trained on a shorter context has no rotary angles past it: sequences beyond decode
        # without drafts (vLLM, too, caps the draft's length at its own max_position_embeddings)
        self.max_positions = source.hf_config.max_position_embeddings
        if config.max_model_len is not None:  # speculative_config's own cap on the draft (vLLM's key)
            self.max_positions = min(self.max_positions, config.max_model_len)
        bs = target_config.block_size
        blocks = cdiv(num_tokens, bs) + target_config.max_num_seqs * cdiv(self.k + 1, bs)
        blocks = self._fit_device_memory(blocks, source.hf_config, target_config)
        self.runner = ModelRunner(RunnerConfig(
            source=source, device=target_config.device, dtype=target_config.dtype,
            attention_backend=target_config.attention_backend, block_size=bs, num_kvcache_blocks=blocks,
            kv_cache_memory_bytes=None, gpu_memory_utilization=1.0, max_num_batched_tokens=num_tokens,
            seed=target_config.seed, max_num_seqs=target_config.max_num_seqs,
            kv_cache_dtype=target_config.kv_cache_dtype))  # the target's KV cache dtype, as vLLM gives a draft
        self.device = self.runner.device
        self.runner.cpu_fused_ops = self.runner.enable_cpu_fused_ops()  # float32 CPU models only; never compiled
        self.cache = DraftCache(blocks, bs)
        self.base_seed = target_config.seed if target_config.seed is not None else random.getrandbits(62)
        self.calls = 0
        self.name = source.name
        logger.info("draft model %s: %d layers, KV pool %d blocks of %d tokens, %d positions (longer sequences "
                    "decode without drafts)", source.name, source.hf_config.num_hidden_layers, blocks, bs,
                    self.max_positions)

    @staticmethod
    def _fit_device_memory(blocks: int, hf_config, target_config: RunnerConfig) -> int:
        """On CUDA, at most what 90% of the free device memory holds (the target sized its pool
        first); fewer blocks only mean that more entries are evicted and recomputed."""
        if target_config.device.type != "cuda":
            return blocks
        free, _ = torch.cuda.mem_get_info(target_config.device)
        per_block = kv_bytes_per_token(hf_config, target_config.kv_cache_dtype or target_config.dtype) * \
            target_config.block_size
        return max(1, min(blocks, int(0.9 * free) // per_block))

    def enable_cpu_graphs(self, max_num_seqs: int, max_model_len: int) -> bool:
        """Replay the draft's forwards from CPU graphs too (the target engine calls this when its
        own steps replay them): a float32 draft with the C ops and the native decode kernel, as for
        the target. Returns whether they are on."""
        r = self.runner
        if (r.device.type != "cpu" or r.dtype != torch.float32 or not r.cpu_fused_ops
                or not getattr(r.backend, "supports_cpu_graphs", False)):
            return False
        r.enable_cuda_graphs(max_num_seqs, max_model_len)
        return True

    # -- the proposal --------------------------------------------------------------------------
    def __call__(self, requests) -> list[Proposal]:
        self.calls += 1
        self.cache.drop_finished()
        out = [NO_PROPOSAL] * len(requests)
        keep = {id(seq) for seq, _ in requests}
        work = []  # (index in requests, seq, entry, k, first new position)
        for i, (seq, max_tokens) in enumerate(requests):
            tokens = seq.token_ids
            k = min(self.k, max_tokens, self.max_positions + 1 - len(tokens))  # it feeds up to len + k - 2
            if k < 1 or not may_speculate(seq.params):
                continue
            entry = self.cache.entry(seq, self.calls)
            valid = entry.valid_prefix(tokens, len(tokens) - 1)  # the last token is always fed
            if self.cache.reserve(entry, len(tokens) + k - 1, keep):
                work.append((i, seq, entry, k, valid))
        if not work:
            return out
        drafts = self._run(work)
        for (i, seq, entry, k, _), (ids, probs) in zip(work, drafts):
            entry.tokens = seq.token_ids + ids[:-1]  # what the draft's KV now holds (a new list)
            out[i] = Proposal(ids, probs)
        return out

    def _run(self, work) -> list[tuple[list[int], torch.Tensor | None]]:
        """k forwards of the draft over ``work``; per sequence its draft ids and, for sampled
        requests, their distributions (fp32 ``[k, vocab]``)."""
        ids_, pos, slots, q_lens, ctx, tables = [], [], [], [], [], []
        for _, seq, entry, _, valid in work:  # 1. catch up: every token the draft has not seen
            n = len(seq.token_ids)
            ids_.extend(seq.token_ids[valid:])
            pos.extend(range(valid, n))
            slots.extend(self.cache.slots(entry, valid, n))
            q_lens.append(n - valid)
            ctx.append(n)
            tables.append(entry.blocks)
        rows = [r - 1 for r in _cumsum(q_lens)]
        sampled = [seq.params.temperature > 0 for _, seq, *_ in work]
        gens = [draft_generator(seq, self.base_seed, self.device) if s else None
                for (_, seq, *_), s in zip(work, sampled)]
        batch = self._sampling_batch([seq.params for _, seq, *_ in work], gens) if any(sampled) else None
        results = [([], []) for _ in work]
        active = list(range(len(work)))
        step = 0
        while True:
            logits = self.runner.logits_at(ids_, pos, slots, q_lens, ctx, tables, rows)
            tokens = self._draw(logits, active, sampled, batch, gens, results)
            step += 1
            active = [j for j in active if work[j][3] > step]
            if not active:
                break
            # 2. one more token each: feed the draft just drawn
            ids_ = [tokens[j] for j in active]
            pos, slots, q_lens, ctx, tables = [], [], [], [], []
            for j in active:
                _, seq, entry, _, _ = work[j]
                p = len(seq.token_ids) - 1 + step
                pos.append(p)
                slots.extend(self.cache.slots(entry, p, p + 1))
                q_lens.append(1)
                ctx.append(p + 1)
                tables.append(entry.blocks)
            rows = list(range(len(active)))
        return [(ids, torch.stack(qs) if s else None) for (ids, qs), s in zip(results, sampled)]

    def _draw(self, logits: torch.Tensor, active: list[int], sampled: list[bool], batch, gens,
              results) -> dict[int, int]:
        """Each active sequence's next draft from its row of ``logits``: the argmax, or a draw
        from the filtered distribution (kept in ``results`` with the token)."""
        out = {}
        greedy_rows = [r for r, j in enumerate(active) if not sampled[j]]
        if greedy_rows:
            top = argmax_rows(logits[greedy_rows]).tolist()
            for r, t in zip(greedy_rows, top):
                out[active[r]] = t
        sample_rows = [r for r, j in enumerate(active) if sampled[j]]
        if sample_rows:
            which = [active[r] for r in sample_rows]
            probs = filtered_probs(logits[sample_rows], batch.select(which))
            drawn = exponential_race(probs, [gens[j] for j in which], None).tolist()
            for r, (j, t) in enumerate(zip(which, drawn)):
                out[j] = t
                results[j][1].append(probs[r])
        for j, t in out.items():
            results[j][0].append(t)
        return out

    def _sampling_batch(self, params, gens) -> "_Rows":
        return _Rows(params, gens, self.device)

    # -- bookkeeping -------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` if the draft's KV pool bookkeeping is inconsistent."""
        self.cache.check_invariants()

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.shutdown()
            self.runner = None
        self.cache.entries.clear()


class _Rows:
    """Per-sequence sampling settings of one proposal, selectable by sequence index."""

    def __init__(self, params, gens, device):
        self.params, self.gens, self.device = params, gens, device

    def select(self, which: list[int]) -> SamplingBatch:
        ps = [self.params[j] for j in which]
        f32 = lambda xs: torch.tensor(xs, dtype=torch.float32, device=self.device)  # noqa: E731
        top_k = [max(p.top_k, 0) for p in ps]
        return SamplingBatch(
            temperatures=f32([p.temperature for p in ps]), top_k=torch.tensor(top_k, device=self.device),
            top_p=f32([p.top_p for p in ps]), min_p=f32([p.min_p for p in ps]),
            repetition_penalties=f32([1.0] * len(ps)), seen_token_ids=[None] * len(ps),
            generators=[self.gens[j] for j in which], all_greedy=False, any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p.top_p < 1 for p in ps), any_min_p=any(p.min_p > 0 for p in ps), any_penalty=False)


def _cumsum(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out
