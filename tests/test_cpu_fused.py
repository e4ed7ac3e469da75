"""Our C versions of the per-layer small ops (``minivllm.layers.cpu_fused``) against the torch
reference they replace: RMSNorm (plain, per-head on a strided view, with the residual add),
rotary embedding, SiLU-and-multiply; their fallbacks; and the engine wiring."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from helpers_engine import generate_spying_logits, greedy, make_llm, prompts_of
from helpers_native import native_or_skip
from minivllm.layers import cpu_fused
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.norm import RMSNorm, add_rms_norm, rms_norm
from minivllm.layers.rotary import RotaryEmbedding

ATOL = 2e-6  # float32: the C sums are reassociated (SIMD), so results differ in the last bits


@pytest.fixture
def ops():
    """The loaded ops, or a skip (a failure in CI) naming why they are missing."""
    return native_or_skip(cpu_fused, "CPU fused ops")


@pytest.mark.parametrize("tokens", [1, 3, 32])
@pytest.mark.parametrize("dim", [8, 64, 100, 256])
def test_rms_norm_matches_the_reference(ops, tokens, dim):
    g = torch.Generator().manual_seed(tokens * 1000 + dim)
    x, w = torch.randn(tokens, dim, generator=g) * 3, torch.randn(dim, generator=g)
    got = ops.rms_norm(x, w, 1e-6)
    assert got.is_contiguous() and got.dtype == torch.float32
    torch.testing.assert_close(got, rms_norm(x, w, 1e-6), atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("heads,head_dim", [(4, 64), (3, 16), (16, 128)])
def test_per_head_norm_reads_a_strided_view_of_the_fused_projection(ops, heads, head_dim):
    """q_norm / k_norm get ``[T, H, D]`` views cut from the qkv output (row stride wider than
    ``H * D``); the C code reads them in place."""
    g = torch.Generator().manual_seed(heads)
    qkv = torch.randn(5, heads * head_dim * 2 + 7, generator=g)
    q = qkv[:, 3:3 + heads * head_dim].view(5, heads, head_dim)
    assert not q.is_contiguous()
    w = torch.randn(head_dim, generator=g)
    got = ops.rms_norm(q, w, 1e-6)
    assert got.shape == q.shape and got.is_contiguous()
    torch.testing.assert_close(got, rms_norm(q.reshape(-1, head_dim), w, 1e-6).view(q.shape), atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 17])
def test_add_rms_norm_returns_the_norm_and_the_new_residual(ops, tokens):
    g = torch.Generator().manual_seed(tokens)
    x, r, w = torch.randn(tokens, 96, generator=g), torch.randn(tokens, 96, generator=g), torch.randn(96, generator=g)
    r_before = r.clone()
    out, total = ops.add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_total = add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(total, ref_total, atol=0, rtol=0)  # one float add: exact
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=1e-5)
    assert torch.equal(r, r_before)  # the caller's residual is not overwritten


@pytest.mark.parametrize("head_dim", [2, 16, 64, 128])
def test_rope_matches_the_reference_on_strided_heads(ops, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    rot = RotaryEmbedding(head_dim, 512, 1e6)
    qkv = torch.randn(6, (4 + 2) * head_dim + 3, generator=g)
    q = qkv[:, :4 * head_dim].view(6, 4, head_dim)
    k = qkv[:, 4 * head_dim:6 * head_dim].view(6, 2, head_dim)
    pos = torch.tensor([0, 1, 7, 300, 511, 42])
    ref_q, ref_k = rot(pos, q, k)
    rot.fused = ops
    got_q, got_k = rot(pos, q, k)
    torch.testing.assert_close(got_q, ref_q, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(got_k, ref_k, atol=ATOL, rtol=1e-5)


def test_rope_refuses_a_position_outside_the_table(ops):
    """The C code checks every position before reading the table (an index past it would read
    other memory); the error names the position and the token."""
    rot = RotaryEmbedding(16, 64, 1e4)
    rot.fused = ops
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    for bad in (64, -1):
        with pytest.raises(IndexError, match=rf"position {bad} \(token 1\) is outside the table of 64"):
            rot(torch.tensor([5, bad, 6]), q, k)


def test_a_large_input_split_over_threads_gives_the_same_bits(ops, monkeypatch):
    """A prefill-sized input is split by rows over torch's threads (here forced with a tiny
    per-thread minimum): every op gives bit for bit what one call over all rows gives, and a bad
    position in the second half is reported with its own token index."""
    g = torch.Generator().manual_seed(5)
    x3 = torch.randn(37, 3 * 64 + 5, generator=g)[:, :2 * 64].view(37, 2, 64)  # strided heads
    x, r, w = torch.randn(37, 96, generator=g), torch.randn(37, 96, generator=g), torch.randn(96, generator=g)
    gate_up = torch.randn(37, 2 * 96 + 4, generator=g)[:, :2 * 96]
    cos_sin, pos = torch.randn(128, 64, generator=g), torch.randint(0, 128, (37,), generator=g)
    calls = {"rms": lambda: ops.rms_norm(x, w, 1e-6), "rms per head": lambda: ops.rms_norm(x3, w[:64], 1e-6),
             "add rms": lambda: ops.add_rms_norm(x, r, w, 1e-6), "rope": lambda: ops.rope(x3, pos, cos_sin),
             "silu": lambda: ops.silu_and_mul(gate_up)}
    whole = {name: fn() for name, fn in calls.items()}
    threads = torch.get_num_threads()
    monkeypatch.setattr(cpu_fused, "MIN_ELEMENTS_PER_THREAD", 64)
    split_calls, real_run_chunks = [], cpu_fused.run_chunks  # the chunks run on real threads
    monkeypatch.setattr(cpu_fused, "run_chunks", lambda run, chunks: (split_calls.append(chunks),
                                                                      real_run_chunks(run, chunks)))
    torch.set_num_threads(3)
    try:
        for name, fn in calls.items():
            got, ref = fn(), whole[name]
            for a, b in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
                assert torch.equal(a, b), name
        bad = pos.clone()
        bad[30] = 128
        with pytest.raises(IndexError, match=r"position 128 \(token 30\)"):
            ops.rope(x3, bad, cos_sin)
    finally:
        torch.set_num_threads(threads)
    assert split_calls and all(c == 3 for c in split_calls)


def test_silu_and_mul_matches_float64_silu_over_the_whole_range(ops):
    """Our vectorised exp: relative error within a few float32 ulps from -100 to 100 (the clamp
    at -87/88 included), zero at zero."""
    gate = torch.cat([torch.linspace(-100, 100, 20001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.5, -87.5])])
    up = torch.linspace(0.5, 2.0, gate.numel())
    got = ops.silu_and_mul(torch.cat([gate, up]).view(1, -1))[0]
    ref = (F.silu(gate.double()) * up.double()).float()
    big = ref.abs() > 1e-30
    assert ((got[big] - ref[big]).abs() / ref[big].abs()).max() < 5e-7
    assert got[~big].abs().max() < 1e-30
    # past exp's range (-g > 88) the reference's sigmoid is 0: silu is -0, NaN at -inf (found in review)
    extreme = torch.tensor([-88.5, -100.0, -1e30, -1e38, float("-inf"), float("inf"), float("nan")])
    got = ops.silu_and_mul(torch.cat([extreme, torch.ones_like(extreme)]).view(1, -1))[0]
    torch.testing.assert_close(got, F.silu(extreme), atol=1e-35, rtol=1e-6, equal_nan=True)
    x = torch.randn(7, 2 * 300)  # rows longer than the exp chunk (256) and a strided row layout
    wide = torch.randn(7, 700)[:, 50:650]
    for t in (x, wide):
        torch.testing.assert_close(ops.silu_and_mul(t), F.silu(t[:, :300]) * t[:, 300:], atol=ATOL, rtol=1e-5)


def test_silu_and_mul_vector_and_tail_paths_give_the_same_bits(ops):
    """A row is computed a vector at a time and its tail by exp_neg_f32's loops: both give the same
    bits for every value, the clamp's edges, infinities and NaN included."""
    edges = [-88.5, -88.0, -87.5, -87.0, -86.9, -100.0, -1e30, float("-inf"), float("inf"), float("nan"),
             87.9, 88.0, 88.5, 1e30, 0.0, -0.0, 1e-30, -1e-30, 1e-45, 1.0, -1.0, 3.5, -3.5, 20.0]
    gate = torch.cat([torch.tensor(edges), torch.randn(64 - len(edges), generator=torch.Generator().manual_seed(0)) * 30])
    up = torch.linspace(-2.0, 2.0, gate.numel())
    whole = ops.silu_and_mul(torch.cat([gate, up]).view(1, -1))[0]  # 64 values: vectors only
    tails = ops.silu_and_mul(torch.stack([gate, up], 1))[:, 0]       # one value a row: tails only
    assert torch.equal(whole.view(torch.int32), tails.view(torch.int32))
    torch.testing.assert_close(whole, F.silu(gate) * up, atol=1e-30, rtol=1e-6, equal_nan=True)


