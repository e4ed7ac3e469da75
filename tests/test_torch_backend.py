"""The vectorised torch backend against a naive per-sequence loop written here, with decode
groups through the gather + SDPA reference path and through the native CPU kernel
(``cpu_decode``)."""
from __future__ import annotations

import pytest
import torch

from helpers_models import allocate_block_tables, build_metadata
from helpers_native import native_or_skip
from minivllm.layers import native_parallel
from minivllm.layers.attention import cpu_decode
from minivllm.layers.attention.torch_backend import TorchAttentionBackend


@pytest.fixture(params=[False, True], ids=["sdpa_decode", "native_decode"])
def native(request):
    """Both decode paths; the native one is skipped (with the build error) where the kernel
    cannot be built."""
    if request.param:
        _kernel_or_skip()
    return request.param


def _kernel_or_skip():
    """The kernel, or a skip (a failure in CI) naming why it is missing."""
    return native_or_skip(cpu_decode, "CPU decode kernel")

MIXED = [(0, 7), (5, 1), (12, 6), (3, 1), (0, 1), (20, 1), (8, 9), (17, 1)]


def naive_attention(q, k, v, k_cache, v_cache, seqs, block_tables, block_size, slots, scale):
    """One sequence and one query at a time, softmax written out in fp32."""
    kf = k_cache.view(-1, *k_cache.shape[2:])
    vf = v_cache.view(-1, *v_cache.shape[2:])
    for t, s in enumerate(slots):
        if s >= 0:
            kf[s] = k[t]
            vf[s] = v[t]
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.zeros_like(q)
    tok = 0
    for (cached, new), table in zip(seqs, block_tables):
        ctx = cached + new
        key_slots = [table[j // block_size] * block_size + j % block_size for j in range(ctx)]
        keys = kf[key_slots].float().repeat_interleave(heads // kv_heads, dim=1)  # [ctx, h, d]
        vals = vf[key_slots].float().repeat_interleave(heads // kv_heads, dim=1)
        for i in range(new):
            pos = cached + i
            scores = torch.einsum("hd,khd->hk", q[tok + i].float(), keys[: pos + 1]) * scale
            probs = torch.softmax(scores, dim=-1)
            out[tok + i] = torch.einsum("hk,khd->hd", probs, vals[: pos + 1]).to(q.dtype)
        tok += new
    return out


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def run_case(seqs, block_size, dtype, heads=4, kv_heads=2, head_dim=16, num_pad=0, seed=0, device="cpu",
             native=False):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 64
    tables = allocate_block_tables([c + n for c, n in seqs], block_size, num_blocks, seed=seed)
    meta = build_metadata(seqs, block_size, tables, num_pad_tokens=num_pad)
    t = meta.num_tokens
    q = torch.randn(t, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    # Random "previously cached" K/V everywhere, so prefix hits read real data.
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    meta.extras["test_original_k_cache"] = k_cache.clone()
    scale = head_dim ** -0.5
    if device != "cpu":  # the naive reference runs on CPU on the same values
        dmeta = build_metadata(seqs, block_size, tables, device=device, num_pad_tokens=num_pad)
        kc, vc = k_cache.to(device), v_cache.to(device)
        out = TorchAttentionBackend(native).forward(q.to(device), k.to(device), v.to(device), kc, vc, dmeta, scale)
        out, k_cache, v_cache = out.cpu(), kc.cpu(), vc.cpu()
    else:
        out = TorchAttentionBackend(native).forward(q, k, v, k_cache, v_cache, meta, scale)
    ref = naive_attention(q, k, v, k_ref, v_ref, seqs, tables, block_size, meta.slot_mapping.tolist(), scale)
    return out, ref, (k_cache, v_cache), (k_ref, v_ref), meta


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (4, 4)])
def test_mixed_batch_matches_naive(block_size, dtype, heads, kv_heads, device, native):
    out, ref, cache, cache_ref, _ = run_case(MIXED, block_size, dtype, heads, kv_heads, device=device, native=native)
    assert out.dtype == dtype and out.shape == ref.shape
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=0)
    assert torch.equal(cache[0], cache_ref[0]) and torch.equal(cache[1], cache_ref[1])


@pytest.mark.parametrize("seqs", [[(0, 1), (9, 1), (30, 1)], [(0, 13)], [(0, 5), (4, 3)], [(16, 16)]])
def test_single_kind_batches(seqs, native):
    out, ref, *_ = run_case(seqs, 4, torch.float32, native=native)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_slot_minus_one_writes_nothing(native):
    seqs = [(0, 5), (6, 1)]
    out, ref, cache, cache_ref, meta = run_case(seqs, 4, torch.float32, num_pad=3, native=native)
    # Only the 6 real tokens' slots changed; the padding tokens wrote nowhere.
    original = meta.extras["test_original_k_cache"]
    changed = (cache[0] != original).any(-1).any(-1).flatten().nonzero().flatten().tolist()
    assert sorted(changed) == sorted(meta.slot_mapping[:6].tolist())
    torch.testing.assert_close(out[:6], ref[:6], atol=1e-5, rtol=0)
    assert torch.equal(out[6:], torch.zeros_like(out[6:]))


def test_decodes_not_padded_to_prefill_length(native):
    backend = TorchAttentionBackend(native)
    seqs = [(5, 40)] + [(i, 1) for i in range(3, 20)]  # a prefill after a 5-token cached prefix
    tables = allocate_block_tables([c + n for c, n in seqs], 16, 64)
    meta = build_metadata(seqs, 16, tables)
    backend.prepare(meta)
    plan = meta.extras["torch_backend_plan"]
    shapes = sorted((g.num_seqs, g.max_q) for g in plan.groups)
    assert shapes == [(1, 40), (17, 1)] and not plan.fresh


def test_fresh_prompts_attend_one_by_one_without_a_group(native):
    """Prompts with no cached prefix are neither padded nor gathered: each attends causally over
    its own tokens (a step of 32 fresh prompts spent half its time in one padded, masked SDPA)."""
    seqs = [(0, 40), (0, 7), (3, 9)] + [(i, 1) for i in range(3, 6)]
    tables = allocate_block_tables([c + n for c, n in seqs], 16, 64)
    meta = build_metadata(seqs, 16, tables)
    TorchAttentionBackend(native).prepare(meta)
    plan = meta.extras["torch_backend_plan"]
    assert plan.fresh == [(0, 40), (40, 7)]  # (start, length) in the step's tokens
    assert sorted((g.num_seqs, g.max_q) for g in plan.groups) == [(1, 9), (3, 1)]


def test_prepare_is_computed_once_per_step():
    seqs = [(0, 4), (2, 1)]
    tables = allocate_block_tables([4, 3], 4, 8)
    meta = build_metadata(seqs, 4, tables)
    backend = TorchAttentionBackend()
    q = torch.randn(5, 2, 8)
    k = torch.randn(5, 1, 8)
    kc, vc = torch.zeros(8, 4, 1, 8), torch.zeros(8, 4, 1, 8)
    backend.forward(q, k, k, kc, vc, meta, 1.0)
    plan = meta.extras["torch_backend_plan"]
    backend.forward(q, k, k, kc, vc, meta, 1.0)
    assert meta.extras["torch_backend_plan"] is plan


@pytest.mark.parametrize("seqs,flag", [([(0, 1), (9, 1), (30, 1)], "all_decode"), ([(0, 13)], "single_fresh_prefill")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fast_paths_are_taken_and_match_naive(seqs, flag, dtype, native):
    out, ref, _, _, meta = run_case(seqs, 4, dtype, 8, 2, native=native)
    assert getattr(meta.extras["torch_backend_plan"], flag)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (4, 4)])
def test_layers_sharing_the_gather_buffer_each_match_naive(block_size, heads, kv_heads, native):
    """One backend, one step, two layers with different caches (the gathered K/V buffer is
    reused between them): each layer's output matches the naive loop, and the decode group
    attends through its additive bias, not a mask (on the kernel's path: builds no gather plan)."""
    seqs = MIXED
    gen = torch.Generator().manual_seed(3)
    tables = allocate_block_tables([c + n for c, n in seqs], block_size, 64, seed=3)
    meta = build_metadata(seqs, block_size, tables)
    backend = TorchAttentionBackend(native)
    t, d = meta.num_tokens, 16
    outs, refs = [], []
    for _layer in range(2):
        q = torch.randn(t, heads, d, generator=gen)
        k, v = torch.randn(t, kv_heads, d, generator=gen), torch.randn(t, kv_heads, d, generator=gen)
        kc = torch.randn(64, block_size, kv_heads, d, generator=gen)
        vc = torch.randn(64, block_size, kv_heads, d, generator=gen)
        refs.append(naive_attention(q, k, v, kc.clone(), vc.clone(), seqs, tables, block_size,
                                    meta.slot_mapping.tolist(), d ** -0.5))
        outs.append(backend.forward(q, k, v, kc, vc, meta, d ** -0.5))
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    decode = [g for g in meta.extras["torch_backend_plan"].groups if g.max_q == 1]
    assert len(decode) == 1 and decode[0].mask is None
    if native:  # the kernel's plan: its gather + SDPA plan is never built for float32 layers
        assert decode[0].tables32 is not None and decode[0].bias is None and decode[0].reference is None
    else:
        assert decode[0].bias is not None


# --- the native decode kernel itself -------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16, 256])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    # with AVX-512 (16 floats a vector): tiles of 16 dots, head_dim and GQA ratio compiled as constants
    (8, 1, 64), (4, 4, 128), (16, 8, 64), (8, 2, 128),
    # ... read at run time (head_dim 16; one key per tile; three vectors a chunk); with AVX2 (8 floats), the
    # first and last tiled at run time, (16, 1, 64), (4, 4, 128) and (8, 2, 128) on the generic loops
    (4, 2, 16), (16, 1, 64), (8, 2, 48),
    # the generic loops on both: head_dim not a multiple of the vector; 3 query heads per KV head; 256
    (6, 3, 40), (12, 4, 32), (4, 2, 256)])
