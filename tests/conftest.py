"""Shared fixtures: tiny random checkpoints, and the block-invariant check after every engine test."""
from __future__ import annotations

import gc
import os

# Idle OpenMP threads spin by default; on a 2-core CI machine they steal the cores that the
# tensor-parallel workers and notebook kernels (which inherit this environment) need.
# Must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Triton reads TRITON_INTERPRET once, at import. The Triton test modules set it at their own
# import, but a module collected earlier (pytest.importorskip("triton") in the AOT test) would
# import triton first in a run that selects only some files, and every interpreted kernel then
# fails with "Cannot call @triton.jit'd outside of the scope of a kernel". In-process Triton in
# this suite is always the interpreter; the AOT compile runs in a subprocess without the variable.
os.environ.setdefault("TRITON_INTERPRET", "1")

import sys
import weakref
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers_*.py

from minivllm.engine.llm_engine import LLMEngine  # noqa: E402
from minivllm.utils.model_source import EMBEDDED_MODEL_DIR  # noqa: E402


@pytest.fixture(autouse=True)
def engine_invariants(monkeypatch):
    """Every engine built during a test is checked afterwards: block bookkeeping is
    consistent, and once no request is unfinished every block is free (possibly
    still cached) with reference count zero."""
    engines: list[weakref.ref] = []
    original_init = LLMEngine.__init__

    def tracking_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        engines.append(weakref.ref(self))

    monkeypatch.setattr(LLMEngine, "__init__", tracking_init)
    yield
    for ref in engines:
        engine = ref()
        if engine is None or engine.runner is None:
            continue
        engine.check_invariants()
        if not engine.has_unfinished_requests():
            bm = engine.block_manager
            assert bm.num_used_blocks == 0, f"{bm.num_used_blocks} blocks still referenced with no request left"
            assert all(b.ref_count == 0 for b in bm.blocks)
    engine = None
    lingering = any(ref() is not None for ref in engines)
    engines.clear()
    if lingering:  # held in a reference cycle (or by a fixture): a full collection takes 0.1-0.4 s, so only then
        gc.collect()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A tiny random Qwen3 (vocab 97, 2 layers, head_dim 16 != 48/4, GQA 4:2) with a tokenizer."""
    from helpers_models import make_hf_checkpoint

    return make_hf_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_draft_ckpt(tmp_path_factory) -> Path:
    """A draft for ``tiny_ckpt``: the same random model with one layer instead of two (the same
    embedding and first-layer weights), so its guesses agree with the target's often, not always."""
    from helpers_models import make_hf_checkpoint

    return make_hf_checkpoint(tmp_path_factory.mktemp("draft"), num_hidden_layers=1)


@pytest.fixture(scope="session")
def text_ckpt(tmp_path_factory) -> Path:
    """A tiny random Qwen3 whose vocabulary covers the embedded tokenizer (text prompts work)."""
    from helpers_models import make_hf_checkpoint
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR))
    return make_hf_checkpoint(tmp_path_factory.mktemp("text"), vocab_size=vocab)