@pytest.mark.parametrize("tokens", [0, 1, 32])
def test_embedding_lookup_matches_f_embedding_and_names_an_id_outside_the_table(ops, tokens):
    g = torch.Generator().manual_seed(tokens)
    table = torch.randn(50, 24, generator=g)
    ids = torch.randint(0, 50, (tokens,), generator=g)
    got = ops.embedding(ids, table)
    assert got.is_contiguous() and got.shape == (tokens, 24)
    assert torch.equal(got, F.embedding(ids, table))
    for bad in (50, -1):
        with pytest.raises(IndexError, match=f"id {bad} \\(token 1\\) is outside the vocabulary of 50 rows"):
            ops.embedding(torch.tensor([3, bad, 4]), table)
    from minivllm.layers.cpu_graph import CpuGraph

    graph = CpuGraph()
    with pytest.raises(IndexError, match="id 50 \\(token 0\\)"):  # was NotCapturable (.item() while recording)
        with graph.capture():
            ops.embedding(torch.tensor([50]), table)
    # what the C code does not take: the module's F.embedding runs instead
    assert ops.embedding(ids.int(), table) is None and ops.embedding(ids, table.double()) is None
    assert ops.embedding(ids, table.t().contiguous().t()) is None and ops.embedding(ids.view(1, -1), table) is None