def test_native_decode_matches_naive_for_every_block_size_and_gqa_ratio(block_size, heads, kv_heads, head_dim):
    """Decode-only steps (lengths from 1 token to several blocks, scattered blocks) through
    the backend's native path, against the naive loop, for each of the kernel's code paths."""
    _kernel_or_skip()
    seqs = [(0, 1), (block_size - 1, 1), (block_size, 1), (3 * block_size + 2, 1), (37, 1)]
    out, ref, cache, cache_ref, meta = run_case(seqs, block_size, torch.float32, heads, kv_heads, head_dim,
                                                native=True)
    assert meta.extras["torch_backend_plan"].groups[0].tables32 is not None  # the kernel's plan was built
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert torch.equal(cache[0], cache_ref[0]) and torch.equal(cache[1], cache_ref[1])


@pytest.mark.parametrize("block_size", [2, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (4, 4)])
def test_native_short_queries_match_naive(block_size, heads, kv_heads):
    """Draft verification: several sequences each with a few new tokens after a cached context
    (one mixed with a decode) go through the kernel one row per token, causally; a query
    longer than MAX_QUERY_LEN stays on gather + SDPA."""
    _kernel_or_skip()
    seqs = [(20, 5), (3, 5), (40, 2), (0, 4), (9, 1)]
    out, ref, *_, meta = run_case(seqs, block_size, torch.float32, heads, kv_heads, native=True)
    groups = meta.extras["torch_backend_plan"].groups
    assert all(g.tables32 is not None for g in groups) and {g.max_q for g in groups} == {1, 5}
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    long_q = cpu_decode.MAX_QUERY_LEN + 1
    out, ref, *_, meta = run_case([(7, long_q), (30, 1)], block_size, torch.float32, heads, kv_heads, native=True)
    by_q = {g.max_q: g for g in meta.extras["torch_backend_plan"].groups}
    assert by_q[long_q].tables32 is None and by_q[1].tables32 is not None
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (8, 1, 64), (4, 4, 128), (16, 8, 64), (6, 3, 40)])
def test_native_fresh_prompts_match_naive(heads, kv_heads, head_dim, monkeypatch):
    """Fresh prompts (lengths across the kernel's 8-key tiles, its tiles of 8 / (heads per KV head)
    rows and its 256-score exp chunks), alone, one alone, and beside a cached-prefix chunk and
    decodes, through the kernel's causal path, against the naive loop. head_dim 40 takes the
    32-float pass and one 8-float tail."""
    kernel = _kernel_or_skip()
    calls = []
    real = type(kernel).causal_self_attention
    monkeypatch.setattr(type(kernel), "causal_self_attention",
                        lambda self, *a: calls.append(a[3]) or real(self, *a))
    for seqs in ([(0, 1), (0, 2), (0, 7), (0, 9), (0, 33), (0, 300)], [(0, 45)],
                 [(0, 12), (5, 20), (3, 1), (0, 8), (9, 1)]):
        calls.clear()
        out, ref, cache, cache_ref, _ = run_case(seqs, 16, torch.float32, heads, kv_heads, head_dim, native=True)
        assert calls, "the causal kernel was not called"
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
        assert torch.equal(cache[0], cache_ref[0]) and torch.equal(cache[1], cache_ref[1])


