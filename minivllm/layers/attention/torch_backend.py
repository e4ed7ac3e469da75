"""The reference attention backend: paged KV gathered through the block table, then SDPA.

Plain PyTorch, any device and dtype (plus a C decode kernel on the CPU, see the end). Every other
backend is tested against this one.

Per step (:meth:`TorchAttentionBackend.prepare`, once, shared by all layers) the batch is
split into two groups, decodes (one query token) and prefills (several query tokens: later
chunks of a prompt, prompts after a prefix-cache hit), so one long prefill does not pad
hundreds of decodes to its length. A fresh prompt (or a prompt's first chunk: its whole
context is this step's tokens) is in neither group: each attends causally over its own new
K/V in one SDPA call (``is_causal``, no gather, no padding, no mask), or on the CPU in fp32 all
of the step's fresh prompts in one call of our C causal kernel. For each group of ``G``
sequences it builds

* ``block_ids [G * nb]``: the physical blocks of each sequence's block table (``nb`` =
  blocks of the longest context; padding entries read block 0), so key ``j`` of sequence
  ``b`` is row ``j`` of its gathered ``[nb * block_size]`` keys;
* ``q_src [n]`` / ``q_dst [n]``: where the group's ``n`` query tokens are in the step's
  token dimension and where they go in the padded ``[G * max_q]`` layout;
* ``mask [G, 1, max_q, max_k]`` (bool, True = attend; ``max_k = nb * block_size``): query ``i`` of sequence ``b`` sits
  at absolute position ``context_lens[b] - q_lens[b] + i`` and sees keys ``j <= `` that
  position (causal over the cached prefix plus the new tokens). Padded query rows are
  allowed key 0 only, so no row is ever fully masked (a fully masked row gives NaN).

For the decode group the plan holds an additive ``bias [G, 1, max_k]`` (0 = attend,
``-inf`` = past the sequence's length), built once per step, instead of the boolean mask.

Each layer then writes the new K/V at ``slot_mapping`` (slot -1 writes nothing) and gathers
``K, V [G, max_k, kv_heads, d]`` through ``block_ids``. Prefill groups pad
``Q [G, heads, max_q, d]``, call ``torch.nn.functional.scaled_dot_product_attention`` with the
causal mask (grouped-query heads through ``enable_gqa``) and scatter the real rows back.
Decode groups view the query heads that share a KV head as the query rows of one SDPA
problem (``q [G, kv_heads, heads / kv_heads, d]``), so K/V are not expanded per query head
(``enable_gqa`` would), with the step's additive bias. Measured against the previous
``enable_gqa`` + boolean-mask call and against per-KV-head ``baddbmm``/softmax/``bmm``
(batch 1-32 decodes, 180-260 keys, 16-token blocks, one thread, loaded 2-core EPYC): this was
the fastest or tied at every size, up to 2x faster at batch 32; the matmul version was slower
than both at batch <= 8. Gathered K/V land in one buffer reused by every layer and step.
Low-precision inputs are upcast so the softmax runs in fp32; the output is cast back to
``q.dtype``.

On the CPU in fp32 (the cache fp32 or bf16), groups whose queries are short (decode; draft verification, up to
``cpu_decode.MAX_QUERY_LEN`` tokens) skip the gather and the SDPA call: our C kernel
(``cpu_decode``, built at first use) reads each sequence's K/V in place through the block
table, one row per query token, which the plan hands it as int32 tables, row-to-sequence
indices and visible lengths, checked once per step; fresh prompts go through the same library's
causal kernel. It is the fast path, not the reference: ``TorchAttentionBackend(native_decode=False)``
(or ``MINIVLLM_CPU_DECODE_KERNEL=0``) keeps every step on the SDPA paths above, and the tests run
both against a naive loop.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from minivllm.layers.attention import cpu_decode
from minivllm.layers.attention.backend import AttentionBackend
from minivllm.layers.attention.metadata import AttentionMetadata
from minivllm.layers.cpu_graph import NotCapturable
from minivllm.utils import cdiv

_EXTRAS_KEY = "torch_backend_plan"


@dataclass
class _GroupPlan:
    """Gather/scatter indices for one group of sequences (see module docstring)."""

    num_seqs: int
    max_q: int
    max_k: int
    q_src: torch.Tensor  # int64 [n]: token index in the step
    q_dst: torch.Tensor | None  # int64 [n]: row in the padded [G * max_q] layout
    block_ids: torch.Tensor | None  # int64 [G * nb]: physical blocks to gather, row-major (padding: block 0)
    mask: torch.Tensor | None  # bool [G, 1, max_q, max_k] with max_k = nb * block_size (prefill groups)
    bias: torch.Tensor | None  # fp32 [G, 1, max_k]: 0 attend, -inf past the length (decode groups)
    # For the native kernel (cpu_decode), groups with short queries only: int32 tables [G, width],
    # each query token's table row and visible keys [n] (row_seq, row_lens; token order = q_src),
    # and the largest block id they reach (checked against the cache per layer: an int compare).
    # Such a plan has no gather fields: ``reference`` is the group's gather + SDPA plan, built
    # only if a layer hands the backend tensors the kernel does not take (not float32).
    tables32: torch.Tensor | None = None
    row_seq: torch.Tensor | None = None
    row_lens: torch.Tensor | None = None
    max_block_id: int = -1
    seq_ids: list[int] | None = None
    reference: "_GroupPlan | None" = None


@dataclass
class _StepPlan:
    slots: torch.Tensor | None  # int64 [T]: each token's cache slot, -1 for none (None: a CPU graph's plan)
    groups: list[_GroupPlan]
    # Fast paths (same results, less copying), decided once per step:
    # every token is a decode of its own sequence, in order: no query scatter/gather
    all_decode: bool = False
    # a single sequence whose whole context is this step's tokens (a fresh prompt):
    # attend over the new K/V directly with a causal mask, no cache gather
    single_fresh_prefill: bool = False
    # (start, length) in the step's tokens of each other fresh prompt (or first chunk) of several
    # tokens: attended one by one, causally over its own new K/V (no gather, no padding, no mask)
    fresh: list[tuple[int, int]] | None = None
    _writes: tuple[torch.Tensor, torch.Tensor] | None = None

    def writes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens whose slot is not -1, their slots)``, int64, for the ``index_copy_`` write
        (made at the first layer that needs them: a float32 CPU step writes through the C call,
        which skips -1 itself, and never does; a host sync on a GPU)."""
        if self._writes is None:
            tokens = torch.nonzero(self.slots >= 0).flatten()
            self._writes = (tokens, self.slots[tokens])
        return self._writes