def test_outputs_are_float32_whatever_the_default_dtype(ops):
    """The C code writes float32: its outputs must be float32 even when torch's default dtype is
    bfloat16 (an output allocated in the default dtype would be half the bytes written)."""
    x, w = torch.randn(4, 32), torch.randn(32)
    ref = ops.rms_norm(x, w, 1e-6)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        outs = [ops.rms_norm(x, w, 1e-6), ops.rms_norm(x.view(4, 2, 16), w[:16], 1e-6),
                ops.silu_and_mul(x), RotaryEmbedding(16, 8, 1e4).cos_sin_cache(x.device)]
        rot = ops.rope(x.view(4, 2, 16), torch.arange(4), torch.randn(8, 16, dtype=torch.float32))
    finally:
        torch.set_default_dtype(old)
    assert all(t.dtype == torch.float32 for t in outs[:3] + [rot])
    assert torch.equal(outs[0], ref)


def test_outputs_are_cpu_tensors_whatever_the_default_device(ops):
    """Under ``with torch.device("meta")`` (or a CUDA default device) an output allocated on the
    default device would hand the C code a pointer it cannot write (a crash, found in review)."""
    x, w, g = torch.randn(4, 32), torch.randn(32), torch.randn(4, 64)
    with torch.device("meta"):
        outs = [ops.rms_norm(x, w, 1e-6), ops.rms_norm(x.view(4, 2, 16), w[:16], 1e-6), ops.silu_and_mul(g),
                ops.rope(x.view(4, 2, 16), torch.arange(4, device="cpu"), torch.randn(8, 16, device="cpu")),
                *ops.add_rms_norm(x, x, w, 1e-6)]
    assert all(t.device.type == "cpu" for t in outs)
    torch.testing.assert_close(outs[0], rms_norm(x, w, 1e-6), atol=ATOL, rtol=1e-5)


