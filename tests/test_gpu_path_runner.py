"""GPU-path fixes in the model runner, checked on the CPU with stand-ins (issue 15):
``torch.cuda.set_device`` is called for the chosen device, KV sizing from
``torch.cuda.mem_get_info`` profiles the resolved step budget plus a ``max_num_seqs``
sampling pass, the block-table fill is vectorised, and TP's ``pack_step`` reuses the host
arrays instead of reading the device copies back."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.engine import model_runner as mr
from minivllm.engine.cuda_graph import fill_block_tables


def test_select_device_sets_the_current_cuda_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(d))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert mr.select_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert mr.select_device(torch.device("cuda")) == torch.device("cuda", 3)  # index filled in
    assert mr.select_device(torch.device("cpu")) == torch.device("cpu")
    assert calls == [torch.device("cuda", 1), torch.device("cuda", 3)]


def test_kv_budget_counts_memory_outside_pytorch_and_the_graph_pool():
    gib = 2**30
    # 100 GiB device, 0.9 usable; 1 GiB outside PyTorch (context, workspaces), peak 12 GiB
    # of which 2 GiB was scratch KV, 0.5 GiB held for the graph pool
    got = mr.kv_budget_bytes(total=100 * gib, free=100 * gib - 1 * gib - 20 * gib, reserved=20 * gib,
                             peak_allocated=12 * gib, scratch_bytes=2 * gib, graph_reserve=gib // 2,
                             gpu_util=0.9)
    assert got == int(90 * gib - 1 * gib - 10 * gib - gib // 2)
    with pytest.raises(ValueError, match="gpu_util"):
        mr.kv_budget_bytes(1, 1, 0, 0, 0, 0, 1.5)


class _FakeCudaMemory:
    """Stands in for torch.cuda's memory queries during a CPU profile."""

    def __init__(self, monkeypatch, total=64 * 2**30, outside=2**30):
        self.total, self.outside = total, outside
        for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 5 * 2**30)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 4 * 2**30)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 6 * 2**30)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (total - outside - 6 * 2**30, total))


