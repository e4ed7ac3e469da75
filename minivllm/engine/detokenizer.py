"""Incremental detokenisation: new token ids -> new text, never half a UTF-8 character.

Byte-level BPE tokens can end in the middle of a multi-byte character; decoding such
a prefix yields U+FFFD. We decode a short sliding window (a few tokens of context
plus the unread tokens) and only release text once it no longer ends in U+FFFD.
"""
from __future__ import annotations

# Tokens of left context kept in the window: some tokenizers (SentencePiece-style)
# decode a token differently at the start of a string than after another token.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Per-request decoder. ``step(new_ids)`` returns the newly readable text."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids: list[int], final: bool = False) -> str:
        """Add tokens; return text that became readable (all of it when ``final``)."""
        self.ids.extend(new_token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith("\ufffd")):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full_text[len(prefix_text):]
        return ""
