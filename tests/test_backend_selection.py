"""Which attention backend ``attention_backend=...`` resolves to, and the errors it raises."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import minivllm.layers.attention as attn
from minivllm.layers.attention import (
    default_block_size,
    get_attention_backend,
    resolve_backend_name,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only resolved, never allocated on


@pytest.fixture
def no_flash(monkeypatch):
    monkeypatch.setattr(attn, "flash_attn_available", lambda: False)


@pytest.fixture
def with_flash(monkeypatch):
    monkeypatch.setattr(attn, "flash_attn_available", lambda: True)


def test_auto_on_cpu_is_torch(with_flash):
    assert resolve_backend_name("auto", CPU, 16) == "torch"
    assert resolve_backend_name("auto", "cpu", None) == "torch"
    assert resolve_backend_name("auto", CPU, 256) == "torch"


def test_auto_on_cuda_prefers_flash_attn_when_block_size_allows(with_flash):
    assert resolve_backend_name("auto", CUDA, None) == "flash_attn"
    assert resolve_backend_name("auto", CUDA, 256) == "flash_attn"
    assert resolve_backend_name("auto", CUDA, 512) == "flash_attn"
    # the widgets' 16-token blocks run on our kernels
    assert resolve_backend_name("auto", CUDA, 16) == "triton"


def test_auto_skips_flash_attn_for_fp32(with_flash):
    assert resolve_backend_name("auto", CUDA, None, dtype=torch.float32) == "triton"
    assert resolve_backend_name("auto", CUDA, None, dtype=torch.bfloat16) == "flash_attn"
    assert resolve_backend_name("auto", CUDA, 256, dtype=torch.float16) == "flash_attn"
    with pytest.raises(ValueError, match="float16/bfloat16"):
        resolve_backend_name("flash_attn", CUDA, 256, dtype=torch.float32)


def test_auto_on_cuda_without_flash_attn_is_triton(no_flash):
    assert resolve_backend_name("auto", CUDA, None) == "triton"
    assert resolve_backend_name("auto", "cuda:0", 256) == "triton"


def test_auto_on_cuda_without_triton_is_torch(no_flash, monkeypatch):
    monkeypatch.setattr(attn, "triton_available", lambda: False)
    assert resolve_backend_name("auto", CUDA, 16) == "torch"


def test_explicit_names_are_forced(with_flash, monkeypatch):
    assert resolve_backend_name("torch", CUDA, 256) == "torch"
    assert resolve_backend_name("triton", CUDA, 256) == "triton"
    assert resolve_backend_name("flash_attn", CUDA, 256) == "flash_attn"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend_name("triton", CPU, 16) == "triton"


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend_name("triton", CPU, 16)


def test_flash_attn_needs_cuda(with_flash):
    with pytest.raises(ValueError, match="CUDA"):
        resolve_backend_name("flash_attn", CPU, 256)


def test_flash_attn_needs_block_multiple_of_256(with_flash):
    with pytest.raises(ValueError, match="got 16"):
        resolve_backend_name("flash_attn", CUDA, 16)


def test_flash_attn_needs_the_package(no_flash):
    with pytest.raises(ValueError, match="flash-attn is not installed"):
        resolve_backend_name("flash_attn", CUDA, 256)


@pytest.mark.parametrize("bad", ["flash", "TORCH", "", "xformers"])
def test_unknown_name_is_refused(bad):
    with pytest.raises(ValueError, match="unknown attention_backend " + re.escape(repr(bad))):
        resolve_backend_name(bad, CPU, 16)


def test_bad_block_size_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        resolve_backend_name("auto", CPU, 0)


def test_default_block_sizes():
    assert default_block_size("torch") == 16
    assert default_block_size("triton") == 16
    assert default_block_size("flash_attn") == 256
    with pytest.raises(ValueError, match="nope"):
        default_block_size("nope")


def test_get_attention_backend_builds_the_resolved_backend(no_flash):
    backend = get_attention_backend("auto", CPU, 16)
    assert backend.name == "torch"
    from minivllm.layers.attention.flash_attn_backend import FlashAttnBackend

    # flash_attn is built without importing flash-attn (lazy); construction checks block size
    with pytest.raises(ValueError, match="block_size"):
        FlashAttnBackend(block_size=16)
    assert FlashAttnBackend(block_size=256).name == "flash_attn"


def test_importing_the_package_imports_neither_triton_nor_flash_attn():
    code = (
        "import sys; import minivllm.layers.attention as a; "
        "a.get_attention_backend('auto', 'cpu', 16); "
        "print('triton' in sys.modules, 'flash_attn' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False"]