def _plan_group(meta: AttentionMetadata, seq_ids: list[int], device: torch.device) -> _GroupPlan:
    q_lens_l = [meta.q_lens_cpu[i] for i in seq_ids]
    k_lens_l = [meta.context_lens_cpu[i] for i in seq_ids]
    g, max_q, max_k = len(seq_ids), max(q_lens_l), max(k_lens_l)
    seq_t = torch.tensor(seq_ids, dtype=torch.int64, device=device)
    q_lens = torch.tensor(q_lens_l, dtype=torch.int64, device=device)
    k_lens = torch.tensor(k_lens_l, dtype=torch.int64, device=device)
    q_starts = meta.cu_seqlens_q.to(device=device, dtype=torch.int64)[seq_t]  # [G]

    # Query scatter: row i of sequence b is token q_starts[b] + i, padded row b * max_q + i.
    i = torch.arange(max_q, device=device)
    q_valid = i[None, :] < q_lens[:, None]  # [G, max_q]
    q_src = (q_starts[:, None] + i[None, :])[q_valid]
    q_dst = (torch.arange(g, device=device)[:, None] * max_q + i[None, :])[q_valid]

    # Key gather through the block table, whole blocks at a time (contiguous copies are far
    # cheaper than a per-slot gather); keys past a sequence's length are masked out below.
    bs = meta.block_size
    n_blk_cols = cdiv(max_k, bs)
    max_k = n_blk_cols * bs
    j = torch.arange(max_k, device=device)
    k_valid = j[None, :] < k_lens[:, None]  # [G, max_k]
    tables = meta.block_tables.to(device=device, dtype=torch.int64)[seq_t][:, :n_blk_cols]  # [G, nb]
    block_ids = tables.clamp(min=0).flatten()

    if max_q == 1:  # decode: key j is visible iff j < k_len (the query is the last position)
        bias = torch.zeros(g, 1, max_k, device=device).masked_fill_(~k_valid[:, None, :], float("-inf"))
        gp = _GroupPlan(g, max_q, max_k, q_src, q_dst, block_ids, None, bias)
    else:  # causal mask over absolute positions
        q_pos = (k_lens - q_lens)[:, None] + i[None, :]  # [G, max_q]
        mask = (j[None, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]
        mask[:, :, 0] |= ~q_valid  # padded query rows see key 0: never a fully masked row
        gp = _GroupPlan(g, max_q, max_k, q_src, q_dst, block_ids, mask.unsqueeze(1), None)
    return gp


def _plan_native(meta: AttentionMetadata, seq_ids: list[int]) -> _GroupPlan:
    """The native kernel's view of a short-query group on the CPU: one row per query token,
    seeing the keys up to its own position. Host-side numpy (a few microseconds per array, where
    the same in torch ops cost ~0.2 ms per step at batch 1). Refuses a table too narrow for a
    context or with -1 where a sequence has tokens (the kernel would read outside the cache)."""
    bs = meta.block_size
    q_lens = np.array([meta.q_lens_cpu[i] for i in seq_ids], dtype=np.int64)
    k_lens = np.array([meta.context_lens_cpu[i] for i in seq_ids], dtype=np.int64)
    tables = meta.block_tables.to(torch.int32).numpy()
    if len(seq_ids) != meta.num_seqs:
        tables = tables[seq_ids]
    max_k = int(k_lens.max())
    if tables.shape[1] * bs < max_k:  # the kernel would read past a table row
        raise RuntimeError(f"attention plan: block tables have {tables.shape[1]} columns of {bs} "
                           f"tokens, too few for a context of {max_k} tokens")
    used = tables[np.arange(tables.shape[1])[None, :] < ((k_lens + bs - 1) // bs)[:, None]]
    if used.size and int(used.min()) < 0:
        raise RuntimeError(f"attention plan: a block table has -1 within its sequence's {k_lens.tolist()} "
                           f"tokens (block manager state is corrupt)")
    starts = np.cumsum([0] + meta.q_lens_cpu)[seq_ids]  # each sequence's first token in the step
    g, max_q = len(seq_ids), int(q_lens.max())
    if max_q == 1:
        q_src, row_seq, row_lens = starts, np.arange(g), k_lens
    else:  # token i of n in a sequence of context k sees k - n + 1 + i keys
        q_src = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, q_lens)])
        row_seq = np.repeat(np.arange(g), q_lens)
        row_lens = np.concatenate([np.arange(k - n + 1, k + 1) for n, k in zip(q_lens, k_lens)])
    return _GroupPlan(g, max_q, max_k, torch.from_numpy(q_src.astype(np.int64)), None, None, None, None,
                      tables32=torch.from_numpy(np.ascontiguousarray(tables)),
                      row_seq=torch.from_numpy(row_seq.astype(np.int32)),
                      row_lens=torch.from_numpy(row_lens.astype(np.int32)),
                      max_block_id=int(used.max()) if used.size else -1, seq_ids=list(seq_ids))


