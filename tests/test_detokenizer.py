"""Incremental detokenisation equals a one-shot decode and never splits a character."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from minivllm.engine.detokenizer import IncrementalDetokenizer, byte_table
from minivllm.utils.model_source import EMBEDDED_MODEL_DIR

TOKENIZER = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
VOCAB = len(TOKENIZER)


class _NotByteLevel:
    """The same tokenizer seen only through ``decode`` (forces the general path)."""

    def decode(self, ids, skip_special_tokens=True):
        return TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens)


def test_embedded_tokenizer_takes_the_byte_level_path():
    assert byte_table(TOKENIZER) is not None
    assert IncrementalDetokenizer(_NotByteLevel(), []).table is None


@pytest.mark.parametrize("tok", [TOKENIZER, _NotByteLevel()], ids=["byte-level", "general"])
@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
def test_joined_steps_equal_one_shot_decode(tok, ids):
    detok = IncrementalDetokenizer(tok, [])
    pieces = [detok.step([t]) for t in ids[:-1]] + [detok.step(ids[-1:], final=True)]
    assert "".join(pieces) == TOKENIZER.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("tok", [TOKENIZER, _NotByteLevel()], ids=["byte-level", "general"])
def test_multibyte_characters_are_never_split(tok):
    text = "naïve café — 数据 ✓ 🙂 done"
    ids = TOKENIZER.encode(text)
    detok = IncrementalDetokenizer(tok, [])
    pieces = [detok.step([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
