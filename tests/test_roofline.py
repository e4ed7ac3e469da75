"""Roofline FLOP/byte accounting checked against a hand computation and against
torch's FlopCounterMode on a real transformers Qwen3 model of the same config."""
import pytest
import torch

from minivllm.telemetry.peaks import Peaks
from minivllm.telemetry.roofline import (
    ModelCost, arithmetic_intensity, attended_keys, dtype_nbytes, entries_from_record, fill_step_record, step_cost)
from minivllm.telemetry.step_record import ScheduledEntry, StepRecord

# D=8, F=16, L=2, H=4, Hkv=2, d=4, V=32, untied, fp32.
SMALL = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=4, vocab_size=32, tie_word_embeddings=False,
             attention_bias=False)


def small_cost(**kw):
    return ModelCost.from_config(SMALL, dtype="float32", **kw)


def test_static_counts_by_hand():
    c = small_cost()
    # per layer: q 8*16=128, k 8*8=64, v 64, o 16*8=128, gate+up+down 3*8*16=384 -> 768
    assert c.layer_matmul_params == 128 + 64 + 64 + 128 + 384 == 768
    assert c.matmul_params == 2 * 768 == 1536
    # norms: 2 layers * (input 8 + post-attn 8 + q_norm 4 + k_norm 4) + final 8
    assert c.norm_params == 2 * (8 + 8 + 4 + 4) + 8 == 56
    assert c.lm_head_params == c.embedding_params == 8 * 32 == 256
    assert c.num_params == 1536 + 56 + 256 + 256
    assert c.body_weight_bytes == (1536 + 56) * 4 == 6368
    assert c.lm_head_bytes == 256 * 4 == 1024
    # K and V * 2 layers * 2 kv heads * head_dim 4 * 4 bytes
    assert c.kv_bytes_per_token == 2 * 2 * 2 * 4 * 4 == 128


def test_param_count_matches_transformers_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    for tie in (False, True):
        model = Qwen3ForCausalLM(Qwen3Config(**{**SMALL, "tie_word_embeddings": tie}))
        n = sum(p.numel() for p in model.parameters())  # tied matrix counted once
        assert ModelCost.from_config(model.config).num_params == n


def test_attended_keys_causal():
    # positions 2,3,4 attend to 3,4,5 keys
    assert attended_keys(3, 5) == 3 + 4 + 5
    assert attended_keys(1, 7) == 7
    assert attended_keys(4, 4) == 1 + 2 + 3 + 4
    assert attended_keys(0, 9) == 0


def test_step_cost_by_hand():
    c = small_cost()
    # a prefill chunk of 3 tokens after a 2-token prefix hit, and a decode at context 7
    flops, nbytes = step_cost(c, [(3, 5), (1, 7)], num_sampled=2)
    T, A, K = 4, (3 + 4 + 5) + 7, 5 + 7
    linear = 2 * 1536 * T                   # 12288
    attn = 4 * 4 * 4 * 2 * A                # 4 * d * H * L * A = 2432
    head = 2 * 8 * 32 * 2                   # 1024
    assert flops == linear + attn + head == 15744
    expect_bytes = (6368                    # layer weights + norms, once
                    + 1024                  # LM head, once
                    + T * 8 * 4             # 4 embedding rows = 128
                    + K * 128               # KV read = 1536
                    + T * 128)              # KV written = 512
    assert nbytes == expect_bytes == 9568


def test_step_cost_no_sampling_and_empty():
    c = small_cost()
    flops, nbytes = step_cost(c, [(4, 4)], num_sampled=0)  # a chunk that samples nothing
    assert flops == 2 * 1536 * 4 + 4 * 4 * 4 * 2 * 10
    assert nbytes == 6368 + 4 * 8 * 4 + 4 * 128 + 4 * 128
    assert step_cost(c, [], 0) == (0.0, 0.0)