def test_memory_profile_runs_the_resolved_budget_and_a_sampling_pass(tiny_ckpt, monkeypatch):
    from minivllm.utils.model_source import resolve_model

    runner = mr.ModelRunner(mr.RunnerConfig(
        source=resolve_model(str(tiny_ckpt)), device=torch.device("cpu"), dtype=torch.float32,
        attention_backend="torch", block_size=16, num_kvcache_blocks=8, kv_cache_memory_bytes=None,
        gpu_memory_utilization=0.9, max_num_batched_tokens=64, seed=0, max_num_seqs=5))
    seen = []
    real_model = runner.model

    class Recorder(torch.nn.Module):  # records each forward's token count, skips the compute
        def forward(self, ids, pos, ctx):
            seen.append((int(ids.numel()), ctx.meta.num_seqs))
            return torch.zeros(ids.numel(), runner.hf_config.hidden_size)

        def compute_logits(self, h):
            return real_model.compute_logits(h)

    runner.model = Recorder()
    sampled = []
    real_sampler = runner.sampler
    runner.sampler = lambda logits, batch: sampled.append((tuple(logits.shape), batch.any_top_p)) or \
        real_sampler(logits, batch)
    _FakeCudaMemory(monkeypatch)
    blocks = runner._blocks_from_gpu_memory(0.9, 10_000)  # above the old 8192-token cap
    assert seen == [(10_000, 1), (5, 5)]
    assert sampled == [((5, runner.hf_config.vocab_size), True)]
    per_block = mr.kv_bytes_per_token(runner.hf_config, torch.float32) * 16
    scratch = (-(-10_000 // 16) + 5) * per_block
    expected = mr.kv_budget_bytes(64 * 2**30, 64 * 2**30 - 2**30 - 6 * 2**30, 6 * 2**30, 5 * 2**30, scratch,
                                  2**30, 0.9) // per_block
    assert blocks == expected


def test_engine_profiles_max_model_len_when_chunked_prefill_is_off(tiny_ckpt, monkeypatch, tmp_path):
    from minivllm import LLM

    got = {}
    real_init = mr.ModelRunner.__init__

    def spy(self, config):
        got["budget"], got["max_num_seqs"] = config.max_num_batched_tokens, config.max_num_seqs
        real_init(self, config)

    monkeypatch.setattr(mr.ModelRunner, "__init__", spy)
    from helpers_models import make_hf_checkpoint

    long_ckpt = make_hf_checkpoint(tmp_path, max_position_embeddings=16384)
    with LLM(str(long_ckpt), device="cpu", enable_chunked_prefill=False, max_model_len=9000,
             num_kvcache_blocks=600, max_num_seqs=7, compile=False):
        assert got == {"budget": 9000, "max_num_seqs": 7}
    # an explicit max_model_len above the model's positions is capped to them, and so is the profile
    with LLM(str(tiny_ckpt), device="cpu", enable_chunked_prefill=False, max_model_len=9000,
             num_kvcache_blocks=600, max_num_seqs=7, compile=False):
        assert got == {"budget": 8192, "max_num_seqs": 7}


def test_fill_block_tables_matches_the_row_loop():
    rng = np.random.default_rng(0)
    tables = [list(rng.integers(0, 1000, size=n)) for n in (3, 0, 7, 1)]
    out = np.zeros((4, 9), dtype=np.int32)
    fill_block_tables(out, tables)
    want = np.full((4, 9), -1, dtype=np.int32)
    for i, t in enumerate(tables):
        want[i, :len(t)] = t
    assert np.array_equal(out, want)
    with pytest.raises(ValueError, match="width"):
        fill_block_tables(np.zeros((1, 2), dtype=np.int32), [[1, 2, 3]])


def test_pack_step_from_host_arrays_equals_the_device_read_back(tiny_ckpt):
    from minivllm import LLM, SamplingParams
    from minivllm.executor.worker import pack_step

    llm = LLM(str(tiny_ckpt), device="cpu", num_kvcache_blocks=64, compile=False, block_size=16)
    eng = llm.llm_engine
    for i, n in enumerate((5, 40, 17)):
        eng.add_request(str(i), list(range(1, n + 1)), SamplingParams(max_tokens=2))
    inp = eng.runner.prepare_input(eng.scheduler.schedule())
    assert inp.host is not None
    header, payload = pack_step(inp)
    inp.host = None  # the old path: read every tensor back
    header2, payload2 = pack_step(inp)
    llm.shutdown()
    assert torch.equal(header, header2) and torch.equal(payload, payload2)


def test_step_tensors_start_on_16_byte_boundaries(tiny_ckpt):
    """Triton specialises on pointer alignment; views into the step's shared upload buffers
    must all be 16-byte aligned whatever the token and sequence counts."""
    from minivllm import LLM, SamplingParams

    llm = LLM(str(tiny_ckpt), device="cpu", num_kvcache_blocks=64, compile=False, block_size=16)
    eng = llm.llm_engine
    for i, n in enumerate((5, 4)):  # 9 tokens, 2 sequences: odd counts
        eng.add_request(str(i), list(range(1, n + 1)), SamplingParams(max_tokens=2))
    inp = eng.runner.prepare_input(eng.scheduler.schedule())
    llm.shutdown()
    m = inp.meta
    for name, t in (("input_ids", inp.input_ids), ("positions", inp.positions), ("slot_mapping", m.slot_mapping),
                    ("logits_indices", inp.logits_indices), ("cu_seqlens_q", m.cu_seqlens_q),
                    ("cu_seqlens_k", m.cu_seqlens_k), ("context_lens", m.context_lens)):
        assert (t.storage_offset() * t.element_size()) % 16 == 0, name
    assert m.cu_seqlens_k.tolist() == [0, 5, 9] and m.context_lens.tolist() == [5, 4]
