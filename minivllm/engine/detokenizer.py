"""Incremental detokenisation: new token ids -> new text, never half a UTF-8 character.

Byte-level BPE tokenizers (GPT-2 style, as Qwen's) map every token to a fixed byte
string, so the fast path is a table lookup per token followed by an incremental UTF-8
decoder that holds back an incomplete trailing character until its last byte arrives.

Other tokenizers take the general path: decode a short sliding window (a few tokens
of context plus the unread tokens) and release text only once it no longer ends in
U+FFFD (the replacement character a partial character decodes to).

A token id the tokenizer has no entry for (a ``random:`` preset pairs a 151936-token
model with the embedded 4096-token tokenizer) decodes to ``<id:N>`` on both paths,
so generated tokens never vanish from the text.
"""
from __future__ import annotations

import codecs
import weakref

# Tokens of left context kept in the window: some tokenizers (SentencePiece-style)
# decode a token differently at the start of a string than after another token.
_CONTEXT_TOKENS = 5

_BYTE_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes->unicode map (Radford et al. 2019, the byte-level BPE
    alphabet): printable bytes map to themselves, the rest to code points from 256 up."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def unknown_id_text(token_id: int) -> str:
    """How a token id the tokenizer cannot decode appears in text."""
    return f"<id:{token_id}>"


def byte_table(tokenizer, skip_special_tokens: bool = True) -> list[bytes | None] | None:
    """Token id -> bytes for a byte-level BPE tokenizer, or None for any other kind.

    Ids with no token (gaps in the vocabulary) map to None; skipped special tokens to b"".
    """
    key = (skip_special_tokens,)
    cached = _BYTE_TABLES.get(tokenizer, {}).get(key, False)
    if cached is not False:
        return cached
    table = _build_byte_table(tokenizer, skip_special_tokens)
    _BYTE_TABLES.setdefault(tokenizer, {})[key] = table
    return table


def _build_byte_table(tokenizer, skip_special_tokens: bool) -> list[bytes | None] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None  # the wrapper post-edits text; only the general path reproduces it
    to_byte = _gpt2_unicode_to_byte()
    vocab = backend.get_vocab(with_added_tokens=True)
    added = getattr(tokenizer, "added_tokens_decoder", {})
    table: list[bytes | None] = [None] * (max(vocab.values()) + 1)
    for token, idx in vocab.items():
        special = idx in added and added[idx].special
        if special and skip_special_tokens:
            table[idx] = b""
            continue
        if idx in added:
            table[idx] = added[idx].content.encode("utf-8")
            continue
        try:
            table[idx] = bytes(to_byte[c] for c in token)
        except KeyError:
            return None  # not a pure byte-level vocabulary
    return table


class IncrementalDetokenizer:
    """Per-request decoder. ``step(new_ids)`` returns the newly readable text.

    A character whose first bytes end the prompt (a token-id prompt can stop inside one)
    is completed by the output's first bytes and emitted whole, never as U+FFFD.
    ``spaces_between_special_tokens`` is passed to ``tokenizer.decode`` on the general path
    (only slow tokenizers read it; byte-level fast ones, as Hugging Face's, ignore it).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.logprob_texts = None  # the output processor's texts for Logprob.decoded_token, built at first use
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.table = byte_table(tokenizer, skip_special_tokens)
        if self.table is not None:
            self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            self._prime(prompt_token_ids)
            return
        try:  # ids from len(tokenizer) up have no token; without a length, trust decode
            self.num_known_ids: int | None = len(tokenizer)
        except TypeError:
            self.num_known_ids = None
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _prime(self, prompt_token_ids: list[int]) -> None:
        """Feed the prompt's incomplete trailing UTF-8 character (if any) to the decoder, so
        the output's first bytes complete it (a character is at most 4 bytes, so the last 3
        prompt bytes are enough)."""
        table, n = self.table, len(self.table)
        tail = b""
        for t in reversed(prompt_token_ids):
            piece = table[t] if t < n and table[t] is not None else unknown_id_text(t).encode()
            tail = piece + tail
            if len(tail) >= 3:
                break
        tail = tail[-3:]
        # The bytes from the last lead byte on form an incomplete character when the lead
        # byte announces more bytes than follow it.
        for back in range(1, len(tail) + 1):
            b = tail[-back]
            if b & 0xC0 == 0x80:
                continue  # a continuation byte: keep looking for the lead byte
            width = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
            if width > back:
                self.utf8.decode(tail[-back:], False)
            break

    def step(self, new_token_ids: list[int], final: bool = False) -> str:
        """Add tokens; return text that became readable (all of it when ``final``)."""
        if self.table is not None:
            table, n = self.table, len(self.table)
            # An unknown id's marker joins the byte stream as ASCII, so a character cut
            # short by it decodes to U+FFFD, as in a one-shot decode.
            data = b"".join([piece if t < n and (piece := table[t]) is not None
                             else unknown_id_text(t).encode() for t in new_token_ids])
            return self.utf8.decode(data, final)
        self.ids.extend(new_token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith("\ufffd")):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full_text[len(prefix_text):]
        return ""

    def _decode(self, ids: list[int]) -> str:
        """Decode ``ids``; runs of known ids go to the tokenizer, unknown ids become markers."""
        limit = self.num_known_ids
        if limit is None or all(t < limit for t in ids):
            return self._decode_known(ids)
        parts, run = [], []
        for t in ids:
            if t < limit:
                run.append(t)
                continue
            if run:
                parts.append(self._decode_known(run))
                run = []
            parts.append(unknown_id_text(t))
        if run:
            parts.append(self._decode_known(run))
        return "".join(parts)

    def _decode_known(self, ids: list[int]) -> str:
        if self.spaces_between_special_tokens:  # the tokenizer's default: leave the keyword out
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=False)

    # -- rollback support (an interrupted step restores the decoder as it was) --------------
    def get_state(self) -> tuple:
        if self.table is not None:
            return (self.utf8.getstate(),)
        return (len(self.ids), self.prefix_offset, self.read_offset)

    def set_state(self, state: tuple) -> None:
        if self.table is not None:
            self.utf8.setstate(state[0])
            return
        n, self.prefix_offset, self.read_offset = state
        del self.ids[n:]