def test_flops_match_flop_counter_on_transformers_model():
    """Independent check: torch's FlopCounterMode on HF's eager Qwen3. Eager attention
    computes the full n x n score matrix (masked afterwards) and logits for every row,
    so for a prompt of n tokens it counts n*n keys and n LM-head rows; ours is causal."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(**SMALL, attn_implementation="eager")).eval()
    c = small_cost()
    for n in (1, 5):
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            model(torch.arange(n)[None])
        ours, _ = step_cost(c, [(n, n)], num_sampled=1)
        extra_keys = n * n - attended_keys(n, n)
        extra = 4 * c.head_dim * c.num_heads * c.num_layers * extra_keys + 2 * 8 * 32 * (n - 1)
        assert fc.get_total_flops() == ours + extra


def test_tensor_parallel_halves_per_rank_work():
    c1, c2 = small_cost(), small_cost(tp_size=2)
    assert c2.num_heads == 2 and c2.num_kv_heads == 1 and c2.intermediate_size == 8
    assert c2.matmul_params * 2 == c1.matmul_params
    f1, _ = step_cost(c1, [(3, 5)], 1)
    f2, _ = step_cost(c2, [(3, 5)], 1)
    assert f2 * 2 == f1
    with pytest.raises(ValueError, match="tp_size"):
        small_cost(tp_size=3)


def test_bad_inputs_raise():
    c = small_cost()
    with pytest.raises(ValueError, match="entry 1"):
        step_cost(c, [(1, 1), (5, 2)], 1)
    with pytest.raises(ValueError, match="num_sampled"):
        step_cost(c, [(1, 1)], 2)
    with pytest.raises(ValueError, match="dtype"):
        dtype_nbytes("float13")
    assert dtype_nbytes(torch.bfloat16) == 2 and dtype_nbytes("torch.float32") == 4
    with pytest.raises(ValueError, match="hidden_size"):
        ModelCost.from_config({**SMALL, "hidden_size": 0})


def test_arithmetic_intensity_decode_vs_prefill():
    c = small_cost()
    i_dec = arithmetic_intensity(*step_cost(c, [(1, 8)], 1))
    i_pre = arithmetic_intensity(*step_cost(c, [(64, 64)], 1))
    assert i_pre > 10 * i_dec  # prefill reuses each weight across 64 tokens
    assert arithmetic_intensity(5.0, 0.0) == float("inf")
    assert arithmetic_intensity(6.0, 3.0) == 2.0


@pytest.mark.parametrize("kind", ["decodes", "mixed"])
def test_fill_step_record_sums_equal_step_cost(kind):
    """The one-token-per-entry fast path and the general loop give step_cost's figures."""
    import random

    rng = random.Random(kind)
    ns = [1] * 40 if kind == "decodes" else [rng.choice([0, 1, 2, 7]) for _ in range(40)]
    scheduled = [ScheduledEntry(f"r{i}", n, n > 1, rng.randint(0, 500), rng.random() < 0.8 and n > 0)
                 for i, n in enumerate(ns)]
    rec = StepRecord(
        index=0, start_time=1.0, end_time=1.5, num_prefill_tokens=0, num_decode_tokens=sum(ns),
        num_seqs=len(ns), num_prefill_chunks=0, scheduled=scheduled, preempted=[], finished=[],
        kv_blocks_used=2, kv_blocks_free=6, kv_blocks_cached=1, prefix_cache_hit_tokens=0, attention_backend="torch")
    c = small_cost()
    fill_step_record(rec, c)
    want = step_cost(c, [(e.num_tokens, e.first_position + e.num_tokens) for e in scheduled],
                     sum(e.sampled for e in scheduled))
    assert (rec.flops, rec.bytes_moved) == want


def test_a_speculative_verification_counts_a_logit_row_per_token():
    """A decode entry of 1 + 4 drafts computes 5 rows of logits; the record counted one (its FLOPs ~19% low
    on the embedded model). A prefill chunk still counts its last position's row."""
    c = small_cost()
    rec = StepRecord(
        index=0, start_time=1.0, end_time=1.5, num_prefill_tokens=3, num_decode_tokens=6, num_seqs=3,
        num_prefill_chunks=1, scheduled=[ScheduledEntry("v", 5, False, 10, True), ScheduledEntry("d", 1, False, 6, True),
                                         ScheduledEntry("p", 3, True, 0, True)],
        preempted=[], finished=[], kv_blocks_used=2, kv_blocks_free=6, kv_blocks_cached=0, prefix_cache_hit_tokens=0,
        attention_backend="torch")
    fill_step_record(rec, c)
    assert (rec.flops, rec.bytes_moved) == step_cost(c, [(5, 15), (1, 7), (3, 3)], 5 + 1 + 1)
    assert entries_from_record(rec)[1] == 7
    with pytest.raises(ValueError, match="num_sampled=10 exceeds the step's 9 tokens"):
        step_cost(c, [(5, 15), (1, 7), (3, 3)], 10)