def _causal_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           compute_dtype: torch.dtype, gqa: bool) -> torch.Tensor:
    """One fresh sequence's tokens over themselves: ``q [n, heads, d]``, ``k, v [n, kv_heads, d]``
    -> ``[n, heads, d]`` in ``q``'s dtype, causal (token i sees tokens 0..i)."""
    o = F.scaled_dot_product_attention(
        q.to(compute_dtype).transpose(0, 1).unsqueeze(0), k.to(compute_dtype).transpose(0, 1).unsqueeze(0),
        v.to(compute_dtype).transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1).to(q.dtype)


def _decode_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, gp: _GroupPlan,
                      scale: float, compute_dtype: torch.dtype) -> torch.Tensor:
    """One query token per sequence: ``q [G, heads, d]``, gathered ``keys, vals [G, max_k,
    kv_heads, d]`` -> ``[G, heads, d]`` in ``compute_dtype``.

    The ``heads / kv_heads`` query heads that share a KV head are the query rows of one SDPA
    problem per (sequence, KV head), so K/V are never expanded per query head; keys past a
    sequence's length get ``-inf`` from the step's ``gp.bias``.
    """
    g, num_heads = gp.num_seqs, q.shape[1]
    kv_heads, head_dim = keys.shape[2], keys.shape[3]
    q_rows = q.to(compute_dtype).view(g, kv_heads, num_heads // kv_heads, head_dim)
    o = F.scaled_dot_product_attention(q_rows, keys.to(compute_dtype).transpose(1, 2),
                                       vals.to(compute_dtype).transpose(1, 2),
                                       attn_mask=gp.bias.to(compute_dtype).unsqueeze(1), scale=scale)
    return o.reshape(g, num_heads, head_dim)


class TorchAttentionBackend(AttentionBackend):
    """Reference paged attention in plain PyTorch (see module docstring)."""

    name = "torch"
    # supports_cuda_graphs stays False: prepare() reads host-side lengths and syncs once per step

    def __init__(self, native_decode: bool | None = None):
        """``native_decode``: run fp32 CPU decode groups (and fresh prompts' causal attention)
        through our C kernels (``cpu_decode``: K/V read in place, no gather, no mask). ``None``
        (default): when they build on this machine; ``False``: never (the SDPA reference paths);
        ``True``: required.

        Raises:
            RuntimeError: ``native_decode=True`` and the kernel cannot be built or loaded.
        """
        self._kernel = None
        if native_decode is not False:
            self._kernel = cpu_decode.load()
            if self._kernel is None and native_decode:
                raise RuntimeError(f"native_decode=True but the CPU decode kernel is unavailable: "
                                   f"{cpu_decode.unavailable_reason()}")
        # Gathered K/V land in one grow-only buffer reused by every layer and step: a fresh
        # multi-MB allocation per layer costs page faults that, on a CPU, took longer than
        # the gather itself (1.09 vs 0.23 ms median for 4.4 MB on the loaded 2-core EPYC
        # development machine, 2026-12-01; no script kept).
        self._gather_buf: torch.Tensor | None = None

    @property
    def native_kernels(self) -> bool:
        """Whether our C kernels (``cpu_decode``) serve this backend's CPU decode groups and fresh
        prompts' causal attention (else the SDPA reference paths do)."""
        return self._kernel is not None

    def _gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, gp: _GroupPlan):
        """``K, V [G, max_k, kv_heads, d]`` (cache dtype): the group's blocks, in table order,
        as views of the reused buffer (valid until the next call)."""
        n = gp.block_ids.numel()
        per = n * k_cache[0].numel()
        buf = self._gather_buf
        if buf is None or buf.numel() < 2 * per or buf.dtype != k_cache.dtype or buf.device != k_cache.device:
            buf = self._gather_buf = torch.empty(2 * per, dtype=k_cache.dtype, device=k_cache.device)
        shape = (n,) + tuple(k_cache.shape[1:])
        kg = torch.index_select(k_cache, 0, gp.block_ids, out=buf[:per].view(shape))
        vg = torch.index_select(v_cache, 0, gp.block_ids, out=buf[per:2 * per].view(shape))
        view = (gp.num_seqs, gp.max_k) + tuple(k_cache.shape[2:])
        return kg.view(view), vg.view(view)

    def _native(self, q, k_cache, v_cache, gp: _GroupPlan, scale: float) -> torch.Tensor | None:
        """The group's attention through the native kernel, ``q [n, heads, d]`` (the group's
        query tokens in ``q_src`` order) -> ``[n, heads, d]``; ``None`` when the plan has no
        kernel view of it, ``q`` is not fp32 or the caches hold a dtype the kernel does not read
        (``cpu_decode.KV_DTYPES``: fp32, bf16)."""
        if (gp.tables32 is None or q.dtype != torch.float32 or k_cache.dtype not in cpu_decode.KV_DTYPES
                or v_cache.dtype != k_cache.dtype):
            return None
        if gp.max_block_id >= k_cache.shape[0]:
            raise RuntimeError(f"attention plan: block id {gp.max_block_id} is outside the KV cache's "
                               f"{k_cache.shape[0]} blocks")
        return self._kernel(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), gp.tables32, gp.row_seq,
                            gp.row_lens, gp.max_k, scale)

    @staticmethod
    def _reference(meta: AttentionMetadata, gp: _GroupPlan) -> _GroupPlan:
        """``gp`` itself, or for a group planned for the kernel its gather + SDPA plan (built
        at its first use in the step, then kept on ``gp``)."""
        if gp.seq_ids is None:
            return gp
        if gp.reference is None:
            gp.reference = _plan_group(meta, gp.seq_ids, meta.slot_mapping.device)
        return gp.reference

    def prepare(self, meta: AttentionMetadata) -> None:
        """Build the step plan once and store it in ``meta.extras`` (called lazily by
        :meth:`forward` if the model runner did not call it)."""
        device = meta.slot_mapping.device
        slots = meta.slot_mapping.to(torch.int64)
        decode_ids = [s for s, n in enumerate(meta.q_lens_cpu) if n == 1]
        # A prefill whose context is all new tokens attends over its own K/V (is_causal, no gather):
        # one padded SDPA with a mask over a step of 32 prompts of 17-236 tokens did several times
        # the causal work (torch.profiler, embedded model, one thread: SDPA 176 -> 60 ms of the
        # step's self time; the step's wall time moved within the machine's noise, 0.75-0.96 s)
        fresh, prefill_ids, start = [], [], 0  # (tokens lie in sequence order: cu_seqlens_q)
        for s, (n, ctx) in enumerate(zip(meta.q_lens_cpu, meta.context_lens_cpu)):
            if n > 1 and n == ctx:
                fresh.append((start, n))
            elif n > 1:
                prefill_ids.append(s)
            start += n
        native = self._kernel is not None and device.type == "cpu"
        groups = [_plan_native(meta, ids) if native and max(meta.q_lens_cpu[i] for i in ids) <= cpu_decode.MAX_QUERY_LEN
                  else _plan_group(meta, ids, device) for ids in (decode_ids, prefill_ids) if ids]
        num_tokens = meta.num_tokens
        all_decode = len(decode_ids) == meta.num_seqs == num_tokens
        single_fresh = (meta.num_seqs == 1 and meta.q_lens_cpu[0] == meta.context_lens_cpu[0] == num_tokens
                        and meta.q_lens_cpu[0] > 1)
        meta.extras[_EXTRAS_KEY] = _StepPlan(slots, groups, all_decode, single_fresh,
                                             None if single_fresh else fresh)

    @property
    def native_kernel(self) -> bool:
        """Whether short-query groups (decode) go through the C kernel (``cpu_decode``: K/V read in
        place through the block table) rather than gather + SDPA."""
        return self._kernel is not None

    @property
    def supports_cpu_graphs(self) -> bool:
        """Decode steps can be recorded in a CPU graph (``minivllm/layers/cpu_graph.py``): the
        native kernel is loaded, so a decode step's attention and KV write are C calls reading
        the step's static metadata."""
        return self._kernel is not None

    def prepare_cpu_graph(self, meta: AttentionMetadata) -> None:
        """The step plan of a CPU graph's decode step: ``meta``'s tensors are the graph's static
        buffers (``block_tables`` int32 ``[n, width]`` contiguous, ``context_lens`` int32 ``[n]``,
        ``slot_mapping`` int64 ``[n]``), read by the kernel at every replay; nothing here reads
        their values, so the plan serves every replay. Keys are bounded by ``meta.max_seqlen_k``
        (the table's width in tokens: it sizes the score scratch).

        Raises:
            NotCapturable: no native kernel, or metadata the kernel does not take as they are.
        """
        tables, lens = meta.block_tables, meta.context_lens
        if (self._kernel is None or tables.dtype != torch.int32 or not tables.is_contiguous() or lens.dtype != torch.int32
                or meta.slot_mapping.device.type != "cpu" or not meta.is_decode_only):
            raise NotCapturable("CPU graph: decode attention needs the native kernel and int32 CPU metadata")
        n = meta.num_seqs
        gp = _GroupPlan(n, 1, meta.max_seqlen_k, None, None, None, None, None, tables32=tables,
                        row_seq=torch.arange(n, dtype=torch.int32), row_lens=lens)
        meta.extras[_EXTRAS_KEY] = _StepPlan(None, [gp], all_decode=True)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        plan: _StepPlan | None = meta.extras.get(_EXTRAS_KEY)
        if plan is None:
            self.prepare(meta)
            plan = meta.extras[_EXTRAS_KEY]
        num_blocks, block_size, kv_heads, head_dim = k_cache.shape
        k_flat = k_cache.view(num_blocks * block_size, kv_heads, head_dim)
        v_flat = v_cache.view(num_blocks * block_size, kv_heads, head_dim)
        # fp32 K/V on the CPU into an fp32 or bf16 cache: one C call writes every token's (slot -1 skipped)
        if self._kernel is None or not self._kernel.store_kv(k, v, k_cache, v_cache, meta.slot_mapping):
            if plan.slots is None:
                raise NotCapturable(f"CPU graph: the KV cache write takes fp32 CPU tensors and an fp32 or bf16 "
                                    f"cache, got {k.dtype} on {k.device} into {k_cache.dtype}")
            write_tokens, write_slots = plan.writes()  # one host sync per step (not per layer)
            if write_tokens.numel() == k.shape[0]:  # no padding tokens: every row is written
                k_new, v_new = k, v
            else:
                k_new, v_new = k[write_tokens], v[write_tokens]
            k_flat.index_copy_(0, write_slots, k_new.to(k_cache.dtype))
            v_flat.index_copy_(0, write_slots, v_new.to(v_cache.dtype))

        num_heads = q.shape[1]
        compute_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        gqa = num_heads != kv_heads
        if k_cache.dtype != k.dtype and (plan.single_fresh_prefill or plan.fresh):
            # fresh prompts attend over their own K/V as the cache holds them (kv_cache_dtype), as the
            # same prompt does in chunks or after a prefix hit, where they are read back from the cache
            k, v = k.to(k_cache.dtype).to(k.dtype), v.to(v_cache.dtype).to(v.dtype)
        if plan.single_fresh_prefill:
            if self._kernel is not None and q.dtype == torch.float32 and q.is_cpu:
                out = torch.empty_like(q)
                if self._kernel.causal_self_attention(q, k, v, [(0, q.shape[0])], scale, out):
                    return out
            return _causal_self_attention(q, k, v, scale, compute_dtype, gqa)
        if plan.all_decode:
            gp = plan.groups[0]
            o = self._native(q, k_cache, v_cache, gp, scale)
            if o is None:
                gp = self._reference(meta, gp)
                o = _decode_attention(q, *self._gather(k_cache, v_cache, gp), gp, scale, compute_dtype)
            return o.to(q.dtype)
        # Tokens not in any sequence (padding) get zeros; a step of fresh prompts alone writes every row.
        fresh = plan.fresh or ()
        if not plan.groups and sum(n for _, n in fresh) == q.shape[0]:
            out = torch.empty(q.shape[0], num_heads, head_dim, dtype=q.dtype, device=q.device)
        else:
            out = torch.zeros(q.shape[0], num_heads, head_dim, dtype=q.dtype, device=q.device)
        if not (fresh and self._kernel is not None and self._kernel.causal_self_attention(q, k, v, fresh, scale, out)):
            for start, n in fresh:
                out[start:start + n] = _causal_self_attention(q[start:start + n], k[start:start + n],
                                                              v[start:start + n], scale, compute_dtype, gqa)
        for gp in plan.groups:  # at most two: decodes, prefills
            q_rows = q[gp.q_src]
            o = self._native(q_rows, k_cache, v_cache, gp, scale)
            if o is not None:
                out[gp.q_src] = o
                continue
            gp = self._reference(meta, gp)
            if gp.bias is not None:
                o = _decode_attention(q_rows, *self._gather(k_cache, v_cache, gp), gp, scale, compute_dtype)
                out[gp.q_src] = o.to(q.dtype)
                continue
            qp = q.new_zeros(gp.num_seqs * gp.max_q, num_heads, head_dim, dtype=compute_dtype)
            qp[gp.q_dst] = q_rows.to(compute_dtype)
            qp = qp.view(gp.num_seqs, gp.max_q, num_heads, head_dim).transpose(1, 2)
            kg, vg = (t.to(compute_dtype).transpose(1, 2) for t in self._gather(k_cache, v_cache, gp))
            o = F.scaled_dot_product_attention(qp, kg, vg, attn_mask=gp.mask, scale=scale, enable_gqa=gqa)
            o = o.transpose(1, 2).reshape(gp.num_seqs * gp.max_q, num_heads, head_dim)
            out[gp.q_src] = o[gp.q_dst].to(q.dtype)
        return out