@pytest.mark.parametrize("kv_heads,lens", [(2, [300, 5, 77, 1, 260, 64]), (2, [700]), (4, [300, 5, 77, 1, 260, 64])],
                         ids=["prompts-split", "one-prompt-heads-split", "heads-split"])
def test_native_fresh_prompts_take_strided_values_and_split_over_threads(kv_heads, lens, monkeypatch):
    """v as a view of a fused QKV output (row stride wider than its heads); 4 threads (splitting
    the prompts, or the KV heads: one long prompt, or as many KV heads as threads) give each
    prompt the bits one thread gives; rows outside every span are left alone; spans outside the
    step or overlapping raise; no span writes nothing; a head_dim the kernel does not take
    returns False."""
    kernel = _kernel_or_skip()
    gen = torch.Generator().manual_seed(3)
    heads, d = 8, 32
    t = sum(lens) + 3  # three trailing rows in no span
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen)
    q = qkv[:, : heads * d].reshape(t, heads, d).contiguous()
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
    spans, start = [], 0
    for n in lens:
        spans.append((start, n))
        start += n
    outs, split = {}, []
    real_run_chunks = cpu_decode.run_chunks
    monkeypatch.setattr(cpu_decode, "run_chunks", lambda run, n: split.append(n) or real_run_chunks(run, n))
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 4):
            torch.set_num_threads(n_threads)
            outs[n_threads] = torch.full((t, heads, d), 7.0)
            assert kernel.causal_self_attention(q, k, v, spans, d ** -0.5, outs[n_threads])
    finally:
        torch.set_num_threads(threads)
    assert split == [1, 4 if len(lens) > 1 else kv_heads]  # chunks: one per thread, or one per KV head
    assert torch.equal(outs[1], outs[4])
    assert torch.equal(outs[1][-3:], torch.full((3, heads, d), 7.0))
    for s0, n in spans:
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[s0:s0 + n].transpose(0, 1), k[s0:s0 + n].transpose(0, 1), v[s0:s0 + n].transpose(0, 1),
            is_causal=True, scale=d ** -0.5, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(outs[1][s0:s0 + n], ref, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"spans \[\(0, 5\), \(5, 2000\)\] do not lie in the step's"):
        kernel.causal_self_attention(q, k, v, [(0, 5), (5, 2000)], 1.0, outs[1])
    with pytest.raises(ValueError, match=r"spans \[\(4, 3\), \(0, 5\)\] do not lie .* without overlapping"):
        kernel.causal_self_attention(q, k, v, [(4, 3), (0, 5)], 1.0, outs[1])
    before = outs[1].clone()
    assert kernel.causal_self_attention(q, k, v, [], 1.0, outs[1]) and torch.equal(outs[1], before)
    odd = torch.randn(4, 2, 12)
    assert not kernel.causal_self_attention(odd, odd, odd, [(0, 4)], 1.0, torch.empty_like(odd))
    from minivllm.layers.cpu_graph import CpuGraph
    with CpuGraph().capture():  # graphs record decode steps only: a prompt's attention stays eager
        assert not kernel.causal_self_attention(q, k, v, spans, d ** -0.5, outs[1])


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 64), (16, 8, 128), (6, 2, 96)],
                         ids=["embedded", "qwen3-0.6b", "d96"])
