"""Tensor parallelism: shard layouts, and a real 2-process (gloo, CPU) run against HF."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers_models import PagedRunner, allocate_block_tables, load_hf_model, make_hf_checkpoint
from minivllm.distributed import get_tp_rank, get_tp_size, set_tp
from minivllm.layers.embedding import VocabParallelEmbedding
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear


@pytest.fixture
def tp_state():
    yield set_tp
    set_tp(0, 1)


def test_defaults_are_single_rank():
    assert (get_tp_rank(), get_tp_size()) == (0, 1)


def test_set_tp_validates():
    with pytest.raises(ValueError, match="rank"):
        set_tp(2, 2)
    with pytest.raises(ValueError, match="size"):
        set_tp(0, 0)
    assert (get_tp_rank(), get_tp_size()) == (0, 1)


def test_indivisible_heads_refused(tp_state):
    tp_state(0, 3)
    with pytest.raises(ValueError, match="num_attention_heads"):
        QKVParallelLinear(48, 16, 4, 2)
    tp_state(0, 4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        QKVParallelLinear(48, 16, 4, 2)


def test_shards_concatenate_to_full(tp_state):
    """Each rank's slice of the packed layers, reassembled, is the full checkpoint tensor."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * 4, 8, generator=gen) for n in (4, 2, 2))  # 4 heads, 2 kv, head_dim 4
    gate, up = torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)
    down = torch.randn(8, 6, generator=gen)
    emb = torch.randn(7, 8, generator=gen)  # vocab 7, padded to 8 at tp=2
    parts = {"q": [], "k": [], "v": [], "gate": [], "up": [], "down": [], "emb": []}
    for rank in range(2):
        tp_state(rank, 2)
        qkv = QKVParallelLinear(8, 4, 4, 2)
        for sid, w in zip("qkv", (q, k, v)):
            qkv.weight.weight_loader(qkv.weight, w, sid)
        lq, lk, lv = qkv.weight.split([qkv.q_size, qkv.kv_size, qkv.kv_size])
        parts["q"].append(lq), parts["k"].append(lk), parts["v"].append(lv)
        gu = MergedColumnParallelLinear(8, [6, 6])
        gu.weight.weight_loader(gu.weight, torch.cat([gate, up]))  # packed form
        lg, lu = gu.weight.chunk(2)
        parts["gate"].append(lg), parts["up"].append(lu)
        row = RowParallelLinear(6, 8)
        row.weight.weight_loader(row.weight, down)
        parts["down"].append(row.weight.clone())
        e = VocabParallelEmbedding(7, 8)
        e.weight.weight_loader(e.weight, emb)
        parts["emb"].append(e.weight.clone())
    for name, full, dim in [("q", q, 0), ("k", k, 0), ("v", v, 0), ("gate", gate, 0), ("up", up, 0),
                            ("down", down, 1)]:
        assert torch.equal(torch.cat(parts[name], dim), full), name
    padded = torch.cat(parts["emb"])
    assert padded.shape == (8, 8) and torch.equal(padded[:7], emb) and not padded[7].any()


def _tp_worker(rank: int, world: int, init_file: str, ckpt: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    set_tp(rank, world)
    torch.set_num_threads(1)
    try:
        results = {}
        for label, seed in (("loaded", None), ("random", 11)):
            runner = PagedRunner(ckpt, random_seed=seed)
            assert runner.model.num_kv_heads_per_rank == 1  # 2 kv heads over 2 ranks
            tables = allocate_block_tables([12, 6], runner.BLOCK_SIZE, runner.NUM_BLOCKS)
            a, b = list(range(3, 15)), list(range(40, 46))
            first = runner.step([a[:7], b[:5]], [0, 0], tables)
            second = runner.step([a[7:], b[5:]], [7, 5], tables)
            results[label] = [torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]])]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_match_hf_and_single_rank(tmp_path):
    # vocab 97 is odd: exercises the padded vocab shard; 4 heads / 2 kv heads / 80 intermediate split in 2.
    ckpt = make_hf_checkpoint(tmp_path, seed=5)
    init_file = tempfile.mktemp(dir=tmp_path)
    mp.spawn(_tp_worker, args=(2, init_file, str(ckpt), str(tmp_path)), nprocs=2, join=True)
    hf = load_hf_model(ckpt)
    single = PagedRunner(ckpt, random_seed=11)
    tables = allocate_block_tables([12, 6], single.BLOCK_SIZE, single.NUM_BLOCKS)
    a, b = list(range(3, 15)), list(range(40, 46))
    s1 = single.step([a[:7], b[:5]], [0, 0], tables)
    s2 = single.step([a[7:], b[5:]], [7, 5], tables)
    with torch.no_grad():
        ref = [hf(torch.tensor([a])).logits[0], hf(torch.tensor([b])).logits[0]]
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        for got, want in zip(res["loaded"], ref):
            assert got.shape == want.shape  # padded vocab column dropped
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        # random weights are drawn at full shape, so tp=2 builds the same model as tp=1
        for got, want in zip(res["random"], [torch.cat([s1[0], s2[0]]), torch.cat([s1[1], s2[1]])]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