def test_inputs_the_c_code_does_not_take_fall_back_to_the_reference(ops):
    """bf16, a transposed last dim, a 4-D input, a weight of the wrong length, an odd rotary size,
    an input that needs gradients: the method returns None and the module computes the reference."""
    w = torch.randn(16)
    assert ops.rms_norm(torch.randn(4, 16, dtype=torch.bfloat16), w.bfloat16(), 1e-6) is None
    assert ops.rms_norm(torch.randn(16, 4).t(), w, 1e-6) is None
    assert ops.rms_norm(torch.randn(2, 2, 2, 16), w, 1e-6) is None
    assert ops.silu_and_mul(torch.randn(3, 5)) is None  # odd width: no gate/up halves
    norm = RMSNorm(16)
    norm.weight.data.copy_(w)
    norm.fused = ops
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    assert torch.equal(norm(x), rms_norm(x, w, 1e-6))
    # a weight of the wrong length would be read past its end (the reference raises or chunks)
    assert ops.rms_norm(torch.ones(1, 8), torch.ones(4), 1e-6) is None
    assert ops.add_rms_norm(torch.ones(1, 8), torch.ones(1, 8), torch.ones(4), 1e-6) is None
    assert ops.rope(torch.randn(2, 1, 5), torch.arange(2), torch.randn(8, 5)) is None  # odd head size
    x = torch.randn(3, 16, requires_grad=True)  # the C code records no autograd graph
    assert ops.rms_norm(x, w, 1e-6) is None and norm(x).grad_fn is not None


def test_engine_uses_them_for_a_float32_cpu_model_and_hooks_still_fire(tiny_ckpt, ops):
    """Every RMSNorm, RotaryEmbedding and SiluAndMul of a float32 CPU engine points at the ops
    (not for bfloat16); q_norm stays a module, so a forward hook on it fires (chapter 02 hooks
    it); every step's logits match the torch path's, and so do the greedy tokens."""
    llm = make_llm(tiny_ckpt)
    model = llm.llm_engine.runner.model
    owners = [m for m in model.modules() if isinstance(m, (RMSNorm, RotaryEmbedding, SiluAndMul))]
    # per layer 4 norms (input, post-attention, q, k) and the MLP activation; the final norm; one rotary
    assert len(owners) == 5 * len(model.model.layers) + 2 and all(m.fused is ops for m in owners)
    owners.append(model.model.embed_tokens)  # and the token embedding (not the LM head that may share its table)
    assert model.model.embed_tokens.fused is ops and model.lm_head.fused is None
    sampler = llm.llm_engine.runner.sampler
    assert sampler.fused is ops  # greedy rows' argmax
    seen = []
    model.model.layers[0].self_attn.q_norm.register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape)))
    prompt = prompts_of([13], seed=7)[0]
    fused_out, fused_rows = generate_spying_logits(llm, prompt, greedy(6))
    assert seen and seen[0][0] == 13  # the prefill's 13 tokens went through the hooked module
    for m in owners + [sampler]:
        m.fused = None
    torch_out, torch_rows = generate_spying_logits(llm, prompt, greedy(6))
    torch.testing.assert_close(torch.stack(fused_rows), torch.stack(torch_rows), atol=1e-5, rtol=1e-5)
    assert fused_out.token_ids == torch_out.token_ids
    llm.shutdown()
    bf16 = make_llm(tiny_ckpt, dtype="bfloat16")
    assert all(m.fused is None for m in bf16.llm_engine.runner.model.modules()
               if isinstance(m, (RMSNorm, RotaryEmbedding, SiluAndMul)))
    assert bf16.llm_engine.runner.sampler.fused is None
    bf16.shutdown()


def test_the_switch_turns_them_off_and_the_log_says_so(tiny_ckpt, monkeypatch, caplog):
    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "0")
    assert cpu_fused.load() is None
    assert cpu_fused.describe() == f"torch ops (switched off: {cpu_fused.ENV_SWITCH}=0)"
    with caplog.at_level("INFO", logger="minivllm"):
        llm = make_llm(tiny_ckpt)
    assert all(m.fused is None for m in llm.llm_engine.runner.model.modules() if isinstance(m, RMSNorm))
    assert f"CPU norms, rotary, SiLU, embedding lookup and greedy argmax: torch ops (switched off: {cpu_fused.ENV_SWITCH}=0)" in caplog.text
    llm.shutdown()


