"""minivllm.bench.step_breakdown: a decode step's time split from its StepRecord and its graph's timed calls."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from minivllm.bench.step_breakdown import breakdown, category, print_breakdown
from minivllm.layers.cpu_graph import ReplayTiming


def test_category_by_call_name():
    assert category("panel_gemm_parallel_w") == category("panel_gemm_greedy_w") == "linears"
    assert category("paged_decode_attention_f32") == category("paged_decode_attention_bf16") == "attention"
    for name in ("paged_store_kv_f32", "rms_norm_f32", "qk_norm_rope_f32", "memmove", "aten.embedding.out"):
        assert category(name) == "other"


def _timing(gemm_ms, attention_ms, other_ms):
    names = ("embedding_f32", "panel_gemm_parallel_w", "paged_decode_attention_f32", "panel_gemm_parallel_w")
    ms = (other_ms, gemm_ms / 2, attention_ms, gemm_ms / 2)
    return ReplayTiming(names, np.array([round(t * 1e6) for t in ms], dtype=np.int64), True)


def test_breakdown_medians_per_part():
    recs = [SimpleNamespace(wall_ms=w, model_ms=m) for w, m in ((4.0, 3.6), (5.0, 4.4), (4.2, 3.8))]
    timings = [[_timing(2.0, 0.8, 0.1)], [_timing(2.4, 1.0, 0.2)], [_timing(2.2, 0.9, 0.1)]]
    b = breakdown(recs, timings)
    assert b["num_steps"] == 3 and b["from_c"]
    assert b["step"] == pytest.approx(4.2) and b["linears"] == pytest.approx(2.2)
    assert b["attention"] == pytest.approx(0.9) and b["other"] == pytest.approx(0.1)
    assert b["graph"] == pytest.approx(3.2)  # the steps' graphs: 2.9, 3.6, 3.2
    assert b["lm_head"] == pytest.approx(0.7)  # model_ms less the graph: 0.7, 0.8, 0.6
    assert b["engine"] == pytest.approx(0.4)  # wall less model_ms: 0.4, 0.6, 0.4


def test_no_breakdown_without_a_replay_per_step():
    recs = [SimpleNamespace(wall_ms=1.0, model_ms=0.8)] * 2
    assert breakdown(recs, [[_timing(0.3, 0.1, 0.1)]]) is None  # a step ran without replaying a graph
    assert breakdown(recs, [[_timing(0.3, 0.1, 0.1)], []]) is None
    assert breakdown([], []) is None


def test_every_graph_a_step_replays_counts():
    """A step with a draft model replays the draft's graphs before the target's: the sweep kept only the
    first (a draft's), and the target's graph went into the LM head's column (a review)."""
    draft, target = _timing(0.1, 0.02, 0.01), _timing(2.0, 0.8, 0.1)
    b = breakdown([SimpleNamespace(wall_ms=4.0, model_ms=3.6)], [[draft, draft, target]])
    assert b["linears"] == pytest.approx(2.2) and b["attention"] == pytest.approx(0.84)
    assert b["lm_head"] == pytest.approx(3.6 - 2.2 - 0.84 - 0.12)


def test_print_breakdown_rows_only_for_points_that_have_one():
    lines = []
    b = breakdown([SimpleNamespace(wall_ms=4.0, model_ms=3.6)], [[_timing(2.0, 0.8, 0.1)]])
    print_breakdown([{"batch_size": 1, "breakdown": None}, {"batch_size": 32, "breakdown": b}], lines.append)
    assert len(lines) == 3 and "from C" in lines[0]
    assert lines[2].split() == ["32", "4.00", "2.00", "0.80", "0.10", "0.70", "0.40"]
    lines.clear()
    print_breakdown([{"batch_size": 1, "breakdown": None}], lines.append)
    assert lines == []
