"""Block manager unit tests: hashing, prefix hits, reference counts, eviction order, invariants."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.engine.block_manager import BlockManager, hash_block
from minivllm.engine.sequence import Sequence
from minivllm.sampling_params import SamplingParams

BS = 4


def seq_of(tokens, rid="r"):
    return Sequence(rid, None, list(tokens), SamplingParams())


def run_prefill(bm: BlockManager, seq: Sequence) -> int:
    """Admit ``seq`` with its prefix hits, compute its whole prompt, register its blocks."""
    ids, hashes = bm.match_prefix(seq)
    bm.admit(seq, ids, hashes)
    bm.grow(seq, len(seq))
    seq.num_computed_tokens = len(seq)
    bm.register_computed_blocks(seq)
    return len(ids) * bm.block_size


def test_hash_chains_over_the_parent():
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [9]), [1, 2])
    assert hash_block(7, [1, 2]) == hash_block(7, [1, 2])


def test_hits_require_the_whole_prefix_and_leave_the_last_token_to_compute():
    bm = BlockManager(16, BS)
    a = seq_of(range(1, 13), "a")  # 3 full blocks
    assert run_prefill(bm, a) == 0
    assert bm.num_cached_blocks == 3
    same = seq_of(range(1, 13), "b")
    ids, _ = bm.match_prefix(same)
    assert len(ids) == 2  # (12 - 1) // 4: the block holding the last token is recomputed
    other_start = seq_of([99] + list(range(2, 13)), "c")
    assert bm.match_prefix(other_start)[0] == []  # a different first block breaks the chain


def test_hash_collision_is_caught_by_the_token_check():
    bm = BlockManager(8, BS)
    a = seq_of([1, 2, 3, 4, 5], "a")
    run_prefill(bm, a)
    h = a.block_hashes[0]
    bm.blocks[bm.hash_to_block[h]].token_ids = (9, 9, 9, 9)  # pretend another prompt has this hash
    assert bm.match_prefix(seq_of([1, 2, 3, 4, 5], "b"))[0] == []


@pytest.mark.parametrize("algo", ["xxhash", "sha256"])
def test_a_cache_salt_shares_blocks_only_with_the_same_salt(algo):
    """vLLM's cache_salt: a salted prompt's blocks are hit by the same salt only, never by another
    salt or by unsalted prompts (nor the other way round), even when the hash map is fooled."""
    bm = BlockManager(32, BS, hash_algo=algo)

    def salted(tokens, rid, salt):
        seq = seq_of(tokens, rid)
        seq.cache_salt = salt
        return seq

    tokens = list(range(1, 10))  # 2 full blocks, both hittable
    assert run_prefill(bm, salted(tokens, "a", "alice")) == 0
    assert len(bm.match_prefix(salted(tokens, "a2", "alice"))[0]) == 2
    assert bm.match_prefix(salted(tokens, "b", "bob"))[0] == []
    assert bm.match_prefix(seq_of(tokens, "plain"))[0] == []
    run_prefill(bm, seq_of(tokens, "plain2"))
    assert bm.match_prefix(salted(tokens, "c", "carol"))[0] == []
    assert len(bm.match_prefix(seq_of(tokens, "plain3"))[0]) == 2
    # a (crafted) collision: bob's first-block hash made to point at alice's block
    bob = salted(tokens, "b2", "bob")
    alice_first = bm.match_prefix(salted(tokens, "a3", "alice"))[0][0]
    bm.hash_to_block[bm._hash(bm._chain_root(bob), tokens[:BS])] = alice_first
    assert bm.match_prefix(bob)[0] == []


def test_release_keeps_cached_blocks_reusable_and_plain_blocks_go_first():
    bm = BlockManager(6, BS)
    a = seq_of(range(1, 10), "a")  # 2 full blocks + 1 partial
    run_prefill(bm, a)
    bm.release(a)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 2
    # A new unrelated sequence takes plain blocks first: the cached prefix survives.
    b = seq_of(range(50, 62), "b")
    run_prefill(bm, b)
    assert bm.num_cached_blocks == 2 + 3
    assert len(bm.match_prefix(seq_of(range(1, 10), "a2"))[0]) == 2
    bm.release(b)
    bm.check_invariants([])


def test_eviction_takes_the_least_recently_freed_cached_block():
    bm = BlockManager(4, BS)
    old = seq_of([1, 1, 1, 1, 1], "old")
    new = seq_of([2, 2, 2, 2, 2], "new")
    for s in (old, new):
        run_prefill(bm, s)
    bm.release(old)
    bm.release(new)
    # 4 blocks: old's full block, new's full block (both cached) and two plain ones.
    grab = seq_of(range(10, 22), "grab")  # needs 3 blocks: 2 plain + 1 evicted
    bm.admit(grab, [], [])
    bm.grow(grab, 12)
    assert bm.match_prefix(seq_of([1, 1, 1, 1, 1]))[0] == []  # old's block was evicted first
    assert len(bm.match_prefix(seq_of([2, 2, 2, 2, 2]))[0]) == 1
    bm.release(grab)
    bm.check_invariants([])


def test_shared_blocks_are_counted_once_per_table_and_freed_last():
    bm = BlockManager(8, BS)
    a = seq_of(range(1, 10), "a")
    run_prefill(bm, a)
    b = seq_of(list(range(1, 9)) + [77, 78], "b")
    assert run_prefill(bm, b) == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.check_invariants([a, b])
    bm.release(a)
    assert bm.blocks[b.block_table[0]].ref_count == 1
    bm.release(b)
    bm.check_invariants([])
    assert bm.num_used_blocks == 0


def test_grow_beyond_the_pool_is_an_error_not_a_corruption():
    bm = BlockManager(2, BS)
    s = seq_of(range(12), "s")
    bm.admit(s, [], [])
    assert not bm.can_grow(s, 12)
    with pytest.raises(RuntimeError, match="exhausted"):
        bm.grow(s, 12)
    assert bm.num_free_blocks == 2


def test_reset_prefix_cache_forgets_hashes():
    bm = BlockManager(8, BS)
    a = seq_of(range(1, 10), "a")
    run_prefill(bm, a)
    bm.release(a)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.match_prefix(seq_of(range(1, 10)))[0] == []
    bm.check_invariants([])


def test_check_invariants_reports_a_wrong_reference_count():
    bm = BlockManager(4, BS)
    a = seq_of(range(1, 6), "a")
    run_prefill(bm, a)
    bm.blocks[a.block_table[0]].ref_count += 1
    with pytest.raises(RuntimeError, match="ref_count"):
        bm.check_invariants([a])


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "release"]), st.integers(0, 5), st.integers(1, 14)),
                    max_size=40))
def test_random_operations_keep_the_invariants(ops):
    """Admit (with prefix hits over a few shared prefixes) and release in random order."""
    bm = BlockManager(12, BS)
    prefixes = [[p] * 8 for p in range(1, 4)]
    live: list[Sequence] = []
    for i, (op, which, length) in enumerate(ops):
        if op == "add":
            s = seq_of(prefixes[which % 3] + list(range(100, 100 + length)), f"s{i}")
            ids, hashes = bm.match_prefix(s)
            if bm.num_blocks_to_admit(ids, len(s)) > bm.num_free_blocks:
                continue
            bm.admit(s, ids, hashes)
            bm.grow(s, len(s))
            s.num_computed_tokens = len(s)
            bm.register_computed_blocks(s)
            live.append(s)
        elif live:
            bm.release(live.pop(which % len(live)))
        bm.check_invariants(live)
        assert bm.num_used_blocks + bm.num_free_blocks == 12
    for s in live:
        bm.release(s)
    bm.check_invariants([])
    assert bm.num_used_blocks == 0


def test_a_plain_block_freed_later_is_used_before_evicting_an_older_cached_one():
    bm = BlockManager(3, BS)
    x = seq_of([1, 1, 1, 1, 2], "x")  # a full (cached) block and a partial (plain) one
    y = seq_of([3, 3], "y")           # one partial (plain) block
    run_prefill(bm, x)
    run_prefill(bm, y)
    bm.release(x)
    bm.release(y)  # free, least recent first: x's partial, x's full (cached), y's block
    z = seq_of([5] * 8, "z")
    bm.admit(z, [], [])
    bm.grow(z, 8)  # two blocks: both plain ones, not x's cached block
    assert len(bm.match_prefix(seq_of([1, 1, 1, 1, 2]))[0]) == 1
    bm.release(z)
    bm.check_invariants([])


def test_admitting_a_long_cached_prefix_records_the_free_order_once_and_rolls_back_exactly():
    """Each hit on a free cached block removes it from the middle of the free list; the undo
    log copied the whole cached free list at every such hit (admission cost O(hits x cached
    blocks)). Now one copy per step, and a rollback still restores the order exactly."""
    from minivllm.engine.undo import UndoLog

    bm = BlockManager(64, BS)
    warm = seq_of(range(1, 42), "warm")  # 10 full blocks + 1 partial, all cached once released
    run_prefill(bm, warm)
    other = seq_of(range(100, 117), "other")  # more cached blocks after warm's in the free list
    run_prefill(bm, other)
    bm.release(warm)
    bm.release(other)
    order_before = list(bm._free_cached)
    undo = UndoLog()
    bm.undo = undo
    a, b = seq_of(range(1, 42), "a"), seq_of(range(1, 30), "b")
    for s in (a, b):
        ids, hashes = bm.match_prefix(s)
        assert len(ids) >= 7
        bm.admit(s, ids, hashes)
    copies = [args for fn, args in undo.entries if args and args[0] is bm._free_cached]
    assert len(copies) == 1  # one per revived block (ten) before
    bm.undo = None
    undo.rollback()
    assert list(bm._free_cached) == order_before
    bm.check_invariants([])


def test_an_interrupted_prefix_cache_reset_still_completes():
    """A KeyboardInterrupt part-way through the reset's walk over the pool left hash-map entries
    for blocks whose hash it had cleared, and cleared blocks in the cached free list."""
    import sys

    bm = BlockManager(16, BS)
    for i in range(3):
        s = seq_of(range(10 * i + 1, 10 * i + 10), f"s{i}")
        run_prefill(bm, s)
        bm.release(s)
    assert bm.num_cached_blocks == 6
    seen = []

    def trace(frame, event, arg):
        if frame.f_code.co_filename.endswith("block_manager.py") and "generation" in frame.f_code.co_names:
            def line(frame, event, arg):
                if event == "line":
                    seen.append(frame.f_lineno)
                    if len(seen) == 12:
                        raise KeyboardInterrupt("part-way through the reset")
                return line
            return line
        return None

    sys.settrace(trace)
    try:
        with pytest.raises(KeyboardInterrupt):
            bm.reset_prefix_cache()
    finally:
        sys.settrace(None)
    bm.check_invariants([])
    assert bm.num_cached_blocks == 0 and not bm.hash_to_block and bm.num_free_blocks == 16
