"""CUDA-graph bucket choice and padding (plain functions), and the runner's buffer plumbing.

No GPU here: the runner is exercised with ``emulate=True`` (replay re-runs the forward
eagerly on the static buffers) on a tiny Qwen3 with the triton backend under the Triton
interpreter, and compared with an eager forward of the unpadded step.
"""
from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported (see test_triton_kernels)

import pytest  # noqa: E402
import torch  # noqa: E402

from minivllm.engine.cuda_graph import (  # noqa: E402
    CPU_MAX_CAPTURE_SIZE,
    CudaGraphDecodeRunner,
    DecodeBatch,
    capture_batch_sizes,
    cpu_capture_batch_sizes,
    pad_decode_batch,
    select_bucket,
)
from minivllm.layers.attention.context import ForwardContext  # noqa: E402
from minivllm.layers.attention.metadata import AttentionMetadata  # noqa: E402
from minivllm.utils import cdiv  # noqa: E402


# ---------------------------------------------------------------------------- buckets
def test_capture_batch_sizes():
    assert capture_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    big = capture_batch_sizes(1000, max_capture_size=512)
    assert big[-1] == 512 and big == sorted(set(big))
    assert all(b % 8 == 0 for b in big[4:])


def test_cpu_capture_batch_sizes_are_every_size():
    assert cpu_capture_batch_sizes(5) == [1, 2, 3, 4, 5]
    assert cpu_capture_batch_sizes(256) == list(range(1, CPU_MAX_CAPTURE_SIZE + 1))
    assert cpu_capture_batch_sizes(100, max_capture_size=3) == [1, 2, 3]
    for bad in (0, -1):
        with pytest.raises(ValueError, match=str(bad)):
            cpu_capture_batch_sizes(bad)
        with pytest.raises(ValueError, match=str(bad)):
            cpu_capture_batch_sizes(4, max_capture_size=bad)


@pytest.mark.parametrize("bad", [0, -3])
def test_capture_batch_sizes_rejects_bad_max(bad):
    with pytest.raises(ValueError, match=str(bad)):
        capture_batch_sizes(bad)


def test_select_bucket():
    buckets = capture_batch_sizes(32)
    assert select_bucket(1, buckets) == 1
    assert select_bucket(3, buckets) == 4
    assert select_bucket(8, buckets) == 8
    assert select_bucket(9, buckets) == 16
    assert select_bucket(17, buckets) == 24
    assert select_bucket(32, buckets) == 32
    # larger than the largest bucket: run eagerly (None), never StopIteration
    assert select_bucket(33, buckets) is None
    assert select_bucket(1000, buckets) is None
    assert select_bucket(5, [8, 1, 4]) == 8  # order does not matter
    with pytest.raises(ValueError, match="batch_size"):
        select_bucket(0, buckets)


