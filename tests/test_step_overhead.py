"""The per-step CPU shortcuts (issue 11) give exactly what the general code gives: the
vectorised decode inputs, the scheduler's counts, the output processor's skip of final-only
requests."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import minivllm.engine.model_runner as model_runner
from helpers_engine import greedy, make_llm, prompts_of, run_to_end
from minivllm import SamplingParams


def _same_input(a, b) -> None:
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("cu_seqlens_q", "cu_seqlens_k", "context_lens", "slot_mapping", "block_tables"):
        x, y = getattr(a.meta, name), getattr(b.meta, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    for name in ("max_seqlen_q", "max_seqlen_k", "block_size", "is_decode_only", "q_lens_cpu", "context_lens_cpu"):
        assert getattr(a.meta, name) == getattr(b.meta, name), name
    assert [s.request_id for s in a.sampling_seqs] == [s.request_id for s in b.sampling_seqs]
    for x, y in zip(a.host, b.host):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def _compare_every_vectorised_step(llm, monkeypatch) -> list[int]:
    """From now on, each step that takes the vectorised decode path is also prepared by the
    general path and the two inputs compared; returns the list of the compared steps' sizes."""
    runner = llm.llm_engine.runner
    original, compared = runner.prepare_input, []

    def both(plan):
        fast = original(plan)
        if plan.all_plain_decodes and len(plan.scheduled) >= model_runner._VECTOR_DECODE_MIN:
            with monkeypatch.context() as m:
                m.setattr(model_runner, "_VECTOR_DECODE_MIN", 10**9)
                _same_input(fast, original(plan))
            compared.append(len(plan.scheduled))
        return fast

    monkeypatch.setattr(runner, "prepare_input", both)
    return compared


@pytest.mark.parametrize("numpy_slots", [False, True], ids=["list-slots", "numpy-slots"])
def test_vectorised_decode_inputs_match_the_general_path(tiny_ckpt, monkeypatch, numpy_slots):
    # eager: with CPU graphs both paths stage into the graphs' buffers (test_cpu_graph compares those steps)
    if numpy_slots:  # the slot mapping from the block-table array, as for more than 32 rows
        monkeypatch.setattr(model_runner, "_LIST_SLOTS_MAX", 0)
    llm = make_llm(tiny_ckpt, block_size=4, num_kvcache_blocks=512, enforce_eager=True)
    compared = _compare_every_vectorised_step(llm, monkeypatch)
    # Prompts of different lengths: decodes cross block boundaries at different steps.
    prompts = prompts_of([3 + i for i in range(20)], seed=7)
    fast = llm.generate(prompts, greedy(9), use_tqdm=False)
    assert compared and max(compared) == 20
    monkeypatch.setattr(model_runner, "_VECTOR_DECODE_MIN", 10**9)
    slow = llm.generate(prompts, greedy(9), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in slow]


@pytest.mark.parametrize("numpy_slots", [False, True], ids=["list-slots", "numpy-slots"])
def test_kept_decode_tables_match_the_general_path_as_the_batch_shrinks_and_preempts(tiny_ckpt, monkeypatch,
                                                                                     numpy_slots):
    """The eager decode path keeps its block-table array across steps (``DecodeTables``): rows
    shift as requests finish at different steps, preempted requests come back with new tables,
    and every step's inputs still equal the general path's."""
    if numpy_slots:
        monkeypatch.setattr(model_runner, "_LIST_SLOTS_MAX", 0)
    llm = make_llm(tiny_ckpt, block_size=4, num_kvcache_blocks=40, enforce_eager=True)
    compared = _compare_every_vectorised_step(llm, monkeypatch)
    engine = llm.llm_engine
    for i, p in enumerate(prompts_of([3 + i % 5 for i in range(14)], seed=8)):
        engine.add_request(f"k{i}", p, SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True))
    preempted = 0
    while engine.has_unfinished_requests():
        engine.step()
        preempted += len(engine.last_step_record.preempted)
    assert preempted and len(set(compared)) >= 3