def test_a_bfloat16_model_logs_its_path_too(tiny_ckpt, caplog):
    """Every CPU engine logs the line (a bf16 model logged none, found in a user trial)."""
    with caplog.at_level("INFO", logger="minivllm"):
        make_llm(tiny_ckpt, dtype="bfloat16").shutdown()
    assert ("CPU norms, rotary, SiLU, embedding lookup and greedy argmax: torch ops (the C ops compute float32; this model runs in torch.bfloat16)"
            in caplog.text)


@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 17), (32, 4096), (5, 151936)])
def test_greedy_argmax_matches_numpy_first_maximum(ops, rows, cols):
    """Each row's first maximum, as ``np.argmax``, including ties (a max repeated later in the row)
    and a row whose only maximum is its last entry."""
    import numpy as np

    rng = np.random.default_rng(rows * cols)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[0, -1] = x[0].max() + 1.0  # the maximum at the very end
    if rows > 1 and cols > 2:
        x[1, 1] = x[1, -1] = x[1].max() + 0.5  # a tie: the first one wins
    ids = ops.greedy_ids(torch.from_numpy(x))
    assert ids.dtype == np.int64 and ids.tolist() == np.argmax(x, axis=-1).tolist()
    r = np.round(x)  # many ties within a row: still the first
    assert ops.greedy_ids(torch.from_numpy(r)).tolist() == np.argmax(r, axis=-1).tolist()


def test_greedy_argmax_marks_non_finite_rows_and_reads_strided_rows(ops):
    import numpy as np

    base = np.random.default_rng(0).standard_normal((6, 40)).astype(np.float32)
    base[1, 7], base[2, 3], base[3, 39], base[4, 0] = np.nan, np.inf, -np.inf, np.finfo(np.float32).max
    x = torch.from_numpy(base)[:, :33]  # rows 40 floats apart, 33 read: row 3's -inf is cut off
    assert ops.greedy_ids(x).tolist() == [int(np.argmax(x[0])), -1, -1, int(np.argmax(x[3])), 0,
                                         int(np.argmax(x[5]))]
    assert ops.greedy_ids(torch.zeros(0, 8)).tolist() == []
    # what it does not take: another dtype, a column stride, a tensor needing gradients, a 1-D one,
    # rows without logits
    for t in (torch.from_numpy(base).double(), torch.from_numpy(base)[:, ::2], torch.zeros(2, 3, requires_grad=True),
              torch.zeros(8), torch.zeros(2, 0)):
        assert ops.greedy_ids(t) is None


