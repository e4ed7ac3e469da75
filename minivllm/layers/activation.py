"""Gated activation for Qwen3's MLP (SwiGLU, Shazeer 2020, "GLU Variants Improve Transformer")."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``x [..., 2 * I] -> silu(x[..., :I]) * x[..., I:]`` of shape ``[..., I]``.

    The input is the packed ``gate_up_proj`` output: gate half first, then up half.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