def test_native_fresh_prompts_at_the_models_head_sizes(heads, kv_heads, d):
    """The causal kernel's wide paths (with AVX-512, 16-float score vectors and 64 output floats a pass
    over V; 96 = 64 + 32 takes both widths) against SDPA, for prompts of 1 to 300 tokens."""
    kernel = _kernel_or_skip()
    gen = torch.Generator().manual_seed(5)
    lens = [1, 17, 300, 16, 33]
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=gen) for h in (heads, kv_heads, kv_heads))
    spans, start = [], 0
    for n in lens:
        spans.append((start, n))
        start += n
    out = torch.empty(t, heads, d)
    assert kernel.causal_self_attention(q, k, v, spans, d ** -0.5, out)
    for s0, n in spans:
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[s0:s0 + n].transpose(0, 1), k[s0:s0 + n].transpose(0, 1), v[s0:s0 + n].transpose(0, 1),
            is_causal=True, scale=d ** -0.5, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[s0:s0 + n], ref, atol=1e-5, rtol=0)


def _kernel_args(seed, g, heads, kv_heads, d, bs, nblocks, len_range, width):
    """Random arguments for a direct kernel call: ``g`` decode rows with lengths in ``len_range``,
    each with ``width`` distinct random blocks of a pool of ``nblocks``."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(*len_range, (g,), generator=gen, dtype=torch.int32)
    tables = torch.randperm(nblocks, generator=gen)[: g * width].view(g, width).to(torch.int32).contiguous()
    return (torch.randn(g, heads, d, generator=gen), torch.randn(nblocks, bs, kv_heads, d, generator=gen),
            torch.randn(nblocks, bs, kv_heads, d, generator=gen), tables, torch.arange(g, dtype=torch.int32),
            lens, int(lens.max()), d ** -0.5)


def test_native_decode_split_over_threads_matches_one_thread():
    """With several torch threads the kernel splits sequences into chunks on a thread pool;
    the result is the same as one chunk."""
    kernel = _kernel_or_skip()
    args = _kernel_args(5, 40, 8, 2, 32, 4, 600, (1, 50), 13)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(*args)
        torch.set_num_threads(4)
        many = kernel(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_native_decode_splits_on_the_panel_gemm_threads(monkeypatch):
    """With several threads the rows split on the panel GEMM's C pool, not a Python thread pool
    (which woke a thread of its own for each layer's attention while the GEMM's polled on the same
    cores), eagerly and in a CPU graph's replays; without the GEMM library, the Python pool."""
    from minivllm.layers import cpu_gemm
    from minivllm.layers.cpu_graph import CpuGraph

    kernel = _kernel_or_skip()
    if cpu_gemm.load() is None:
        pytest.skip(f"panel GEMM unavailable: {cpu_gemm.unavailable_reason()}")
    args = list(_kernel_args(6, 33, 4, 2, 64, 16, 400, (1, 150), 10))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(*args)
        torch.set_num_threads(3)
        monkeypatch.setattr(cpu_decode, "run_chunks", lambda run, n: run(0) if n == 1 else pytest.fail(f"Python pool used ({n} chunks)"))
        assert torch.equal(kernel(*args), one)
        out, q = torch.empty_like(one), args[0]
        graph = CpuGraph()
        with graph.capture():
            kernel(*args, out=out)
        fresh = torch.randn_like(q)
        q.copy_(fresh)  # the replay reads the new query rows through the recorded structure
        out.zero_()
        graph.replay()
        torch.set_num_threads(1)
        assert torch.equal(out, kernel(*args))
        monkeypatch.undo()
        chunks = []
        monkeypatch.setattr(cpu_decode, "run_chunks", lambda run, n: chunks.append(n) or native_parallel.run_chunks(run, n))
        monkeypatch.setattr(cpu_gemm, "load", lambda: None)
        torch.set_num_threads(3)
        assert torch.equal(kernel(*args), out) and chunks == [3]
    finally:
        torch.set_num_threads(threads)