def test_fill_step_record():
    rec = StepRecord(
        index=0, start_time=1.0, end_time=1.5, num_prefill_tokens=3, num_decode_tokens=1,
        num_seqs=2, num_prefill_chunks=1,
        scheduled=[ScheduledEntry("b", 1, False, 6, True), ScheduledEntry("a", 3, True, 2, True)],
        preempted=[], finished=[], kv_blocks_used=2, kv_blocks_free=6, kv_blocks_cached=1,
        prefix_cache_hit_tokens=2, attention_backend="torch")
    c = small_cost()
    peaks = Peaks(flops_per_s=1e5, bytes_per_s=1e4)
    fill_step_record(rec, c, peaks)
    assert rec.flops == 15744 and rec.bytes_moved == 9568  # same step as test_step_cost_by_hand
    assert rec.mfu == pytest.approx(15744 / 0.5 / 1e5)
    assert rec.mbu == pytest.approx(9568 / 0.5 / 1e4)
    fill_step_record(rec, c, peaks, seconds=0.25)
    assert rec.mfu == pytest.approx(15744 / 0.25 / 1e5)


def test_a_decode_step_record_builds_its_entries_when_read_and_its_sums_match_them():
    """The engine records a step of plain decodes with ``PlannedEntries`` (built on first read)
    and the roofline sums from the plan; both equal what the built entries give."""
    import copy
    import pickle

    from minivllm import LLM, SamplingParams
    from minivllm.telemetry.step_record import PlannedEntries

    llm = LLM("minivllm-tiny", seed=0)
    engine = llm.llm_engine
    for i, n in enumerate((5, 9, 17)):
        engine.add_request(f"p{i}", list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    rec = engine.step_with_record().record
    assert isinstance(rec.scheduled, PlannedEntries) and rec.scheduled._entries is None and len(rec.scheduled) == 3
    built = list(rec.scheduled)
    assert rec.scheduled._planned is None  # the plan (and its sequences) let go once built
    assert [(e.request_id, e.num_tokens, e.is_prefill, e.first_position, e.sampled) for e in built] == [
        ("p0", 1, False, 5, True), ("p1", 1, False, 9, True), ("p2", 1, False, 17, True)]
    assert rec.scheduled == built and built == rec.scheduled and rec.scheduled[1] == built[1]
    assert rec.scheduled + built[:1] == built + built[:1] and built[:1] + rec.scheduled == built[:1] + built
    assert pickle.loads(pickle.dumps(rec.scheduled)) == built and copy.deepcopy(rec.scheduled) == built
    assert rec.to_dict()["scheduled"] == [e._asdict() for e in built]
    again = StepRecord(**{**{f: getattr(rec, f) for f in ("index", "start_time", "end_time", "num_prefill_tokens",
                                                         "num_decode_tokens", "num_seqs", "num_prefill_chunks",
                                                         "preempted", "finished", "kv_blocks_used", "kv_blocks_free",
                                                         "kv_blocks_cached", "prefix_cache_hit_tokens",
                                                         "attention_backend")}, "scheduled": built})
    fill_step_record(again, engine.model_cost, engine.peaks)
    assert (again.flops, again.bytes_moved) == (rec.flops, rec.bytes_moved) and rec.flops > 0
    llm.shutdown()


def test_widgets_and_benchmarks_count_an_int8_engine_as_the_engine_does():
    """engine_cost: the widgets built ModelCost without the engine's quantization, so an int8
    engine's steps were counted as reading float32 weights."""
    from minivllm import LLM
    from minivllm.telemetry.roofline import engine_cost
    from widgets.measure import _roofline

    llm = LLM("minivllm-tiny", quantization="int8", num_kvcache_blocks=32, enforce_eager=True)
    try:
        engine = llm.llm_engine
        cost = engine_cost(engine)
        assert cost == engine.model_cost and cost.quantization == "int8"
        float_cost = ModelCost.from_config(engine.source.hf_config, dtype=engine.config.dtype)
        assert cost.body_weight_bytes < float_cost.body_weight_bytes / 2
        record = StepRecord(
            index=0, start_time=1.0, end_time=1.5, num_prefill_tokens=0, num_decode_tokens=1, num_seqs=1,
            num_prefill_chunks=0, scheduled=[ScheduledEntry("r", 1, False, 9, True)], preempted=[], finished=[],
            kv_blocks_used=1, kv_blocks_free=7, kv_blocks_cached=0, prefix_cache_hit_tokens=0,
            attention_backend="torch")
        row = {}
        _roofline(engine, record, row)  # the widgets' path when the engine has not filled the record
        assert row["bytes"] == step_cost(engine.model_cost, [(1, 10)], 1)[1]
        assert row["bytes"] < step_cost(float_cost, [(1, 10)], 1)[1]
    finally:
        llm.shutdown()


def test_engine_cost_is_the_whole_model_for_a_tensor_parallel_engine():
    """engine_cost once relabelled rank 0's ModelCost (heads, MLP and vocabulary already halved) as tp_size=1."""
    from types import SimpleNamespace

    from minivllm.telemetry.roofline import engine_cost

    whole = ModelCost.from_config(SMALL, dtype="float32")
    engine = SimpleNamespace(source=SimpleNamespace(hf_config=SMALL), config=SimpleNamespace(dtype=torch.float32),
                             args=SimpleNamespace(quantization=None, quantize_lm_head=True), weight_storage=None,
                             model_cost=ModelCost.from_config(SMALL, dtype="float32", tp_size=2))
    assert engine_cost(engine) == whole and engine.model_cost.num_heads == whole.num_heads // 2


def test_a_numpy_integer_is_a_byte_count_not_its_own_itemsize():
    """``np.int64(2)`` has an ``itemsize`` of 8: read through it, a 2-byte model's weight bytes (and
    so its MBU) came out 4x off."""
    import numpy as np

    assert dtype_nbytes(np.int64(2)) == 2 and dtype_nbytes(np.int32(4)) == 4
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=1000)
    assert ModelCost.from_config(cfg, dtype=np.int64(2)) == ModelCost.from_config(cfg, dtype=2)
    # numpy integers in a dict config are counts too
    assert ModelCost.from_config({k: np.int64(v) for k, v in cfg.items()}) == ModelCost.from_config(cfg)


