"""``KVCacheView``: the paged KV pool as a grid of physical blocks, live."""
from __future__ import annotations

import html

import ipywidgets as W

from minivllm.utils.checks import is_count

from ._base import PALETTE, STYLE, CourseWidget
from ._engine import engine_of, slot_ranges, token_piece


class KVCacheView(CourseWidget):
    """The physical KV blocks of the engine, coloured by the request that owns them.

    Everything is read from the engine's ``BlockManager`` at each refresh:

    * a cell per physical block (``block_manager.blocks``), coloured by the request whose
      block table holds it (``Sequence.block_table`` of every live sequence);
    * a thick border and "×n" on blocks shared by n requests (``ref_count > 1``: prefix-cache
      hits), a dot on blocks registered in the prefix cache (``hash`` set, so a later
      request with the same prefix can reuse them);
    * hatched cells: free blocks that still hold cached KV (``ref_count == 0`` with a
      hash: reusable until evicted); plain grey: free blocks;
    * hovering a block shows its id, reference count, owners, and the tokens whose KV
      it holds (the registered ``token_ids``, or the owner's tokens up to
      ``num_computed_tokens``);
    * below the grid, each request's block table and slot mapping (token ``p`` is
      stored in slot ``block_table[p // block_size] * block_size + p % block_size``).

    Args:
        llm: a ``minivllm.LLM`` or ``LLMEngine``.
        stepper: an ``EngineStepper`` to follow (refreshes after each of its steps and
            uses its request colours); call :meth:`refresh` yourself otherwise.
        max_blocks: draw at most this many blocks (the rest are summarised).

    State for code and tests: ``num_used_blocks``, ``num_shared_blocks``,
    ``num_cached_blocks``, ``block_owners`` (block id -> request ids), ``refresh_count``.
    """

    def __init__(self, llm, stepper=None, max_blocks: int = 512):
        super().__init__()
        self.engine = engine_of(llm)
        self.llm = llm  # held: an LLM shuts its engine down when collected
        self.tokenizer = self.engine.tokenizer
        if not is_count(max_blocks, 1):  # -1 dropped the last block
            raise ValueError(f"max_blocks={max_blocks!r}: draw at least one block (an int >= 1)")
        self.max_blocks = int(max_blocks)
        self.stepper = None
        self.block_owners: dict[int, list[str]] = {}
        self.refresh_count = 0
        self.grid = W.HTML()
        self.tables = W.HTML()
        self.add_class("mv-kv-cache-view")
        self.children = [W.HTML(STYLE), self.grid, self.tables]
        if stepper is not None:
            self.attach(stepper)
        self.refresh()

    def attach(self, stepper) -> "KVCacheView":
        """Follow ``stepper``: refresh after each of its steps, adds and resets."""
        self.stepper = stepper
        stepper.on_step(lambda _s, _r: self.refresh())
        self.refresh()
        return self

    # -- state --------------------------------------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence now."""
        return self.engine.block_manager.num_used_blocks

    @property
    def num_shared_blocks(self) -> int:
        """Blocks held by more than one sequence (a shared prompt prefix)."""
        return sum(1 for b in self.engine.block_manager.blocks if b.ref_count > 1)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a registered prefix hash, referenced or free (reusable by a later prompt)."""
        return self.engine.block_manager.num_cached_blocks

    def _colour(self, rid: str) -> str:
        if self.stepper is not None and rid in getattr(self.stepper, "_colour", {}):
            return self.stepper.colour(rid)
        return PALETTE[sum(map(ord, rid)) % len(PALETTE)]

    # -- drawing ------------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-read the block manager and redraw."""
        bm = self.engine.block_manager
        bs = bm.block_size
        live = self.engine.scheduler.live_sequences()
        owners: dict[int, list] = {}
        for seq in live:
            for i, b in enumerate(seq.block_table):
                owners.setdefault(b, []).append((seq, i))
        self.block_owners = {b: [s.request_id for s, _ in v] for b, v in owners.items()}
        cells = []
        for block in bm.blocks[:self.max_blocks]:
            held = owners.get(block.block_id, [])
            if block.token_ids is not None:
                toks = list(block.token_ids)
            elif held:
                seq, i = held[0]
                toks = seq.token_ids[i * bs:min((i + 1) * bs, seq.num_computed_tokens)]
            else:
                toks = []
            text = "".join(token_piece(self.tokenizer, t) for t in toks)
            ids = ", ".join(f"{s.request_id}[{i}]" for s, i in held) or "none"
            title = (f"block {block.block_id} · ref_count {block.ref_count} · owners (table index): {ids} · "
                     f"{len(toks)}/{bs} slots hold KV"
                     + (" · in prefix cache" if block.hash is not None else "")
                     + (f" · tokens {toks}: {text!r}" if toks else ""))
            classes = ["mv-kv"]
            label = str(block.block_id)
            style = ""
            if held:
                style = f"background:{self._colour(held[0][0].request_id)};color:#fff"
                classes.append("mv-kv-used")
                if block.ref_count > 1:
                    classes.append("mv-kv-shared")
                    label = f"×{block.ref_count}"
                if block.hash is not None:
                    label += "•"
            elif block.hash is not None:
                classes.append("mv-kv-cachedfree")
            else:
                classes.append("mv-kv-free")
            cells.append(f"<div class='{' '.join(classes)}' data-block='{block.block_id}' style='{style}' "
                         f"title='{html.escape(title, quote=True)}'>{label}</div>")
        more = ""
        if bm.num_blocks > self.max_blocks:
            more = f"<div class='mv-small'>… and {bm.num_blocks - self.max_blocks} more blocks not drawn</div>"
        unref_cached = sum(1 for b in bm.blocks if b.ref_count == 0 and b.hash is not None)
        head = (f"<div class='mv-box' data-used='{bm.num_used_blocks}'><b>KV cache</b>: "
                f"<span class='mv-kv-summary'>{bm.num_used_blocks} used / {bm.num_free_blocks} free "
                f"({unref_cached} of them still cached) / {bm.num_blocks} blocks</span> · "
                f"{self.num_shared_blocks} shared · {bm.num_cached_blocks} in the prefix cache · "
                f"{bs} token slots per block<br><span class='mv-small'>hover a block to see its tokens; "
                f"×n = shared by n requests, • = registered in the prefix cache, hatched = free but "
                f"still cached</span></div>")
        self.grid.value = head + "<div class='mv-kv-grid'>" + "".join(cells) + "</div>" + more
        rows = []
        for seq in live:
            n = seq.num_computed_tokens
            ranges = slot_ranges(seq.block_table, n, bs)
            slots = ", ".join(f"{a}–{b}" if b > a else f"{a}" for a, b in ranges)
            rows.append(f"<tr><td style='white-space:nowrap'><span style='color:{self._colour(seq.request_id)}'>■</span> "
                        f"{html.escape(seq.request_id)}</td><td>{seq.status.value}</td>"
                        f"<td>{seq.block_table}</td><td>{n}</td><td>{slots or '–'}</td></tr>")
        self.tables.value = (
            "<table class='mv-table'><tr><th>request</th><th>status</th><th>block table</th>"
            "<th>tokens in KV</th><th>slot mapping (slots of tokens 0..n-1, per block)</th></tr>"
            + "".join(rows) + "</table>") if rows else "<div class='mv-small'>no live request holds blocks</div>"
        self.refresh_count += 1

    def static_html(self) -> str:
        return "<div class='mv-box'>" + self.grid.value + self.tables.value + "</div>"
