"""``kv_cache_dtype="bfloat16"``: a float32 model whose KV cache holds bfloat16 (vLLM's argument).

The C decode kernel and KV store against a naive loop over the same bfloat16 values, the store's
rounding against torch's, and the engine end to end: twice the blocks, the same tokens through the
kernel, the reference path and CPU graphs, and logits within bfloat16's reach of an fp32 cache's."""
from __future__ import annotations

import pytest
import torch

from helpers_engine import generate_spying_logits, greedy, make_llm, prompts_of, token_lists
from helpers_models import allocate_block_tables, build_metadata
from helpers_native import native_or_skip
from minivllm.config import EngineArgs, resolve_kv_cache_dtype
from minivllm.layers.attention import cpu_decode
from minivllm.layers.attention.torch_backend import TorchAttentionBackend
from test_torch_backend import MIXED, _kernel_args, naive_attention


def _kernel_or_skip():
    return native_or_skip(cpu_decode, "CPU decode kernel")


def run_case(seqs, block_size, heads=4, kv_heads=2, head_dim=16, native=True, seed=0):
    """One attention call of a float32 step over a bfloat16 cache, and the naive loop's answer."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 64
    tables = allocate_block_tables([c + n for c, n in seqs], block_size, num_blocks, seed=seed)
    meta = build_metadata(seqs, block_size, tables)
    t = meta.num_tokens
    q, k, v = (torch.randn(t, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    k_cache, v_cache = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).bfloat16()
                        for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    scale = head_dim ** -0.5
    out = TorchAttentionBackend(native).forward(q, k, v, k_cache, v_cache, meta, scale)
    ref = naive_attention(q, k, v, k_ref, v_ref, seqs, tables, block_size, meta.slot_mapping.tolist(), scale)
    return out, ref, (k_cache, v_cache), (k_ref, v_ref), meta


@pytest.mark.parametrize("block_size", [1, 4, 16, 256])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (8, 1, 64), (4, 4, 128), (16, 8, 64), (8, 2, 128),  # tiled, head_dim and GQA ratio as constants
    (4, 2, 16), (16, 1, 64), (8, 2, 48), (8, 2, 96),    # tiled at run time (loads paired where head_dim is a
                                                        # multiple of two vectors), or generic (AVX2: qpk 16, 96)
    (6, 3, 40), (12, 4, 32), (4, 2, 256)])              # the generic loops
def test_native_decode_over_a_bf16_cache_matches_naive(block_size, heads, kv_heads, head_dim):
    """Every code path of the kernel reads bfloat16 blocks as the float32 values they hold: within
    float32 rounding of the naive loop over the same values, and the new K/V stored as torch rounds them."""
    _kernel_or_skip()
    seqs = [(0, 1), (block_size - 1, 1), (block_size, 1), (3 * block_size + 2, 1), (37, 1)]
    out, ref, cache, cache_ref, meta = run_case(seqs, block_size, heads, kv_heads, head_dim)
    assert meta.extras["torch_backend_plan"].groups[0].tables32 is not None  # the kernel's plan was built
    assert cache[0].dtype == torch.bfloat16 and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert torch.equal(cache[0], cache_ref[0]) and torch.equal(cache[1], cache_ref[1])


@pytest.mark.parametrize("native", [False, True], ids=["sdpa_decode", "native_decode"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (4, 4)])
def test_mixed_steps_over_a_bf16_cache_match_naive(block_size, heads, kv_heads, native):
    """Prefills after a prefix hit, chunks and decodes in one step, through both decode paths."""
    if native:
        _kernel_or_skip()
    out, ref, cache, cache_ref, _ = run_case(MIXED, block_size, heads, kv_heads, native=native)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert torch.equal(cache[0], cache_ref[0]) and torch.equal(cache[1], cache_ref[1])


def test_store_rounds_to_bf16_as_torch_does():
    """The C store rounds to nearest, ties to even, NaN to a NaN: bit for bit torch's conversion (but for
    a NaN's bits), over random values of every magnitude and the awkward ones (ties, the largest finite
    values, infinities, NaN, subnormals, signed zeros)."""
    kernel = _kernel_or_skip()
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(-2**31, 2**31, (4096,), generator=gen, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F800000, 0xFF800000,
                            0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0x00000001, 0x00008000, 0x00018000, 0x80000000,
                            0x00000000, 0x807FFFFF], dtype=torch.int64).to(torch.int32)
    values = torch.cat([bits, special]).view(torch.float32)
    rows = values.numel() // 8
    k = values[:rows * 8].view(rows, 2, 4).contiguous()
    v = torch.flip(k, [0]).contiguous()
    k_cache = torch.zeros(rows, 1, 2, 4, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(rows, dtype=torch.int64)
    assert kernel.store_kv(k, v, k_cache, v_cache, slots)
    for got, want in ((k_cache, k), (v_cache, v)):
        want = want.to(torch.bfloat16).view(torch.int16)
        got = got.view(rows, 2, 4).view(torch.int16)
        nan = want.view(torch.bfloat16).isnan()
        assert torch.equal(got[~nan], want[~nan])
        assert got.view(torch.bfloat16)[nan].isnan().all()


def test_bf16_decode_split_over_threads_matches_one_thread():
    """Rows split over threads (the panel GEMM's pool, or Python threads) read the bfloat16 caches too."""
    kernel = _kernel_or_skip()
    q, kc, vc, *rest = _kernel_args(5, 40, 8, 2, 64, 4, 600, (1, 50), 13)
    kc, vc = kc.bfloat16(), vc.bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(q, kc, vc, *rest)
        torch.set_num_threads(4)
        many = kernel(q, kc, vc, *rest)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    torch.testing.assert_close(one, kernel(q, kc.float(), vc.float(), *rest), atol=1e-6, rtol=0)


def test_kernel_refuses_mixed_cache_dtypes():
    kernel = _kernel_or_skip()
    q = torch.randn(1, 4, 16)
    kc = torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="v_cache must be a contiguous CPU torch.bfloat16"):
        kernel(q, kc, kc.float(), one.view(1, 1) * 0, one * 0, one, 1, 0.25)
    with pytest.raises(ValueError, match="k_cache must be a contiguous CPU torch.float32"):
        kernel(q, kc.half(), kc.half(), one.view(1, 1) * 0, one * 0, one, 1, 0.25)