# ---------------------------------------------------------------------------- padding
def _step(n, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (n,), generator=g)
    ctx = torch.randint(1, width * 16, (n,), generator=g).to(torch.int32)
    pos = ctx.long() - 1
    tables = torch.randint(0, 50, (n, width), generator=g).to(torch.int32)
    slots = tables[torch.arange(n), pos // 16].long() * 16 + pos % 16
    return ids, pos, slots, ctx, tables


def test_pad_decode_batch_pads_rows_and_widens_table():
    ids, pos, slots, ctx, tables = _step(3, 2)
    max_model_len, block_size = 100, 16
    max_blocks = cdiv(max_model_len, block_size)  # 7
    b = pad_decode_batch(ids, pos, slots, ctx, tables, bucket=4, max_blocks_per_seq=max_blocks)
    assert b.input_ids.shape == (4,) and b.input_ids.dtype == torch.int64
    assert b.block_tables.shape == (4, max_blocks) and b.block_tables.dtype == torch.int32
    assert torch.equal(b.input_ids[:3], ids) and b.input_ids[3] == 0
    assert torch.equal(b.positions[:3], pos) and b.positions[3] == 0
    assert torch.equal(b.slot_mapping[:3], slots)
    assert b.slot_mapping[3] == -1  # padding writes no KV
    assert torch.equal(b.context_lens[:3], ctx) and b.context_lens[3] == 1
    assert torch.equal(b.block_tables[:3, :2], tables)
    assert (b.block_tables[:3, 2:] == -1).all()
    assert b.block_tables[3].tolist() == [0] + [-1] * (max_blocks - 1)
    assert b.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert b.cu_seqlens_k.tolist() == [0] + torch.cumsum(torch.cat([ctx, torch.ones(1, dtype=torch.int32)]), 0).tolist()
    assert b.cu_seqlens_k.dtype == torch.int32


def test_pad_decode_batch_full_length_sequence_fits():
    # a decode at position max_model_len - 1 needs every block of the static table
    max_model_len, block_size = 64, 16
    max_blocks = max_model_len // block_size
    tables = torch.arange(max_blocks, dtype=torch.int32)[None]
    b = pad_decode_batch(torch.tensor([7]), torch.tensor([max_model_len - 1]),
                         torch.tensor([(max_blocks - 1) * block_size + 15]),
                         torch.tensor([max_model_len], dtype=torch.int32), tables, 2, max_blocks)
    assert b.block_tables[0].tolist() == list(range(max_blocks))
    with pytest.raises(ValueError, match="wider than max_blocks_per_seq=3"):
        pad_decode_batch(torch.tensor([7]), torch.tensor([0]), torch.tensor([0]),
                         torch.tensor([1], dtype=torch.int32), tables, 2, max_blocks - 1)


def test_pad_decode_batch_into_static_buffers_clears_stale_rows():
    buf = DecodeBatch.allocate(8, 5, "cpu")
    pad_decode_batch(*_step(6, 5, seed=1), bucket=8, max_blocks_per_seq=5, out=buf)
    ids, pos, slots, ctx, tables = _step(2, 3, seed=2)
    b = pad_decode_batch(ids, pos, slots, ctx, tables, bucket=4, max_blocks_per_seq=5, out=buf)
    assert b.input_ids.data_ptr() == buf.input_ids.data_ptr()  # views of the static buffers
    assert b.slot_mapping.tolist() == slots.tolist() + [-1, -1]
    assert b.context_lens.tolist() == ctx.tolist() + [1, 1]
    assert (b.block_tables[:2, 3:] == -1).all()  # the earlier, wider rows are gone
    assert b.block_tables[2:].tolist() == [[0, -1, -1, -1, -1]] * 2


def test_pad_decode_batch_rejects_bad_input():
    ids, pos, slots, ctx, tables = _step(3, 2)
    with pytest.raises(ValueError, match="does not fit bucket 2"):
        pad_decode_batch(ids, pos, slots, ctx, tables, bucket=2, max_blocks_per_seq=4)
    with pytest.raises(ValueError, match="positions has 2 rows"):
        pad_decode_batch(ids, pos[:2], slots, ctx, tables, bucket=4, max_blocks_per_seq=4)
    with pytest.raises(ValueError, match="cannot hold bucket 16"):
        pad_decode_batch(ids, pos, slots, ctx, tables, 16, 4, out=DecodeBatch.allocate(8, 4, "cpu"))


# ---------------------------------------------------------------------------- runner (emulated)
class _HostPlannedBackend:
    name = "torch"


def test_runner_refuses_backends_that_plan_on_the_host():
    with pytest.raises(ValueError, match="cannot be captured"):
        CudaGraphDecodeRunner(None, [(torch.zeros(1, 16, 1, 8),) * 2], _HostPlannedBackend(),
                              4, 2, 8, "cpu", torch.float32, emulate=True)


def test_runner_on_cpu_records_cpu_graphs_only_for_backends_that_support_them():
    pytest.importorskip("triton")
    if "minivllm.layers.attention.triton_kernels" in sys.modules:
        importlib.reload(sys.modules["minivllm.layers.attention.triton_kernels"])
    from minivllm.layers.attention.triton_backend import TritonAttentionBackend

    with pytest.raises(ValueError, match="CPU graph"):
        CudaGraphDecodeRunner(None, [(torch.zeros(1, 16, 1, 8),) * 2], TritonAttentionBackend(),
                              4, 2, 8, "cpu", torch.float32)
    with pytest.raises(ValueError, match="CUDA or CPU device"):
        CudaGraphDecodeRunner(None, [(torch.zeros(1, 16, 1, 8),) * 2], TritonAttentionBackend(),
                              4, 2, 8, "meta", torch.float32)


def _tiny_model():
    from transformers import Qwen3Config

    from minivllm.models.qwen3 import Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.3 * z if "norm" in name else 0.15 * z)
    return model, cfg


