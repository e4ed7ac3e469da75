"""Token ids the tokenizer cannot decode show up as ``<id:N>`` (random: presets), on both paths."""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from helpers_engine import make_llm
from helpers_models import make_hf_checkpoint
from minivllm import SamplingParams
from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.utils.model_source import EMBEDDED_MODEL_DIR

TOKENIZER = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
VOCAB = len(TOKENIZER)


class _NotByteLevel:
    """The same tokenizer seen only through ``decode`` and ``len`` (forces the general path)."""

    def decode(self, ids, skip_special_tokens=True):
        return TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens)

    def __len__(self):
        return VOCAB


TOKENIZERS = pytest.mark.parametrize("tok", [TOKENIZER, _NotByteLevel()], ids=["byte-level", "general"])


def reference(ids: list[int]) -> str:
    """Known runs decoded in one shot, each unknown id as its marker."""
    parts, run = [], []
    for t in ids + [None]:
        if t is not None and t < VOCAB:
            run.append(t)
            continue
        if run:
            parts.append(TOKENIZER.decode(run, skip_special_tokens=True))
            run = []
        if t is not None:
            parts.append(f"<id:{t}>")
    return "".join(parts)


@TOKENIZERS
def test_unknown_id_is_rendered(tok):
    h = TOKENIZER.encode("h")[0]
    detok = IncrementalDetokenizer(tok, [])
    assert detok.step([h]) == "h"
    assert detok.step([89936]) == "<id:89936>"
    assert detok.step([h, VOCAB], final=True) == f"h<id:{VOCAB}>"


@TOKENIZERS
def test_character_held_back_across_unknown_ids(tok):
    ids = TOKENIZER.encode("数")
    assert len(ids) > 1, "need a character split over several tokens"
    detok = IncrementalDetokenizer(tok, [])
    out = [detok.step([89936])] + [detok.step([t]) for t in ids] + [detok.step([89937], final=True)]
    assert out[0] == "<id:89936>" and out[1] == ""  # the first byte of 数 is held back
    assert "".join(out) == "<id:89936>数<id:89937>"


@TOKENIZERS
@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(VOCAB, VOCAB + 50)), min_size=1, max_size=40))
def test_joined_steps_equal_reference(tok, ids):
    detok = IncrementalDetokenizer(tok, [])
    pieces = [detok.step([t]) for t in ids[:-1]] + [detok.step(ids[-1:], final=True)]
    assert "".join(pieces) == reference(ids)


def test_model_larger_than_tokenizer_shows_every_generated_token(tmp_path):
    """A random: preset's situation at a small size: model vocabulary 4x the tokenizer's."""
    ckpt = make_hf_checkpoint(tmp_path, vocab_size=4 * VOCAB)
    llm = make_llm(ckpt)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    out = llm.generate("The list", params, use_tqdm=False)[0].outputs[0]
    unknown = [t for t in out.token_ids if t >= VOCAB]
    assert unknown, "the seeded draw should include ids above the tokenizer's vocabulary"
    assert [int(m) for m in re.findall(r"<id:(\d+)>", out.text)] == unknown
    assert out.text == reference(out.token_ids)
