"""Package structure: which layer may import which, and the helpers shared across layers
(one dtype table, one ceiling division, the attention backends' CUDA-graph flag)."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from minivllm.config import resolve_dtype
from minivllm.layers.attention.backend import AttentionBackend
from minivllm.layers.attention.torch_backend import TorchAttentionBackend
from minivllm.models.hf_config import get_config_dtype
from minivllm.telemetry.roofline import dtype_nbytes
from minivllm.utils import cdiv
from minivllm.utils.dtypes import DTYPES, MODEL_DTYPES, canonical_dtype_name, dtype_spellings


def _imports_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(m for m in sys.modules if m.startswith('minivllm')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_distributed_imports_nothing_above_it():
    loaded = _imports_after("import minivllm.distributed")
    assert not {m for m in loaded if m.startswith(("minivllm.engine", "minivllm.executor"))}, loaded


def test_roofline_and_dtype_table_need_no_torch():
    # sys.modules[name] = None makes any ``import torch`` raise ImportError
    _imports_after("sys.modules['torch'] = None; import minivllm.telemetry.roofline, minivllm.utils.dtypes")


@pytest.mark.parametrize("a, b, expected", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (2**70 + 1, 2**35, 2**35 + 1)])
def test_cdiv(a, b, expected):
    assert cdiv(a, b) == expected


@pytest.mark.parametrize("spelling", dtype_spellings(MODEL_DTYPES))
def test_one_dtype_table_for_engine_config_and_roofline(spelling):
    name = canonical_dtype_name(spelling)
    expected = getattr(torch, name)
    assert resolve_dtype(spelling, torch.device("cpu")) == expected
    assert get_config_dtype(SimpleNamespace(dtype=spelling)) == expected
    assert dtype_nbytes(spelling) == expected.itemsize == DTYPES[name][0]


def test_dtype_table_bytes_match_torch():
    for name, (nbytes, _) in DTYPES.items():
        assert getattr(torch, name).itemsize == nbytes, name


def test_non_model_dtypes_are_refused_where_a_model_dtype_is_needed():
    with pytest.raises(ValueError, match="choose 'auto' or one of"):
        resolve_dtype("float64", torch.device("cpu"))
    with pytest.raises(ValueError, match="unrecognised dtype"):
        get_config_dtype(SimpleNamespace(dtype="int8"))
    assert dtype_nbytes("int8") == 1  # the roofline still knows its size


def test_supports_cuda_graphs_declared_on_the_base_class():
    assert AttentionBackend.supports_cuda_graphs is False
    assert TorchAttentionBackend.supports_cuda_graphs is False
    pytest.importorskip("triton")
    from minivllm.layers.attention.triton_backend import TritonAttentionBackend

    assert TritonAttentionBackend.supports_cuda_graphs is True
