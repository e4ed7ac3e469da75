"""Gated activation for Qwen3's MLP (SwiGLU, Shazeer 2020, "GLU Variants Improve Transformer")."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``x [..., 2 * I] -> silu(x[..., :I]) * x[..., I:]`` of shape ``[..., I]``.

    The input is the packed ``gate_up_proj`` output: gate half first, then up half.
    """

    fused = None  # CpuFusedOps, set by ModelRunner.enable_cpu_fused_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            out = self.fused.silu_and_mul(x)
            if out is not None:
                return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
