"""The paged KV pool's bookkeeping: free list, reference counts, prefix-cache hashes.

Physical KV memory is cut into blocks of ``block_size`` token slots. A sequence owns
an ordered list of block ids (its *block table*); token ``p`` of the sequence lives in
slot ``block_table[p // block_size] * block_size + p % block_size``.

Prefix caching (the idea of vLLM's automatic prefix caching): every *full* block whose
KV has been computed gets a hash chained over its parent's hash and its own token ids.
A new request walks its prompt block by block and reuses matching blocks (their
reference count goes up) instead of recomputing them. A hash only *finds* a candidate:
a hit is accepted only when the block holds exactly this chunk's token ids and its
recorded parent is the block hit just before it (same id, same registration
generation), so a hash collision, accidental or crafted, costs a cache miss and never
wrong KV. Blocks nobody references stay in the hash map, reusable, until the allocator
has no plain free block left; then it evicts the least recently freed first.

Every mutation can be recorded in an ``UndoLog`` (``minivllm/engine/undo.py``) so that
a step interrupted half-way is rolled back exactly.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np
import xxhash

from minivllm.engine.sequence import Sequence
from minivllm.engine.undo import UndoLog
from minivllm.utils import cdiv

#: ``prefix_caching_hash_algo`` values (vLLM's argument name).
HASH_ALGOS = ("xxhash", "sha256")


def hash_block(parent_hash: int | None, token_ids) -> int:
    """xxh64 of the parent block's hash (uint64) followed by this block's token ids (int64),
    little-endian bytes.

    Fast, 64 bits, not collision resistant: a hit is always verified (``match_prefix``). The
    bytes come from one ``struct`` pack: 0.84 us for a 16-token block with its parent, against 2.63 us
    for a numpy array and two hasher updates (best of 5 x 20,000, ``timeit``; 2-core Xeon dev VM, 2026-12-06), paid at every
    block a decode fills."""
    n = len(token_ids)
    if parent_hash is None:
        return _xxh64(_packer(False, n).pack(*token_ids))
    return _xxh64(_packer(True, n).pack(parent_hash, *token_ids))


_xxh64 = xxhash.xxh64_intdigest


@functools.lru_cache(maxsize=64)
def _packer(with_parent: bool, n: int) -> struct.Struct:
    return struct.Struct(f"<Q{n}q" if with_parent else f"<{n}q")


def hash_block_sha256(parent_hash: bytes | None, token_ids) -> bytes:
    """SHA-256 (32-byte digest) of the parent block's digest followed by this block's token
    ids (int64 bytes): crafting two prefixes with one hash is infeasible."""
    h = hashlib.sha256(parent_hash or b"")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


_HASH_FUNCTIONS = {"xxhash": hash_block, "sha256": hash_block_sha256}

#: ``Sequence.table_version`` numbers, never reused in the process: a sequence gets the next one
#: right before each change to its block table (so an interrupt between the two leaves a new
#: version on an old table, which costs the decode graphs' staging one needless row write, never
#: an old version on a new table).
_table_versions = itertools.count(1)

#: A registered block's place in a prefix chain: (block id, registration generation).
BlockRef = tuple[int, int]


@dataclass
class KVBlock:
    """One physical block.

    For a registered (prefix-cached) block: ``hash`` is its chained hash, ``token_ids`` its
    tokens, ``parent`` the ``BlockRef`` of the block before it in the prefix (None for a
    first block), and ``generation`` counts registrations and evictions of this block id,
    so a child recorded against an older registration is recognised as stale.
    """

    block_id: int
    ref_count: int = 0
    hash: int | bytes | None = None
    parent_hash: int | bytes | None = None
    token_ids: tuple[int, ...] | None = None
    parent: BlockRef | None = None
    generation: int = 0

    @property
    def ref(self) -> BlockRef:
        return (self.block_id, self.generation)


class BlockManager:
    """Allocates KV blocks to sequences, shares prefix-cached blocks between them.

    Args:
        num_blocks: physical blocks in the pool.
        block_size: token slots per block.
        enable_prefix_caching: register computed full blocks and reuse them.
        hash_algo: "xxhash" (default, fast) or "sha256" (collision resistant). Either way
            a hit is verified against the stored tokens and parent chain.

    Raises:
        ValueError: an unknown ``hash_algo``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_algo: str = "xxhash"):
        if hash_algo not in _HASH_FUNCTIONS:
            raise ValueError(f"prefix_caching_hash_algo={hash_algo!r}: choose one of {list(HASH_ALGOS)}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_algo = hash_algo
        self._hash = _HASH_FUNCTIONS[hash_algo]
        #: Set by the engine for the duration of a step: every mutation records its inverse.
        self.undo: UndoLog | None = None
        #: Cached blocks evicted while ``undo`` was set (their KV may be overwritten).
        self.evicted: list[int] = []
        #: Every block taken from the free lists while ``undo`` was set: the step's forward may
        #: write any of them, even one a rollback gives back to a preempted sequence.
        self.taken: list[int] = []
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, in two lists: plain ones (no reusable content) are handed
        # out first; cached ones (registered prefix blocks) only when no plain block is
        # left, least recently freed first. So a cached prefix is evicted only when the
        # pool really needs its block.
        self._free_plain: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block: dict[int | bytes, int] = {}
        #: The highest block id handed out so far (plain blocks go out in ascending order until
        #: each has been used once), and a hook called with each new one: the CPU pool's
        #: :class:`~minivllm.engine.kv_prefault.KVPrefaulter` makes the memory of the blocks ahead.
        self.high_water = -1
        self.on_fresh_block: Callable[[int], None] | None = None

    # -- pool state ----------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def free(self) -> list[int]:
        """Unreferenced block ids in the order the allocator takes them: plain blocks
        first, then cached blocks least recently freed first."""
        return list(self._free_plain) + list(self._free_cached)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references (including cached ones, which are reusable)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a registered prefix hash (referenced or not)."""
        return len(self.hash_to_block)

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- prefix matching -----------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Longest run of cached full blocks at the start of ``seq``'s tokens.

        At most ``(len(seq) - 1) // block_size`` blocks match, so at least the last
        token is always computed (its logits are needed to sample) and a hit block is
        never written to. Returns (block ids, their hashes); nothing is referenced yet.
        """
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        ids, hashes = [], []
        parent, parent_ref = self._chain_root(seq), None
        tokens = seq.token_ids
        for i in range((len(tokens) - 1) // bs):
            chunk = tokens[i * bs:(i + 1) * bs]
            h = self._hash(parent, chunk)
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            # The hash only finds a candidate: its tokens and its parent link (for a first
            # block, the salt's root) must match too, else it is a collision and counts as a miss.
            if block.token_ids != tuple(chunk) or block.parent != parent_ref or block.parent_hash != parent:
                break
            ids.append(block_id)
            hashes.append(h)
            parent, parent_ref = h, block.ref
        return ids, hashes

    def num_blocks_to_admit(self, hit_block_ids: list[int], num_tokens: int) -> int:
        """Free blocks consumed by admitting a sequence with these hits, covering ``num_tokens``."""
        revived = sum(1 for b in hit_block_ids if self.blocks[b].ref_count == 0)
        return revived + max(0, self.blocks_for(num_tokens) - len(hit_block_ids))

    def admit(self, seq: Sequence, hit_block_ids: list[int], hit_hashes: list[int]) -> None:
        """Give ``seq`` the matched prefix blocks (reference counts go up)."""
        undo = self.undo
        if undo is not None:
            undo.touch(seq)
        for b in hit_block_ids:
            block = self.blocks[b]
            if block.ref_count == 0:
                if undo is not None:  # a removal from the middle: the whole order, once a step
                    undo.save_dict(self._free_cached)
                del self._free_cached[b]  # a hit block is a registered one
            if undo is not None:
                undo.add(setattr, block, "ref_count", block.ref_count)
            block.ref_count += 1
        seq.table_version = next(_table_versions)  # before the change: see _table_versions
        seq.block_table = list(hit_block_ids)
        seq.block_hashes = list(hit_hashes)
        seq.block_refs = [self.blocks[b].ref for b in hit_block_ids]

    # -- growth ----------------------------------------------------------------------
    def num_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs so its table covers ``num_tokens`` tokens."""
        # cdiv inlined: this runs at every block boundary
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return -(-num_tokens // self.block_size) - len(seq.block_table) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Append fresh blocks to ``seq``'s table until it covers ``num_tokens``.

        Raises:
            RuntimeError: the pool has too few free blocks (callers check ``can_grow``).
        """
        need = self.num_blocks_needed(seq, num_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {self.num_free_blocks} free")
        if need and self.undo is not None:  # the table as long as it is, under its version (no snapshot)
            self.undo.add(_restore_table, seq, len(seq.block_table), seq.table_version)
        for _ in range(need):
            seq.table_version = next(_table_versions)
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        free = self._free_plain or self._free_cached  # evict cached blocks only when no plain one is left
        block_id = next(iter(free))                    # least recently freed first
        block = self.blocks[block_id]
        undo = self.undo
        if undo is not None:  # recorded before the pop
            undo.add(_put_back, free, block, block.ref_count)
            self.taken.append(block_id)
        del free[block_id]
        if block.hash is not None:  # evict its cached content
            if undo is not None:
                undo.add(self._reregister, block, block.hash, block.parent_hash, block.token_ids, block.parent,
                         block.generation, self.hash_to_block.get(block.hash) == block_id)
                self.evicted.append(block_id)
            self._unregister(block)
        block.ref_count = 1
        if block_id > self.high_water:  # not undone by a rollback: it only says how far memory is in use
            self.high_water = block_id
            if self.on_fresh_block is not None:
                self.on_fresh_block(block_id)
        return block_id

    def _unregister(self, block: KVBlock) -> None:
        if self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash = block.parent_hash = block.token_ids = block.parent = None
        block.generation += 1  # children registered against the old content are now stale

    def _reregister(self, block: KVBlock, h, parent_hash, token_ids, parent, generation, in_map: bool) -> None:
        block.hash, block.parent_hash, block.token_ids, block.parent = h, parent_hash, token_ids, parent
        block.generation = generation
        if in_map:
            self.hash_to_block[h] = block.block_id

    # -- after a step ----------------------------------------------------------------
    def register_computed_blocks(self, seq: Sequence) -> None:
        """Hash the full blocks whose KV is now computed, making them hittable.

        Called after the step that wrote them, so two identical prompts scheduled in
        the same step each compute their own blocks. When another block already holds
        the same content (same tokens after the same parent), this one stays unregistered
        (and is freed as a plain block) and the chain continues through the other; a
        block whose hash is taken by different content (a collision), or whose parent
        could not be linked, is not registered (a later request misses there).
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        undo = self.undo
        if undo is not None and num_full > len(seq.block_hashes):  # the chain as long as it is (no snapshot)
            undo.add(_restore_chain, seq, len(seq.block_hashes), len(seq.block_refs))
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else self._chain_root(seq)
            parent_ref = seq.block_refs[-1] if seq.block_refs else None
            chunk = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = self._hash(parent, chunk)
            seq.block_hashes.append(h)
            if i > 0 and parent_ref is None:
                seq.block_refs.append(None)  # the chain is broken above: nothing to link to
                continue
            other = self.hash_to_block.get(h)
            if other is not None:
                theirs = self.blocks[other]
                same = theirs.token_ids == chunk and theirs.parent == parent_ref and theirs.parent_hash == parent
                seq.block_refs.append(theirs.ref if same else None)
                continue
            block = self.blocks[seq.block_table[i]]
            if undo is not None:  # h is in no block's name yet (checked above): unmapping it restores the map
                undo.add(self._unregister_new, block, h, block.generation)
            block.hash, block.parent_hash, block.token_ids, block.parent = h, parent, chunk, parent_ref
            block.generation += 1
            self.hash_to_block[h] = block.block_id
            seq.block_refs.append(block.ref)

    def _chain_root(self, seq: Sequence):
        """The parent hash of ``seq``'s first block: None, or with a ``cache_salt`` the salt's own hash,
        so salted chains (and their verification, which compares it) never meet other chains."""
        salt = seq.cache_salt
        if salt is None:
            return None
        data = b"cache_salt:" + salt.encode("utf-8", "surrogatepass")
        return hashlib.sha256(data).digest() if self.hash_algo == "sha256" else _xxh64(data)

    def _unregister_new(self, block: KVBlock, h, generation: int) -> None:
        self.hash_to_block.pop(h, None)
        block.hash = block.parent_hash = block.token_ids = block.parent = None
        block.generation = generation

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks reaching zero join the free list.

        Blocks are released last-first so a prompt's tail is evicted before its head
        (heads are the parts other requests are most likely to share).
        """
        undo = self.undo
        if undo is not None:
            undo.touch(seq)
        for b in reversed(seq.block_table):
            block = self.blocks[b]
            if undo is not None:
                undo.add(setattr, block, "ref_count", block.ref_count)
            block.ref_count -= 1
            if block.ref_count == 0:
                free = self._free_plain if block.hash is None else self._free_cached
                if undo is not None:
                    undo.add(free.pop, b, None)
                free[b] = None  # appended: the most recently freed
        seq.table_version = next(_table_versions)
        seq.block_table = []
        seq.block_hashes = []
        seq.block_refs = []

    # -- rollback of an interrupted step ------------------------------------------------
    def forget_evicted(self) -> None:
        """After a rollback whose forward may have run: blocks evicted in the step were
        restored as cached, but their KV may have been overwritten; unregister them (they
        become plain free blocks), so no later request hits stale KV."""
        for b in self.evicted:
            block = self.blocks[b]
            if block.hash is not None and block.ref_count == 0:
                del self._free_cached[b]
                self._unregister(block)
                self._free_plain[b] = None
        self.evicted = []

    def reset_prefix_cache(self) -> None:
        """Forget every registered hash (in-use blocks keep their KV, but are no longer hittable)."""
        done = False
        try:
            self._forget_all_hashes()
            done = True
        finally:
            if not done:  # interrupted half way (a learner's KeyboardInterrupt): finish, it is idempotent
                self._forget_all_hashes()

    def _forget_all_hashes(self) -> None:
        for block in self.blocks:
            if block.hash is not None:
                block.hash = block.parent_hash = block.token_ids = block.parent = None
                block.generation += 1
        self.hash_to_block.clear()
        self._free_plain.update(self._free_cached)
        self._free_cached.clear()

    # -- consistency -----------------------------------------------------------------
    def check_invariants(self, live: list[Sequence]) -> None:
        """Raise ``RuntimeError`` describing the first inconsistency found.

        Checks: each block's reference count equals the number of live block tables
        holding it; the free lists hold exactly the unreferenced blocks, cached ones (with
        a registered hash) in the cached list and the others in the plain list; every hash-map
        entry points at a block carrying that hash, whose hash recomputes from its
        parent hash and tokens, and whose tokens fill exactly one block.
        """
        expected = [0] * len(self.blocks)
        for seq in live:
            for b in seq.block_table:
                expected[b] += 1
        for block in self.blocks:
            if block.ref_count != expected[block.block_id]:
                raise RuntimeError(
                    f"block {block.block_id}: ref_count {block.ref_count} != {expected[block.block_id]} table references")
            if block.ref_count < 0:
                raise RuntimeError(f"block {block.block_id}: negative ref_count {block.ref_count}")
            in_plain, in_cached = block.block_id in self._free_plain, block.block_id in self._free_cached
            if (block.ref_count == 0) != (in_plain or in_cached) or (in_plain and in_cached):
                raise RuntimeError(f"block {block.block_id}: ref_count {block.ref_count} but in the plain free "
                                   f"list: {in_plain}, in the cached free list: {in_cached}")
            if in_plain and block.hash is not None or in_cached and block.hash is None:
                raise RuntimeError(f"block {block.block_id}: hash {block.hash} in the wrong free list")
        for h, b in self.hash_to_block.items():
            block = self.blocks[b]
            if block.hash != h:
                raise RuntimeError(f"hash map entry {h!r} -> block {b}, which carries hash {block.hash!r}")
            if block.token_ids is None or len(block.token_ids) != self.block_size:
                raise RuntimeError(f"cached block {b} does not hold a full block of tokens")
            if self._hash(block.parent_hash, block.token_ids) != h:
                raise RuntimeError(f"cached block {b}: hash does not match its tokens")


def _restore_table(seq: Sequence, length: int, version: int) -> None:
    """Undo of ``grow``: ``seq``'s table back to ``length`` blocks, under its old version."""
    del seq.block_table[length:]
    seq.table_version = version


def _restore_chain(seq: Sequence, num_hashes: int, num_refs: int) -> None:
    """Undo of ``register_computed_blocks`` on ``seq``: its prefix chain back to its length."""
    del seq.block_hashes[num_hashes:]
    del seq.block_refs[num_refs:]


def _put_back(free: OrderedDict, block: KVBlock, ref_count: int) -> None:
    """Undo of ``_take_free_block``: ``block`` first in its free list again (putting a present
    key first is a no-op), with its count."""
    free[block.block_id] = None
    free.move_to_end(block.block_id, last=False)
    block.ref_count = ref_count