@pytest.mark.parametrize("cols", [63, 64, 65, 97, 130, 4096 + 33])
def test_greedy_argmax_past_the_first_vector_block_and_in_the_tail(ops, cols):
    """Widths around and past the C code's vector block (up to 64 columns at a time) with a tail:
    the maximum in the tail, a tie split between the block and the tail, and a NaN / an infinity
    past the first block or in the last column each give what numpy does."""
    import numpy as np

    rng = np.random.default_rng(cols)
    x = rng.standard_normal((7, cols)).astype(np.float32)
    x[0, -1] = 10.0                              # the maximum in the tail
    x[1, cols // 2] = x[1, -1] = 10.0             # a tie: the earlier one
    x[2, min(cols - 1, 64 + 3)] = np.nan          # past the first block (or the tail of a short row)
    x[3, -1] = np.inf                             # the last column
    x[4, cols - 2] = -np.inf
    x[5] = np.round(x[5])                         # many ties everywhere
    want = np.argmax(x, axis=-1)
    want[2:5] = -1
    assert ops.greedy_ids(torch.from_numpy(x)).tolist() == want.tolist()


@pytest.mark.parametrize("head_dim", [2, 64, 128])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_qk_norm_rope_matches_the_norms_then_rope(ops, head_dim, tokens):
    """One call for q_norm, k_norm and RoPE gives what the modules' torch paths give, on strided
    views of a fused QKV output (GQA: 4 query heads, 2 KV heads)."""
    g = torch.Generator().manual_seed(head_dim * 100 + tokens)
    rot = RotaryEmbedding(head_dim, 512, 1e6)
    norm_q, norm_k = RMSNorm(head_dim, eps=1e-6), RMSNorm(head_dim, eps=1e-5)
    norm_q.weight.data = torch.rand(head_dim, generator=g) + 0.5
    norm_k.weight.data = torch.rand(head_dim, generator=g) + 0.5
    qkv = torch.randn(tokens, (4 + 2 + 2) * head_dim + 3, generator=g) * 3
    q = qkv[:, :4 * head_dim].view(tokens, 4, head_dim)
    k = qkv[:, 4 * head_dim:6 * head_dim].view(tokens, 2, head_dim)
    pos = torch.randint(0, 512, (tokens,), generator=g)
    ref_q, ref_k = rot(pos, norm_q(q), norm_k(k))  # no fused ops set: the torch references
    got_q, got_k = ops.qk_norm_rope(q, k, norm_q.weight, norm_q.eps, norm_k.weight, norm_k.eps, pos,
                                    rot.cos_sin_cache(q.device))
    assert got_q.is_contiguous() and got_k.is_contiguous()
    torch.testing.assert_close(got_q, ref_q, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(got_k, ref_k, atol=ATOL, rtol=1e-5)


def test_qk_norm_rope_names_a_position_outside_the_table_and_refuses_what_it_does_not_take(ops):
    rot = RotaryEmbedding(8, 16, 1e6)
    table, w = rot.cos_sin_cache(torch.device("cpu")), torch.ones(8)
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    with pytest.raises(IndexError, match="position 16 \\(token 2\\)"):
        ops.qk_norm_rope(q, k, w, 1e-6, w, 1e-6, torch.tensor([0, 15, 16]), table)
    for args in ((q.double(), k.double(), w.double(), 1e-6, w.double(), 1e-6, torch.tensor([0, 1, 2]), table.double()),
                 (q[:, :, :7], k[:, :, :7], w[:7], 1e-6, w[:7], 1e-6, torch.tensor([0, 1, 2]), table[:, :7]),
                 (q, k[:2], w, 1e-6, w, 1e-6, torch.tensor([0, 1, 2]), table),          # tokens differ
                 (q, k, w, 1e-6, w, 1e-6, torch.tensor([0, 1, 2], dtype=torch.int32), table)):
        assert ops.qk_norm_rope(*args) is None


def test_the_engine_runs_q_k_norms_and_rope_as_one_call_unless_a_hook_watches_them(tiny_ckpt, ops):
    """An eager decode step makes one qk_norm_rope call per layer and no separate RoPE call; its
    logits match the torch path's. A forward hook on q_norm brings the module calls back (chapter
    02 hooks it), and the hook fires."""
    from minivllm.layers import cpu_graph

    llm = make_llm(tiny_ckpt, enforce_eager=True)
    model, engine = llm.llm_engine.runner.model, llm.llm_engine
    layers = len(model.model.layers)
    prompt = prompts_of([9], seed=3)[0]

    def decode_calls():
        engine.add_request("r", prompt, greedy(3))
        engine.step()  # the prefill
        with cpu_graph.count_calls() as calls:
            assert engine.step_with_record().record.phase == "decode"
        while engine.has_unfinished_requests():
            engine.step()
        return calls

    calls = decode_calls()
    assert calls["qk_norm_rope_f32"] == layers and calls["rope_f32"] == 0 and calls["rms_norm_f32"] <= 1
    fused_out, fused_rows = generate_spying_logits(llm, prompt, greedy(5))
    seen = []
    hook = model.model.layers[0].self_attn.q_norm.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    calls = decode_calls()
    assert seen and calls["qk_norm_rope_f32"] == layers - 1 and calls["rope_f32"] == 2  # layer 0: q and k
    hook.remove()
    owners = [m for m in model.modules() if isinstance(m, (RMSNorm, RotaryEmbedding))]
    for m in owners:
        m.fused = None
    torch_out, torch_rows = generate_spying_logits(llm, prompt, greedy(5))
    torch.testing.assert_close(torch.stack(fused_rows), torch.stack(torch_rows), atol=1e-5, rtol=1e-5)
    assert fused_out.token_ids == torch_out.token_ids
    llm.shutdown()
