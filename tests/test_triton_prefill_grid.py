"""The prefill kernel's flattened grid (issue 15): one program per real (sequence, query
tile) and kv head, each covering its kv head's whole query group. Interpreter, tiny shapes."""
from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

if "minivllm.layers.attention.triton_kernels" in sys.modules:  # imported earlier without it
    importlib.reload(sys.modules["minivllm.layers.attention.triton_kernels"])

from minivllm.layers.attention import triton_kernels as tk  # noqa: E402
from minivllm.testing import make_case, naive_attention  # noqa: E402
from minivllm.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402


def test_tile_map_lists_only_real_tiles():
    got = tk.prefill_tile_map([3, 0, 9, 1], 4, "cpu")
    assert got.dtype == torch.int32
    assert got.tolist() == [[0, 0], [2, 0], [2, 1], [2, 2], [3, 0]]
    # 255 decodes and one 8k chunk: 255 + 8192 / 32 tiles (the old grid launched
    # 256 x ceil(8192 / 64) programs per query head, almost all returning at once)
    assert tk.prefill_tile_map([1] * 255 + [8192], 32, "cpu").shape == (255 + 256, 2)
    assert tk.prefill_tile_map([], 4, "cpu").shape == (0, 2)
    with pytest.raises(ValueError, match="tokens_per_tile"):
        tk.prefill_tile_map([1], 0, "cpu")


def test_prefill_tiling_groups_the_query_heads_of_a_kv_head():
    block_m, _, block_g, tokens, _ = tk.prefill_tiling(6, 2, 32, torch.float32)
    assert block_g == 4 and tokens * block_g == block_m  # group 3 padded to 4 rows per token


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (8, 1)])
def test_group_tiles_match_the_reference(heads, kv_heads):
    # whole prompt, prefix + chunk, a one-token row, in one step; a group of 3 exercises
    # the padded head rows, 8:1 one program per tile for all eight heads
    case = make_case([(9, 9), (20, 3), (5, 1)], heads, kv_heads, 32, 16, seed=3)
    backend = TritonAttentionBackend()
    out = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale)
    torch.testing.assert_close(out, naive_attention(case), atol=2e-5, rtol=0)
    assert any(k.startswith("triton_prefill_tiles") for k in case.meta.extras)  # built once per step
