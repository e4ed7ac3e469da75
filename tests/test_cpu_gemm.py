"""The panel GEMM (``minivllm.layers.cpu_gemm``) against ``F.linear``: every row-count path of the
kernel (1 row, 2-5 left over, whole groups of 6), K below, at and across its 256-value chunks,
bias, strided and 3-D inputs, the split over threads, and the inputs it hands back to torch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers_native import native_or_skip
from minivllm.layers import cpu_gemm, prepack


@pytest.fixture
def gemm():
    """The loaded kernel, or a skip (a failure in CI) naming why it is missing."""
    return native_or_skip(cpu_gemm, "panel GEMM")


def _case(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed * 7919 + m * 131 + k * 17 + n)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5, torch.randn(n, generator=g)


def test_packing_round_trips_and_puts_16_output_columns_per_k():
    w = torch.arange(32 * 5, dtype=torch.float32).reshape(32, 5)
    p = cpu_gemm.pack_panels(w)
    assert p.shape == (2, 5, 16) and p.is_contiguous()
    assert p[1, 3, 7] == w[16 + 7, 3]
    assert torch.equal(cpu_gemm.unpack_panels(p), w)
    assert cpu_gemm.is_panels(p) and not cpu_gemm.is_panels(w)
    assert not cpu_gemm.packable(torch.zeros(24, 5))  # not a multiple of 16 rows
    assert not cpu_gemm.packable(torch.zeros(32, 5, dtype=torch.bfloat16))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 64])
@pytest.mark.parametrize("k", [1, 7, 256, 300, 1000])
def test_matches_f_linear_for_every_row_count_and_k(gemm, m, k):
    x, w, _ = _case(m, k, 48)
    got = gemm(x, cpu_gemm.pack_panels(w))
    assert got.shape == (m, 48) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("m", [1, 4, 9])
def test_bias_is_added_once_whatever_the_number_of_k_chunks(gemm, m):
    x, w, b = _case(m, 600, 32)  # 600: three chunks of k
    torch.testing.assert_close(gemm(x, cpu_gemm.pack_panels(w), b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_strided_rows_and_leading_dims(gemm):
    x, w, _ = _case(6, 64, 32)
    wide = torch.randn(6, 100)
    wide[:, 10:74] = x
    view = wide[:, 10:74]  # row stride 100, unit stride along k
    p = cpu_gemm.pack_panels(w)
    torch.testing.assert_close(gemm(view, p), F.linear(x, w), atol=1e-5, rtol=1e-5)
    x3 = x.reshape(2, 3, 64)
    torch.testing.assert_close(gemm(x3, p), F.linear(x3, w), atol=1e-5, rtol=1e-5)
    assert gemm(torch.empty(0, 64), p).shape == (0, 32)


def test_a_prefill_sized_input_in_row_chunks_matches_and_each_row_is_computed_alike(gemm):
    """More rows than one call takes (``ROWS_PER_CALL``): strided rows, a bias, the chunks'
    boundaries; a row gets the same bits as when it is multiplied alone."""
    m = 2 * cpu_gemm.ROWS_PER_CALL + 7
    x, w, b = _case(m, 96, 48)
    wide = torch.randn(m, 120)
    wide[:, 5:101] = x
    p = cpu_gemm.pack_panels(w)
    got = gemm(wide[:, 5:101], p, b)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    for r in (0, cpu_gemm.ROWS_PER_CALL - 1, cpu_gemm.ROWS_PER_CALL, m - 1):
        assert torch.equal(got[r], gemm(x[r:r + 1], p, b)[0])


def test_split_over_threads_gives_the_same_result(gemm, monkeypatch):
    x, w, b = _case(5, 256, 160)
    p = cpu_gemm.pack_panels(w)
    one = gemm(x, p, b)
    monkeypatch.setattr(cpu_gemm, "MIN_MACS_PER_THREAD", 1)  # split even this small product
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        split = gemm(x, p, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(split, one)  # each panel is computed the same way whichever thread runs it


def test_inputs_the_kernel_does_not_take_go_to_torch_through_linear(gemm):
    x, w, b = _case(3, 64, 32)
    p = cpu_gemm.pack_panels(w)
    assert not gemm.takes(x.double(), p, None) and not gemm.takes(x.t().contiguous().t(), p, None)
    with pytest.raises(ValueError, match="panel GEMM"):
        gemm(x.double(), p)
    xg = x.clone().requires_grad_()
    y = prepack.linear(xg, p, b)  # F.linear on the unpacked weight: autograd still works
    y.sum().backward()
    torch.testing.assert_close(xg.grad, w.sum(0).expand(3, 64), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prepack.linear(x.t().contiguous().t(), p, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_concurrent_callers_and_a_forked_child_get_correct_results(gemm, monkeypatch):
    """The C pool serves one parallel call at a time (a second caller runs on its own thread), and
    a forked child, whose copy of the pool has no threads, builds its own instead of waiting forever."""
    import os
    import threading

    monkeypatch.setattr(cpu_gemm, "MIN_MACS_PER_THREAD", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x, w, b = _case(4, 128, 256)
        p, want = cpu_gemm.pack_panels(w), F.linear(x, w, b)
        errors = []

        def hammer():
            for _ in range(300):
                if not torch.allclose(gemm(x, p, b), want, atol=1e-5, rtol=1e-5):
                    errors.append("mismatch")

        workers = [threading.Thread(target=hammer) for _ in range(3)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        assert not errors
        if not hasattr(os, "fork"):
            return
        r, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: report and leave without running pytest's teardown
            ok = torch.allclose(gemm(x, p, b), want, atol=1e-5, rtol=1e-5)
            os.write(wfd, b"1" if ok else b"0")
            os._exit(0)
        os.close(wfd)
        import select
        ready, _, _ = select.select([r], [], [], 60)
        answer = os.read(r, 1) if ready else b"timeout"
        os.close(r)
        if not ready:
            os.kill(pid, 9)
        os.waitpid(pid, 0)
        assert answer == b"1"
    finally:
        torch.set_num_threads(threads)


def test_the_torch_fallback_takes_any_dtype_with_a_bias_and_refused_panels_stay_refused(gemm):
    """From a review: the fallback cast the weight to x's dtype but not the bias (F.linear then
    raised for a float64 or bf16 input); panels that need gradients or hold no K went to the C code."""
    x, w, b = _case(3, 64, 32)
    p = cpu_gemm.pack_panels(w)
    torch.testing.assert_close(prepack.linear(x.double(), p, b), F.linear(x.double(), w.double(), b.double()))
    assert prepack.linear(x.bfloat16(), p, b).dtype == torch.bfloat16
    assert not gemm.takes(x, p.clone().requires_grad_(), None)
    empty = torch.zeros(2, 0, 16)
    assert not gemm.takes(torch.zeros(3, 0), empty, None)
    assert torch.equal(prepack.linear(torch.zeros(3, 0), empty), torch.zeros(3, 32))


@pytest.mark.parametrize("n", [16, 48, 112])
def test_every_row_count_gets_a_rows_bits_alone(gemm, n):
    """Whatever pass a row lands in (one row, groups of up to 6 or 12 rows, one to four panels
    at once: the AVX2 and AVX-512 builds group them differently), it gets the bits it gets alone,
    so a sequence's tokens do not depend on the batch around it."""
    x, w, b = _case(27, 300, n)  # 300: two chunks of k; 112: seven panels (a group of 4, then the rest)
    p = cpu_gemm.pack_panels(w)
    alone = torch.cat([gemm(x[r:r + 1], p, b) for r in range(27)])
    torch.testing.assert_close(alone, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    for m in range(1, 28):
        assert torch.equal(gemm(x[:m], p, b), alone[:m]), m


def test_rows_of_a_long_k_in_blocks_get_their_bits_alone(gemm):
    """With a long k the kernel takes a call's rows in blocks (X_BLOCK_BYTES of x: 24 rows at k = 3000), each
    through every panel: every row, in any block and the short last one, gets the bits it gets alone."""
    x, w, b = _case(61, 3000, 48)
    p = cpu_gemm.pack_panels(w)
    got = gemm(x, p, b)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    for r in range(61):
        assert torch.equal(got[r], gemm(x[r:r + 1], p, b)[0]), r


@pytest.mark.parametrize("m", [1, 5, 12, 13, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_greedy_head_gives_the_gemm_and_each_rows_first_maximum_or_minus_one(gemm, monkeypatch, m, dtype):
    """``run_greedy`` (a greedy step's LM head): the same bits as ``run``, and per row the column
    of the first maximum among the first ``cols`` outputs, as numpy's argmax (ties across lanes and
    across panels, the padding columns left out), -1 for a row with a NaN or an infinity."""
    if dtype not in gemm.panel_dtypes:
        pytest.skip(f"this build of the GEMM takes no {dtype} panels (no F16C: MINIVLLM_CPU_MARCH=x86-64?)")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    x, w, _ = _case(m, 40, 96, seed=3)
    panels = cpu_gemm.pack_panels(w.to(dtype).float(), dtype)
    for cols in (96, 90, 17, 1):
        y, ids = gemm.run_greedy(x, panels, cols)
        assert torch.equal(y, gemm.run(x, panels)) and ids.dtype.name == "int64"
        assert ids.tolist() == y[:, :cols].numpy().argmax(axis=1).tolist()
    # ties: every row's maximum in several columns (lanes 3 and 9 of panels 1, 2 and 5: first at 19)
    w_tie = torch.zeros(96, 40)
    w_tie[[19, 25, 35, 41, 83, 89], 0] = 1.0
    x_tie = torch.randn(m, 40).abs() + 0.1
    _, ids = gemm.run_greedy(x_tie, cpu_gemm.pack_panels(w_tie), 96)
    assert ids.tolist() == [19] * m
    # the maximum in the padding is not a logit
    w_pad = w.clone()
    w_pad[95] = 1e3 * x.sum(0).sign()
    y, ids = gemm.run_greedy(x, cpu_gemm.pack_panels(w_pad), 95)
    assert int(y[0].argmax()) == 95 and ids.tolist() == y[:, :95].numpy().argmax(axis=1).tolist()
    # a NaN or an infinity anywhere in a row's logits (not only at its maximum) marks the row
    x_bad = x.clone()
    x_bad[0, 3] = float("nan")
    if m > 1:
        x_bad[m - 1, 7] = float("inf")
    y, ids = gemm.run_greedy(x_bad, panels, 96)
    want = y.numpy().argmax(axis=1)
    want[~torch.isfinite(y).all(dim=1).numpy()] = -1
    assert ids.tolist() == want.tolist() and ids[0] == -1 and ids[m - 1] == -1


@pytest.mark.parametrize("threads", [1, 2])
def test_grouped_panels_give_the_bits_of_panel_by_panel_ones(gemm, monkeypatch, threads):
    """Panels in groups of four (``[N / 64, K, 64]``: one stream of whole lines for a pass over four panels)
    hold the same values in another order, and each output sums over k in the same order: the same bits as
    panels one by one, for every panel type, at every row count a pass handles differently, k across
    chunks, with a bias, a greedy head, and thread splits that fall inside a group (3 and 5 groups)."""
    monkeypatch.setattr(cpu_gemm, "MIN_MACS_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    for dtype in sorted(gemm.panel_dtypes, key=str):
        for n, k in ((64, 7), (192, 300), (320, 40)):
            x_all, w, b = _case(300, k, n, seed=5)
            w = w.to(dtype).float()
            grouped, by_panel = (cpu_gemm.pack_panels(w, dtype, grouped=flag) for flag in (True, False))
            assert grouped.shape == (n // 64, k, 64) and by_panel.shape == (n // 16, k, 16)
            assert cpu_gemm.is_panels(grouped) and torch.equal(cpu_gemm.unpack_panels(grouped), w)
            for m in (1, 2, 6, 7, 12, 13, 40, 300):
                x = x_all[:m]
                for bias in (None, b):
                    assert torch.equal(gemm(x, grouped, bias), gemm(x, by_panel, bias)), (dtype, n, k, m)
                if threads == 1 and m <= 8:
                    (yg, ig), (yp, ip) = gemm.run_greedy(x, grouped, n - 2), gemm.run_greedy(x, by_panel, n - 2)
                    assert torch.equal(yg, yp) and ig.tolist() == ip.tolist()


def test_panels_are_grouped_by_default_where_the_build_prefers_it(gemm):
    """Grouping pays where every pass reads four panels (AVX-512 builds), not in an AVX2 build's passes of
    two panels or one (measurements in the C source)."""
    w = torch.randn(128, 8)
    for dtype, src in ((torch.int8, w.clamp(-1, 1).mul(100).to(torch.int8)), (torch.bfloat16, w),
                       (torch.float32, w)):
        width = 64 if gemm.prefers_groups else 16
        assert cpu_gemm.pack_panels(src, dtype).shape == (128 // width, 8, width), dtype
    assert cpu_gemm.pack_panels(torch.randn(96, 8), torch.bfloat16).shape == (6, 8, 16)  # N not a multiple of 64


def test_grouped_panels_from_any_range_of_panels(gemm):
    """``panel_gemm_w`` over a range of grouped panels that starts or ends inside a group (its contract; the
    Python side splits at whole groups) writes those panels' outputs, bit for bit the full call's: on an
    AVX-512 build every pass otherwise starts at an even panel of a group, so an odd offset is only reached
    here (and in an AVX2 build's one-panel passes)."""
    import ctypes

    from minivllm.layers.native_build import build_and_load

    lib = build_and_load(cpu_gemm.SOURCE)[0]
    fn = lib.panel_gemm_w
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ctypes.c_int, p, i64, p, p, p, i64, i64, p, i64, i64, i64]
    fn.restype = None
    for dtype in sorted(gemm.panel_dtypes, key=str):
        for m in (1, 3, 8, 13):
            x, w, _ = _case(m, 40, 320, seed=9)
            w = w.to(dtype).float()
            panels = cpu_gemm.pack_panels(w, dtype, grouped=True)  # 20 panels in 5 groups
            full = gemm(x, panels)
            wt = cpu_gemm._WEIGHT_TYPES[dtype] | cpu_gemm._GROUPED
            for b0, b1 in ((1, 7), (2, 3), (3, 4), (5, 14), (0, 20), (3, 19), (19, 20)):
                y = torch.full((m, 320), float("nan"))
                fn(wt, x.data_ptr(), 40, panels.data_ptr(), None, None, m, 40, y.data_ptr(), 320, b0, b1)
                assert torch.equal(y[:, 16 * b0:16 * b1], full[:, 16 * b0:16 * b1]), (dtype, m, b0, b1)
                assert y[:, :16 * b0].isnan().all() and y[:, 16 * b1:].isnan().all()  # nothing else written


def test_grouped_panels_are_split_over_threads_by_whole_groups(gemm, monkeypatch):
    """The C code splits grouped panels at whole groups, so a call is split over at most one thread a
    group (more would wake threads for empty ranges)."""
    calls = []
    real = cpu_gemm.launch
    monkeypatch.setattr(cpu_gemm, "launch", lambda fn, *args, **kw: calls.append(args[-1]) or real(fn, *args, **kw))
    monkeypatch.setattr(cpu_gemm, "MIN_MACS_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    x, w, _ = _case(2, 40, 128)
    gemm(x, cpu_gemm.pack_panels(w.bfloat16().float(), torch.bfloat16, grouped=True))  # 2 groups of 4 panels
    gemm(x, cpu_gemm.pack_panels(w, grouped=False))  # 8 panels one by one
    assert calls == [2, 8]


def test_greedy_head_refuses_what_it_does_not_take(gemm, monkeypatch):
    x, w, _ = _case(4, 40, 96)
    panels = cpu_gemm.pack_panels(w)
    assert gemm.run_greedy(x, panels, 97) is None and gemm.run_greedy(x, panels, 0) is None
    assert gemm.run_greedy(torch.randn(cpu_gemm.ROWS_PER_CALL + 1, 40), panels, 96) is None
    assert gemm.run_greedy(x.double(), panels, 96) is None and gemm.run_greedy(x[None], panels, 96) is None
    monkeypatch.setattr(cpu_gemm, "MIN_MACS_PER_THREAD", 1)  # a GEMM the call would split over threads
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert gemm.run_greedy(x, panels, 96) is None


def test_a_greedy_engine_step_takes_its_tokens_from_the_lm_heads_gemm(gemm, monkeypatch):
    """A plain greedy CPU step asks the LM head for its tokens (``ModelInput.greedy_ids``): each
    row's first maximum of the logits the step returns, and the same generations as the sampler's
    own pass; with logprobs, or a sampler a notebook put in the stock one's place, the step makes
    its own pass. The bench's matmul replay still sees the head (``record_linear_calls``)."""
    from minivllm import LLM, SamplingParams
    from minivllm.bench.matmul_share import record_linear_calls
    from minivllm.layers.cpu_graph import count_calls

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    llm = LLM("minivllm-tiny", seed=0)
    runner = llm.llm_engine.runner
    seen, real = [], runner.forward_logits

    def spy(inp, *args):
        out = real(inp, *args)
        seen.append((inp.greedy, inp.greedy_ids, out.clone()))
        return out

    runner.forward_logits = spy
    prompts = ["The cache holds", "A block table maps", "Decode reads"]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with record_linear_calls() as calls, count_calls() as c_calls:
        with record_linear_calls() as inner:  # blocks nest: the outer one records again after the inner
            pass
        assert inner == []
        fused = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert len(seen) == 6 and all(wanted and ids is not None for wanted, ids, _ in seen)
    assert c_calls["panel_gemm_greedy_w"] == 6  # counted among the C calls, as the head's GEMM was
    assert all(ids.tolist() == logits.numpy().argmax(axis=1).tolist() for _, ids, logits in seen)
    head = runner.model.lm_head.matmul_weight
    assert sum(w is head for *_, w, _ in calls) == 6  # the head of every step, prefill and decode
    seen.clear()
    runner.model.compute_logits_and_greedy = None  # a model without it: the sampler's pass
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == fused
    assert seen and all(wanted and ids is None for wanted, ids, _ in seen)
    del runner.model.compute_logits_and_greedy
    seen.clear()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, logprobs=2), use_tqdm=False)
    assert seen and not any(wanted or ids is not None for wanted, ids, _ in seen)
    seen.clear()
    stock = runner.sampler
    runner.sampler = lambda logits, batch: stock(logits, batch)  # a notebook's tap
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == fused
    assert seen and not any(wanted or ids is not None for wanted, ids, _ in seen)
    runner.sampler = stock
    # a compute_logits replaced by a tracer (chapter 02 wraps the model's) is called at every step
    for owner in (runner.model, runner.model.lm_head):
        seen.clear()
        traced, real_logits = [], owner.compute_logits
        owner.compute_logits = lambda h, real_logits=real_logits: (traced.append(h.shape[0]), real_logits(h))[1]
        try:
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == fused
        finally:
            del owner.compute_logits
        assert traced == [3] * 6 and all(ids is None for _, ids, _ in seen)
