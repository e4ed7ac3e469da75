"""Rotary position embedding (RoPE), the "neox" (rotate-half) variant used by Qwen3.

Su et al., 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding".
For a head vector ``x`` of size ``d`` split into halves ``x1 = x[:d/2]``, ``x2 = x[d/2:]``
and position ``p``, with ``inv_freq[i] = theta ** (-2i / d)`` and ``a = p * inv_freq``:

    out = cat(x1 * cos(a) - x2 * sin(a),  x2 * cos(a) + x1 * sin(a))

which equals Hugging Face's ``x * cos + rotate_half(x) * sin`` with ``cos = cat(cos(a), cos(a))``.
"""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key heads at given absolute positions.

    The cos/sin table ``[max_position, head_dim]`` (cos half | sin half) is computed once,
    in fp32, at construction; it is kept in fp32 (not a buffer, so ``model.to(bf16)`` does
    not round it) and moved to the input's device on first use. The rotation itself is
    done in fp32 and the result cast back to the input dtype.

    Args:
        head_dim: size of each head (the whole head is rotated).
        max_position: number of positions in the table (``max_position_embeddings``).
        base: ``rope_theta``.
    """

    fused = None  # CpuFusedOps, set by ModelRunner.enable_cpu_fused_ops

    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        self.base = float(base)
        inv_freq = 1.0 / (self.base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self._cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)  # [max_position, head_dim] fp32

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """The fp32 table ``[max_position, head_dim]`` on ``device`` (moved there once)."""
        if self._cos_sin.device != device:
            self._cos_sin = self._cos_sin.to(device)
        return self._cos_sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, Hq, head_dim]`` and ``k [T, Hk, head_dim]`` by ``positions`` (int64 ``[T]``).

        Returns new tensors of the same shapes and dtypes.
        """
        if self.fused is not None:  # one C call per tensor on a CPU (ModelRunner.enable_cpu_fused_ops)
            table = self.cos_sin_cache(q.device)
            q_out = self.fused.rope(q, positions, table)
            k_out = self.fused.rope(k, positions, table) if q_out is not None else None
            if k_out is not None:
                return q_out, k_out
        cos, sin = self.cos_sin_cache(q.device)[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, d/2]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