def _meta(q_lens, ctx_lens, slots, tables, width, block_size):
    t = torch.full((len(tables), width), -1, dtype=torch.int32)
    for i, row in enumerate(tables):
        t[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(ctx_lens).cumsum(0).tolist(), dtype=torch.int32)
    return AttentionMetadata(cu_q, cu_k, torch.tensor(ctx_lens, dtype=torch.int32),
                             torch.tensor(slots, dtype=torch.int64), t, max(q_lens), max(ctx_lens),
                             block_size, max(q_lens) == 1, list(q_lens), list(ctx_lens))


def test_emulated_runner_matches_eager_decode_and_writes_no_padding_kv():
    pytest.importorskip("triton")
    if "minivllm.layers.attention.triton_kernels" in sys.modules:
        importlib.reload(sys.modules["minivllm.layers.attention.triton_kernels"])
    from minivllm.engine.kv_cache import allocate_kv_cache
    from minivllm.layers.attention.triton_backend import TritonAttentionBackend

    torch.manual_seed(0)
    model, cfg = _tiny_model()
    block_size, max_model_len = 16, 64
    max_blocks = max_model_len // block_size
    backend = TritonAttentionBackend()
    _, kv = allocate_kv_cache(cfg, 16, block_size, torch.float32, "cpu")

    # Prefill three prompts (lengths 5, 17, 9) eagerly; block 0 is left unused so that
    # the padded rows' reads of block 0 never touch a real sequence.
    prompts = [[3, 1, 4, 1, 5], list(range(1, 18)), [2, 7, 1, 8, 2, 8, 1, 8, 2]]
    tables = [[5], [9, 2], [7]]
    ids, pos, slots = [], [], []
    for p, tab in zip(prompts, tables):
        ids += p
        pos += list(range(len(p)))
        slots += [tab[i // block_size] * block_size + i % block_size for i in range(len(p))]
    lens = [len(p) for p in prompts]
    meta = _meta(lens, lens, slots, tables, 2, block_size)
    with torch.inference_mode():
        model(torch.tensor(ids), torch.tensor(pos), ForwardContext(meta, backend, kv))

    # One decode step for the three sequences: eager on a copy of the cache, then through
    # the runner (bucket 4: one padded row).
    new_ids = torch.tensor([11, 12, 13])
    new_pos = torch.tensor(lens)
    new_slots = [tab[n // block_size] * block_size + n % block_size for tab, n in zip(tables, lens)]
    dmeta = _meta([1, 1, 1], [n + 1 for n in lens], new_slots, tables, 2, block_size)
    kv_eager = [(k.clone(), v.clone()) for k, v in kv]
    with torch.inference_mode():
        expected = model(new_ids, new_pos, ForwardContext(dmeta, backend, kv_eager)).clone()

    runner = CudaGraphDecodeRunner(model, kv, backend, max_num_seqs=8, max_blocks_per_seq=max_blocks,
                                   hidden_size=cfg.hidden_size, device="cpu", dtype=torch.float32,
                                   emulate=True)
    runner.capture()
    assert runner.buckets == [1, 2, 4, 8]
    assert runner.can_run(dmeta)
    got = runner.run(new_ids, new_pos, dmeta)
    assert got.shape == (3, cfg.hidden_size)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    written = torch.zeros(16 * block_size, dtype=torch.bool)
    written[new_slots] = True
    for (k, v), (ke, ve) in zip(kv, kv_eager):
        for c, ce in ((k, ke), (v, ve)):
            flat, flat_e = c.reshape(16 * block_size, -1), ce.reshape(16 * block_size, -1)
            # the padded row wrote nothing: every other slot is bit-identical
            assert torch.equal(flat[~written], flat_e[~written])
            # the real rows wrote the same K/V (batch 4 vs 3 matmuls differ in rounding)
            torch.testing.assert_close(flat[written], flat_e[written], atol=1e-5, rtol=1e-5)

    # A prefill step, or a batch above the largest bucket, is refused (runs eagerly).
    assert not runner.can_run(meta)
    big = _meta([1] * 9, [1] * 9, list(range(9)), [[0]] * 9, 1, block_size)
    assert not runner.can_run(big)
    with pytest.raises(ValueError, match="cannot run in a CUDA graph"):
        runner.run(torch.zeros(9, dtype=torch.long), torch.zeros(9, dtype=torch.long), big)