def test_native_decode_called_from_two_threads_at_once():
    """The kernel object is shared by every backend in the process and ctypes drops the GIL:
    two engines stepping in two threads must not share score scratch (each thread's results
    equal its own single-threaded run)."""
    import threading

    kernel = _kernel_or_skip()
    cases = []
    for seed in (1, 2):
        args = _kernel_args(seed, 40, 4, 2, 32, 4, 700, (20 * seed, 30 * seed), 16)
        cases.append((args, kernel(*args).clone()))
    failures = []

    def hammer(args, expected):
        torch.set_num_threads(2)  # 40 rows over 2 chunks: the shared pool is used from both threads
        for _ in range(200):
            if not torch.equal(kernel(*args), expected):
                failures.append(args[5].tolist())
                return

    threads = [threading.Thread(target=hammer, args=c) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_native_scratch_is_fp32_whatever_the_default_dtype():
    """Model building sets torch's default dtype; the score scratch the C code writes as floats
    must stay 4-byte floats (a bf16 buffer is half the bytes the kernel writes)."""
    import threading

    kernel = _kernel_or_skip()
    seen = []

    def in_fresh_thread():  # a fresh thread allocates its own scratch
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            seen.append(kernel._scratch(1000))
        finally:
            torch.set_default_dtype(previous)

    t = threading.Thread(target=in_fresh_thread)
    t.start()
    t.join()
    assert seen[0].dtype == torch.float32 and seen[0].device.type == "cpu" and seen[0].numel() >= 1000


def test_an_interrupt_while_workers_run_waits_for_them(monkeypatch):
    """Ctrl-C while the calling thread waits for the pool: the KeyboardInterrupt is raised only
    after every worker finished (they write into the caller's scratch, which its next call reuses)."""
    from minivllm.layers import cpu_gemm

    kernel = _kernel_or_skip()
    monkeypatch.setattr(cpu_gemm, "load", lambda: None)  # the Python pool's split (the C pool's cannot be interrupted)
    args = _kernel_args(9, 32, 4, 2, 32, 4, 500, (10, 60), 15)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        expected = kernel(*args)
        real_wait, calls = native_parallel.wait, []

        def interrupted_wait(futures):
            calls.append(list(futures))
            if len(calls) == 1:
                raise KeyboardInterrupt
            return real_wait(futures)

        monkeypatch.setattr(native_parallel, "wait", interrupted_wait)  # where run_chunks waits
        out = torch.zeros_like(expected)
        with pytest.raises(KeyboardInterrupt):
            kernel(*args, out=out)
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 2 and all(f.done() for f in calls[0])  # waited again after the interrupt
    assert torch.equal(out, expected)  # every chunk was written before the interrupt left


def _paged_reference(q, k_cache, v_cache, tables, rows, lens, scale):
    """Each row's attention over its paged keys, in float64 (torch's softmax), and the largest score."""
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out, top = torch.empty(q.shape, dtype=torch.float64), -float("inf")
    for r, (s, n) in enumerate(zip(rows.tolist(), lens.tolist())):
        slots = torch.tensor([int(tables[s, j // bs]) * bs + j % bs for j in range(n)])
        keys = k_cache.reshape(-1, kv_heads, k_cache.shape[3])[slots].double()
        vals = v_cache.reshape(-1, kv_heads, v_cache.shape[3])[slots].double()
        rep = q.shape[1] // kv_heads
        scores = torch.einsum("hd,khd->hk", q[r].double(), keys.repeat_interleave(rep, 1)) * scale
        out[r] = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), vals.repeat_interleave(rep, 1))
        top = max(top, float(scores.max()))
    return out, top


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (8, 1, 64), (6, 3, 40)])
def test_native_decode_extreme_scores_and_a_nan_row(heads, kv_heads, head_dim):
    """Scores of +-hundreds (exp of them unshifted overflows, most weights underflow to zero after
    the maximum is taken off) match float64 (to what float32 scores of that size allow); lengths leave tails shorter than a vector. A row whose
    query holds a NaN gets NaN outputs, and the other rows, in the same call, are untouched by it."""
    kernel = _kernel_or_skip()
    q, kc, vc, tables, rows, lens, max_len, scale = _kernel_args(11, 6, heads, kv_heads, head_dim, 16, 64,
                                                                 (1, 60), 4)
    lens = torch.tensor([1, 15, 17, 33, 47, 60], dtype=torch.int32)
    q = q * 60.0  # scores ~ N(0, 60^2)
    out = kernel(q, kc, vc, tables, rows, lens, 60, scale)
    ref, top = _paged_reference(q, kc, vc, tables, rows, lens, scale)
    assert top > 88  # exp(top) is past float32's range
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    q[2, 0, 3] = float("nan")
    out_nan = kernel(q, kc, vc, tables, rows, lens, 60, scale)
    assert torch.isnan(out_nan[2, 0]).all()
    keep = [r for r in range(6) if r != 2]
    assert torch.equal(out_nan[keep], out[keep])


def test_native_decode_refuses_wrong_dtypes_and_shapes():
    kernel = _kernel_or_skip()
    q, kc = torch.randn(2, 4, 8), torch.randn(4, 4, 2, 8)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    rows = torch.arange(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_tables must be a contiguous CPU torch.int32"):
        kernel(q, kc, kc, tables.long(), rows, lens, 1, 1.0)
    with pytest.raises(ValueError, match="q must be"):
        kernel(q.half(), kc, kc, tables, rows, lens, 1, 1.0)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        kernel(torch.randn(2, 3, 8), kc, kc, tables, rows, lens, 1, 1.0)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        kernel(q, kc, kc, tables, rows[:1], lens, 1, 1.0)


def test_native_plan_refuses_a_block_outside_the_cache():
    """A block id past the cache (a corrupt table) raises before the kernel reads memory."""
    _kernel_or_skip()
    seqs = [(5, 1)]
    tables = [[63, 0]]  # the new token writes to block 0; the kernel would read block 63
    meta = build_metadata(seqs, 4, tables)
    backend = TorchAttentionBackend(True)
    q, k = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
    kc = torch.zeros(8, 4, 1, 8)
    with pytest.raises(RuntimeError, match="block id 63 is outside the KV cache's 8 blocks"):
        backend.forward(q, k, k, kc, kc.clone(), meta, 1.0)


def test_native_plan_refuses_minus_one_inside_a_context_and_a_too_narrow_table():
    """The kernel trusts its tables; the plan checks them once per step: a -1 entry where the
    sequence has tokens, or a table with too few columns for the context, raise before any read."""
    _kernel_or_skip()
    backend = TorchAttentionBackend(True)
    meta = build_metadata([(5, 1)], 4, [[1, 0]])
    meta.block_tables[0, 0] = -1  # the block holding tokens 0-3
    with pytest.raises(RuntimeError, match="block table has -1"):
        backend.prepare(meta)
    meta = build_metadata([(5, 1)], 4, [[1, 0]])
    meta.block_tables = meta.block_tables[:, :1].contiguous()  # 4 tokens of room, 6 in the context
    with pytest.raises(RuntimeError, match="too few for a context of 6 tokens"):
        backend.prepare(meta)


def test_the_switch_is_read_for_every_backend_and_the_log_line_names_the_path(monkeypatch):
    """Flipping MINIVLLM_CPU_DECODE_KERNEL between two engines in one process takes effect for
    the second (it was read once per process), and the startup line says which path a model of
    each dtype gets."""
    from minivllm.layers.attention import get_attention_backend

    _kernel_or_skip()
    assert get_attention_backend("torch", "cpu", 16, torch.float32)._kernel is not None
    assert cpu_decode.describe(torch.float32).startswith("native paged kernel")
    assert get_attention_backend("torch", "cpu", 16, torch.bfloat16)._kernel is None
    assert cpu_decode.describe(torch.bfloat16).startswith("gather + SDPA (the native kernel computes float32")
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "off")
    assert get_attention_backend("torch", "cpu", 16, torch.float32)._kernel is None
    assert cpu_decode.describe(torch.float32) == f"gather + SDPA (switched off: {cpu_decode.ENV_SWITCH}=off)"
    monkeypatch.delenv(cpu_decode.ENV_SWITCH)
    assert get_attention_backend("torch", "cpu", 16, torch.float32)._kernel is not None
    # with the model's heads the line names the kernel's loops, as the C code picks them
    width = cpu_decode.load().vector_width()
    assert width in (8, 16)
    assert f"{width} dots at a time (head_dim {width * 4}, 2 query heads" in cpu_decode.describe(torch.float32, (4, 2, width * 4))
    # (36: a multiple of neither vector width; 40 is one of AVX2's 8)
    assert "portable loops (head_dim 36, 2 query heads" in cpu_decode.describe(torch.float32, (6, 3, 36))
    assert "portable loops (head_dim 256" in cpu_decode.describe(torch.float32, (4, 2, 256))
    assert cpu_decode.load().tile_width(12, 4, 32) == 0 and cpu_decode.load().tile_width(16, 1, 64) in (0, 16)


def test_native_decode_can_be_switched_off(monkeypatch):
    """MINIVLLM_CPU_DECODE_KERNEL=0: load() gives None with the reason, and the backend keeps
    the gather + SDPA path."""
    monkeypatch.setattr(cpu_decode._library, "_state", {})
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
    assert cpu_decode.load() is None
    assert cpu_decode.unavailable_reason() == f"{cpu_decode.ENV_SWITCH}=0"
    assert TorchAttentionBackend()._kernel is None
    with pytest.raises(RuntimeError, match="CPU decode kernel is unavailable"):
        TorchAttentionBackend(True)