def test_numpy_slot_mapping_refuses_a_table_without_the_block_of_its_position(tiny_ckpt, monkeypatch):
    """A corrupt table (a -1 where the position's block should be, as past a row's blocks in the
    table array) must fail the step, rolled back, not write KV at a negative slot."""
    monkeypatch.setattr(model_runner, "_LIST_SLOTS_MAX", 0)
    llm = make_llm(tiny_ckpt, block_size=4, num_kvcache_blocks=512, enforce_eager=True)
    engine = llm.llm_engine
    for i, p in enumerate(prompts_of([6 + i for i in range(12)], seed=3)):
        engine.add_request(f"r{i}", p, greedy(20))
    engine.step()  # the prefills
    engine.step()
    # a sequence whose next position is in a block it holds (not one the next step grows)
    seq = next(s for s in engine.scheduler.running if (len(s) - 1) // 4 < len(s.block_table))
    last = (len(seq) - 1) // 4
    block, seq.block_table[last] = seq.block_table[last], -1
    seq.table_version += 1
    with pytest.raises(RuntimeError, match="corrupt"):
        engine.step()
    seq.block_table[last] = block
    seq.table_version += 1
    final, _ = run_to_end(engine)
    assert len(final) == 12


def test_step_record_counts_match_the_scheduled_entries(tiny_ckpt):
    """StepRecord counts come from the scheduler's tallies, not a pass over the entries:
    they must agree with the entries for mixed prefill/decode steps and preemptions."""
    llm = make_llm(tiny_ckpt, num_kvcache_blocks=14, max_num_batched_tokens=12, max_num_seqs=3)
    engine = llm.llm_engine
    for i, p in enumerate(prompts_of([3, 14, 6, 20], seed=5)):
        engine.add_request(f"r{i}", p, greedy(16))
    _, records = run_to_end(engine)
    assert any(r.preempted for r in records) and any(r.phase == "mixed" for r in records)
    for r in records:
        assert r.num_prefill_tokens == sum(e.num_tokens for e in r.scheduled if e.is_prefill)
        assert r.num_decode_tokens == sum(e.num_tokens for e in r.scheduled if not e.is_prefill)
        assert r.num_prefill_chunks == sum(1 for e in r.scheduled if e.is_prefill)
        assert r.num_seqs == len(r.scheduled)
        assert [e.is_prefill for e in r.scheduled] == sorted(e.is_prefill for e in r.scheduled)  # decodes first


def test_final_only_requests_mixed_with_streamed_ones_give_the_same_outputs(tiny_ckpt):
    """process() skips final-only requests until they finish; a stop string still ends one."""
    prompts = prompts_of([5, 9, 4], seed=2)
    kinds = ["final_only", "delta", "final_only"]
    reference = make_llm(tiny_ckpt).generate(prompts, greedy(12), use_tqdm=False)
    llm = make_llm(tiny_ckpt)  # kept: the engine shuts down with its LLM
    engine = llm.llm_engine
    for i, (p, kind) in enumerate(zip(prompts, kinds)):
        engine.add_request(f"r{i}", p, greedy(12), output_kind=kind)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():  # delta outputs carry only the new tokens
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert [tokens[f"r{i}"] for i in range(3)] == [o.outputs[0].token_ids for o in reference]
    text = reference[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if stop.strip():
        engine.add_request("s", prompts[0], SamplingParams(temperature=0, max_tokens=12, stop=[stop]),
                           output_kind="final_only")
        final, _ = run_to_end(engine)
        assert final["s"].outputs[0].finish_reason == "stop" and stop not in final["s"].outputs[0].text


def test_overhead_ab_script_runs_two_trees_in_one_process():
    """scripts/overhead_ab.py (a subprocess: it swaps the imported minivllm package)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "scripts/overhead_ab.py", root, root, "--batch-sizes", "2",
                          "--steps", "3", "--prompt-len", "8"], cwd=root, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "batch    2 us/seq/step" in out.stdout and "median ratio" in out.stdout


def test_decode_tables_rewrite_changed_rows_and_everything_after_a_failed_build():
    from minivllm.engine.decode_tables import DecodeTables

    dt = DecodeTables()
    assert dt.build([[1, 2], [3]], [10, 11]).tolist() == [[1, 2], [3, -1]]
    # same versions: the kept rows stand (a version is the promise that the table is the same)
    assert dt.build([[9, 9], [9]], [10, 11]).tolist() == [[1, 2], [3, -1]]
    assert dt.build([[1, 2], [3, 4]], [10, 12]).tolist() == [[1, 2], [3, 4]]
    assert dt.build([[5], [6]], [13, 14]).tolist() == [[5], [6]]  # narrower: a new array
    # fails at its second row (numpy refuses the value): no row's version counts as written
    with pytest.raises(ValueError):
        dt.build([[5], ["not a block id"]], [13, 16])
    assert dt.build([[5], [8]], [13, 16]).tolist() == [[5], [8]]
    many = [[i, i + 1] for i in range(12)]
    assert dt.build(many, list(range(100, 112))).tolist() == many  # more than a few rows: one vectorised build