@pytest.mark.parametrize("change, message", [
    ({"head_dim": -1}, "head_dim must be a positive int, got -1"),
    ({"hidden_size": 66}, "hidden_size=66 is not divisible by num_attention_heads=4"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be a bool, got 'no'"),
])
def test_a_bad_config_value_is_refused_by_name(change, message):
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=1000)
    with pytest.raises(ValueError, match=message):
        ModelCost.from_config({**cfg, **change})


@pytest.mark.parametrize("flops, nbytes", [(float("nan"), 1.0), (1.0, float("nan")), ("1", 1.0), (1.0, -1.0)])
def test_arithmetic_intensity_refuses_what_is_no_count(flops, nbytes):
    with pytest.raises(ValueError, match="flops and bytes must be"):
        arithmetic_intensity(flops, nbytes)


def test_fill_step_record_with_peaks_clears_a_figure_the_step_does_not_have():
    """A record refilled for no time (or no work) had kept its earlier call's MFU and MBU."""
    rec = StepRecord(
        index=0, start_time=1.0, end_time=1.5, num_prefill_tokens=0, num_decode_tokens=1, num_seqs=1,
        num_prefill_chunks=0, scheduled=[ScheduledEntry("b", 1, False, 6, True)], preempted=[], finished=[],
        kv_blocks_used=2, kv_blocks_free=6, kv_blocks_cached=1, prefix_cache_hit_tokens=0, attention_backend="torch")
    peaks = Peaks(flops_per_s=1e5, bytes_per_s=1e4)
    fill_step_record(rec, small_cost(), peaks)
    assert rec.mfu > 0 and rec.mbu > 0
    fill_step_record(rec, small_cost())  # without peaks: left as they are
    assert rec.mfu > 0
    fill_step_record(rec, small_cost(), peaks, seconds=0.0)
    assert rec.mfu is None and rec.mbu is None


def test_counts_that_are_no_whole_numbers_are_refused():
    """step_cost took an entry of 1.5 tokens as 1, attended_keys(-1, 5) returned -6, and a Peaks of zero
    bandwidth divided by zero at its ridge point."""
    with pytest.raises(ValueError, match=r"entry 0 must be \(num_new_tokens, context_len_after\), two ints"):
        step_cost(small_cost(), [(1.5, 10)], 1)
    with pytest.raises(ValueError, match=r"attended_keys\(-1, 5\)"):
        attended_keys(-1, 5)
    with pytest.raises(ValueError, match="Peaks bytes_per_s=0.0: must be a positive number"):
        Peaks(1.0, 0.0)
    with pytest.raises(ValueError, match="no flops_per_s"):
        Peaks.from_dict({})
    import numpy as np

    assert step_cost(small_cost(), [(np.int64(2), 10)], 1) == step_cost(small_cost(), [(2, 10)], 1)