# --- the engine ----------------------------------------------------------------------------------


def test_kv_cache_dtype_names_and_refusals():
    assert resolve_kv_cache_dtype("auto", torch.float32, "triton") is torch.float32
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, "torch") is torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16, "flash_attn") is torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16' with dtype=float32.*got 'triton'"):
        resolve_kv_cache_dtype("bfloat16", torch.float32, "triton")
    for bad in ("fp8", "fp8_e4m3", "float16", "BF16", None):
        with pytest.raises(ValueError, match=f"kv_cache_dtype={bad!r}: choose one of"):
            EngineArgs(kv_cache_dtype=bad)


def test_bf16_cache_holds_twice_the_blocks_and_says_so(tiny_ckpt):
    budget = 1 << 20
    sizes = {}
    for kv in ("auto", "bfloat16"):
        llm = make_llm(tiny_ckpt, kv_cache_dtype=kv, num_kvcache_blocks=None, kv_cache_memory_bytes=budget)
        engine = llm.llm_engine
        sizes[kv] = engine.config.num_kv_blocks
        assert engine.runner.kv_cache.dtype == engine.config.kv_cache_dtype
        assert engine.model_cost.kv_dtype_bytes == engine.runner.kv_cache.element_size()
        assert engine.runner.kv_cache.nbytes <= budget
    assert sizes["bfloat16"] == 2 * sizes["auto"]


def test_draft_model_caches_in_the_targets_kv_dtype(tiny_ckpt, tiny_draft_ckpt):
    """The draft model's runner kept a float32 cache (twice the bytes, for twice the tokens) under a bf16 target."""
    spec = {"method": "draft_model", "model": str(tiny_draft_ckpt), "num_speculative_tokens": 2}
    llm = make_llm(tiny_ckpt, kv_cache_dtype="bfloat16", speculative_config=spec)
    engine = llm.llm_engine
    draft = engine.scheduler.config.propose
    assert engine.runner.kv_cache.dtype == draft.runner.kv_cache.dtype == torch.bfloat16
    out = llm.generate([{"prompt_token_ids": p} for p in prompts_of([6, 11], seed=2)], greedy(6), use_tqdm=False)
    assert all(len(t) == 6 for t in token_lists(out))


def test_bf16_cache_engine_paths_agree_and_stay_near_fp32(tiny_ckpt, monkeypatch):
    """Through the C kernel with CPU graphs, the C kernel eagerly and the gather + SDPA reference:
    the same greedy tokens, graphs and eager the same logits; the reference's within 5e-3 (the paths sum
    in different orders, and a key or value that lands on the other side of a bfloat16 rounding boundary
    in a later layer moves a logit by ~1e-3; a differential fuzz saw up to 9.7e-4). Against
    an fp32 cache: the logits moved by the rounding of K and V, but by less than a few units of
    bfloat16's precision at the logits' scale."""
    _kernel_or_skip()
    prompts = prompts_of([5, 17, 9, 30], seed=4)
    params = greedy(12)

    def run(**kw):
        llm = make_llm(tiny_ckpt, **kw)
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        _, rows = generate_spying_logits(llm, {"prompt_token_ids": prompts[3]}, params)
        runner = llm.llm_engine.runner
        graphs = runner.graph_runner
        how = (runner.kv_cache.dtype, runner.backend._kernel is not None,
               graphs is not None and graphs.num_recordings > 0 and graphs.not_capturable is None)
        return token_lists(out), torch.stack(rows), how

    graphs, graph_rows, how = run(kv_cache_dtype="bfloat16")
    assert how == (torch.bfloat16, True, True)
    eager, eager_rows, how = run(kv_cache_dtype="bfloat16", enforce_eager=True)
    assert how == (torch.bfloat16, True, False)
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
    reference, reference_rows, how = run(kv_cache_dtype="bfloat16", enforce_eager=True)
    assert how == (torch.bfloat16, False, False)
    monkeypatch.delenv(cpu_decode.ENV_SWITCH)
    assert graphs == eager == reference
    torch.testing.assert_close(graph_rows, eager_rows, atol=1e-4, rtol=0)
    torch.testing.assert_close(reference_rows, eager_rows, atol=5e-3, rtol=0)

    _, fp32_rows, how = run()
    assert how == (torch.float32, True, True)
    moved = (fp32_rows[1:] - eager_rows[1:]).abs().max().item()
    assert 0 < moved < 2 ** -8 * fp32_rows.abs().max().item() * 4
