"""Decode CUDA graphs (emulated on the CPU): one host-padded upload per step, context-length
buckets that bound the Triton decode kernel's KV splits, replay counting (issue 15)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.engine.cuda_graph import CudaGraphDecodeRunner, StagingLayout
from minivllm.layers.attention.metadata import AttentionMetadata


class _Backend:
    """Records the metadata each (emulated) graph forward sees; asks for context buckets."""

    name = "fake"
    supports_cuda_graphs = True

    def __init__(self, bounds=()):
        self.bounds = list(bounds)
        self.seen: list[tuple[int, int]] = []

    def decode_context_buckets(self, num_seqs, max_seqlen_k, k_cache):
        return self.bounds

    def prepare(self, meta: AttentionMetadata) -> None:
        self.seen.append((meta.num_seqs, meta.max_seqlen_k))


def _runner(bounds=(), max_num_seqs=8, width=4):
    backend = _Backend(bounds)
    kv = [(torch.zeros(8, 16, 1, 8), torch.zeros(8, 16, 1, 8))]

    def model(ids, pos, ctx):  # the runner calls backend.prepare before each forward
        # hidden row = (id, position, slot, context length, first block) so the test can read the inputs back
        m = ctx.meta
        return torch.stack([ids.float(), pos.float(), m.slot_mapping.float(), m.context_lens.float(),
                            m.block_tables[:, 0].float()], dim=1)

    r = CudaGraphDecodeRunner(model, kv, backend, max_num_seqs, width, 5, "cpu", torch.float32, emulate=True)
    r.capture()
    return r, backend


def test_staging_layout_aligns_fields_and_puts_the_table_last():
    lay = StagingLayout(rows=5, width=3)
    offs = {k: v[0] for k, v in lay.offsets.items()}
    assert all(o % 16 == 0 for o in offs.values())
    assert max(offs, key=offs.get) == "block_tables"
    assert lay.step_bytes(2) == offs["block_tables"] + 2 * 3 * 4
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    views = lay.views(buf)
    assert views["block_tables"].shape == (5, 3) and views["cu_seqlens_k"].shape == (6,)
    views["positions"][:] = 7
    assert int(views["input_ids"].sum()) == 0  # fields do not overlap


def test_stage_pads_on_the_host_and_uploads_once():
    r, backend = _runner()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        n = r.stage(np.array([11, 12, 13]), np.array([4, 20, 8]), np.array([20, 33, 40]),
                    np.array([5, 21, 9], dtype=np.int32), [[1], [2, 3], [2]])
    copies = [e for e in prof.events() if e.name == "aten::copy_"]
    # expected device work per staged decode step: one copy (host mirror -> static buffer)
    assert len(copies) == 1
    hidden = r.replay(n)
    assert hidden.tolist() == [[11, 4, 20, 5, 1], [12, 20, 33, 21, 2], [13, 8, 40, 9, 2]]
    # the padded row (bucket 4) writes no KV and reads one key in block 0
    b = r._buf.rows(4)
    assert b.slot_mapping[3].item() == -1 and b.context_lens[3].item() == 1 and b.block_tables[3, 0].item() == 0
    assert b.cu_seqlens_k.tolist() == [0, 5, 26, 35, 36]
    assert r.num_replays == 1
    # a smaller step after a larger one: the stale rows become padding again
    r.stage(np.array([9]), np.array([0]), np.array([16]), np.array([1], dtype=np.int32), [[1]])
    r.stage(np.array([9, 9]), np.array([0, 0]), np.array([16, 17]), np.array([1, 2], dtype=np.int32), [[1], [1]])
    assert r.replay(2).shape == (2, 5)
    assert r._buf.rows(2).slot_mapping.tolist() == [16, 17]
    with pytest.raises(ValueError, match="staged step has 2"):
        r.replay(3)
    with pytest.raises(ValueError, match="fits no bucket"):
        r.stage(np.zeros(9), np.zeros(9), np.zeros(9), np.ones(9, dtype=np.int32), [[0]] * 9)


def test_context_buckets_pick_the_smallest_graph_that_covers_the_step():
    r, backend = _runner(bounds=(16, 32))  # static width 4 blocks x 16 = 64 tokens
    assert (1, 16) in r.graph_keys and (1, 32) in r.graph_keys and (1, 64) in r.graph_keys
    assert r.context_buckets[8] == [16, 32, 64]
    for ctx, bound in ((5, 16), (16, 16), (17, 32), (40, 64)):
        backend.seen.clear()
        r.stage(np.array([1]), np.array([ctx - 1]), np.array([3]), np.array([ctx], dtype=np.int32), [[1, 2, 3]])
        r.replay(1)
        assert backend.seen == [(1, bound)]


def test_triton_decode_context_buckets_bound_the_splits():
    pytest.importorskip("triton")
    from minivllm.layers.attention import triton_kernels as tk

    # H200-like: 132 SMs; batch 1, 8 KV heads, head_dim 128 (32-key tiles, >= 4 tiles per split)
    bounds = tk.decode_context_buckets(132, 1, 8, 128, 40960)
    assert bounds == [128, 256, 512, 1024, 40960]
    splits = [tk.num_decode_splits(132, 1, 8, b, 32) for b in bounds]
    assert splits == [1, 2, 4, 8, tk.MAX_SPLITS]
    # a 129-token context replays the 256-token graph: 2 splits instead of MAX_SPLITS
    assert tk.num_decode_splits(132, 1, 8, 256, 32) == 2
    # a large batch already fills the GPU: one graph
    assert tk.decode_context_buckets(132, 64, 8, 128, 40960) == [40960]
    assert tk.decode_context_buckets(None, 1, 8, 128, 40960) == [40960]  # CPU / interpreter
    with pytest.raises(ValueError, match="max_seqlen_k"):
        tk.decode_context_buckets(132, 1, 8, 128, 0)


def test_an_interrupt_while_staging_leaves_no_stale_padding_row(monkeypatch):
    """Regression: an interrupt after a step's rows were written but before stage() finished kept
    the old row count as staged, so the next step of that count skipped refilling its padding rows,
    and a padding row went on writing K/V at a slot of the interrupted step's (now another
    sequence's) block on every replay. (CUDA buckets: CPU graphs have one per batch size, no
    padding rows.)"""
    from minivllm.engine import cuda_graph

    r, _ = _runner(max_num_seqs=16)
    r.stage([1, 2, 3], [7, 7, 7], [1, 2, 3], [8, 8, 8], [[0], [1], [2]])  # bucket 4 staged with 3 rows
    real = cuda_graph.fill_block_tables

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(cuda_graph, "fill_block_tables", interrupted)
    with pytest.raises(KeyboardInterrupt):  # 10 rows: the vectorised fill, after ids/positions/slots
        r.stage(list(range(10)), [40] * 10, list(range(100, 110)), [41] * 10, [[5, 6, 7]] * 10)
    monkeypatch.setattr(cuda_graph, "fill_block_tables", real)
    r.stage([1, 2, 3], [7, 7, 7], [1, 2, 3], [8, 8, 8], [[0], [1], [2]])
    assert list(r._host["slot_mapping"][3:4]) == [-1]  # the padding row is padding again
