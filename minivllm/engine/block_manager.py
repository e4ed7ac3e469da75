"""The paged KV pool's bookkeeping: free list, reference counts, prefix-cache hashes.

Physical KV memory is cut into blocks of ``block_size`` token slots. A sequence owns
an ordered list of block ids (its *block table*); token ``p`` of the sequence lives in
slot ``block_table[p // block_size] * block_size + p % block_size``.

Prefix caching (the idea of vLLM's automatic prefix caching): every *full* block whose
KV has been computed gets a hash chained over its parent's hash and its own token ids,
so equal hashes mean equal token prefixes. A new request walks its prompt block by
block and reuses matching blocks (their reference count goes up) instead of
recomputing them. Blocks nobody references stay in the hash map, reusable, until the
allocator has no plain free block left; then it evicts the least recently freed first.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash

from minivllm.engine.sequence import Sequence
from minivllm.utils import cdiv


def hash_block(parent_hash: int | None, token_ids) -> int:
    """xxh64 of the parent block's hash followed by this block's token ids (int64 bytes)."""
    h = xxhash.xxh64()
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


@dataclass
class KVBlock:
    """One physical block. ``token_ids`` is kept for registered blocks to verify hits."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


class BlockManager:
    """Allocates KV blocks to sequences, shares prefix-cached blocks between them.

    Args:
        num_blocks: physical blocks in the pool.
        block_size: token slots per block.
        enable_prefix_caching: register computed full blocks and reuse them.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, in two lists: plain ones (no reusable content) are handed
        # out first; cached ones (registered prefix blocks) only when no plain block is
        # left, least recently freed first. So a cached prefix is evicted only when the
        # pool really needs its block.
        self._free_plain: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block: dict[int, int] = {}

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
        parent = None
        tokens = seq.token_ids
        for i in range((len(tokens) - 1) // bs):
            chunk = tokens[i * bs:(i + 1) * bs]
            h = hash_block(parent, chunk)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(chunk):
                break  # a miss (or a hash collision, caught by the token check)
            ids.append(block_id)
            hashes.append(h)
            parent = h
        return ids, hashes

    def num_blocks_to_admit(self, hit_block_ids: list[int], num_tokens: int) -> int:
        """Free blocks consumed by admitting a sequence with these hits, covering ``num_tokens``."""
        revived = sum(1 for b in hit_block_ids if self.blocks[b].ref_count == 0)
        return revived + max(0, self.blocks_for(num_tokens) - len(hit_block_ids))

    def admit(self, seq: Sequence, hit_block_ids: list[int], hit_hashes: list[int]) -> None:
        """Give ``seq`` the matched prefix blocks (reference counts go up)."""
        for b in hit_block_ids:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self._free_cached[b]  # a hit block is a registered one
            block.ref_count += 1
        seq.block_table = list(hit_block_ids)
        seq.block_hashes = list(hit_hashes)

    # -- growth ----------------------------------------------------------------------
    def num_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs so its table covers ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Append fresh blocks to ``seq``'s table until it covers ``num_tokens``.

        Raises:
            RuntimeError: the pool has too few free blocks (callers check ``can_grow``).
        """
        need = self.num_blocks_needed(seq, num_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {self.num_free_blocks} free")
        for _ in range(need):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        if self._free_plain:
            block_id, _ = self._free_plain.popitem(last=False)
        else:
            block_id, _ = self._free_cached.popitem(last=False)  # evict the least recently used
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its cached content
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = block.parent_hash = block.token_ids = None
        block.ref_count = 1
        return block_id

    # -- after a step ----------------------------------------------------------------
    def register_computed_blocks(self, seq: Sequence) -> None:
        """Hash the full blocks whose KV is now computed, making them hittable.

        Called after the step that wrote them, so two identical prompts scheduled in
        the same step each compute their own blocks. When another block already holds
        the same content, this one stays unregistered (and is freed as a plain block).
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            chunk = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = hash_block(parent, chunk)
            seq.block_hashes.append(h)
            if h in self.hash_to_block:
                continue
            block = self.blocks[seq.block_table[i]]
            block.hash, block.parent_hash, block.token_ids = h, parent, chunk
            self.hash_to_block[h] = block.block_id

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks reaching zero join the free list.

        Blocks are released last-first so a prompt's tail is evicted before its head
        (heads are the parts other requests are most likely to share).
        """
        for b in reversed(seq.block_table):
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free_plain[b] = None
                else:
                    self._free_cached[b] = None
        seq.block_table = []
        seq.block_hashes = []

    def reset_prefix_cache(self) -> None:
        """Forget every registered hash (in-use blocks keep their KV, but are no longer hittable)."""
        for block in self.blocks:
            block.hash = block.parent_hash = block.token_ids = None
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
                raise RuntimeError(f"hash map entry {h:#x} -> block {b}, which carries hash {block.hash}")
            if block.token_ids is None or len(block.token_ids) != self.block_size:
                raise RuntimeError(f"cached block {b} does not hold a full block of tokens")
            if hash_block(block.parent_hash, block.token_ids) != h:
                raise RuntimeError(f"cached block {b}: hash does not match its tokens")
