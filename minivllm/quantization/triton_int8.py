"""Our Triton kernel for weight-only int8 linears: ``y = x @ (Q * scale).T + bias``.

``x [M, K]`` (fp32/bf16/fp16), ``Q int8 [N, K]``, ``scale fp32 [N]``, ``bias [N]`` or none,
``y [M, N]`` in ``x``'s dtype. Each program computes one ``[BLOCK_M, BLOCK_N]`` tile of ``y``:
it walks K in ``BLOCK_K`` steps, loads an int8 weight tile and converts it to the activation
dtype in registers (the dequantisation is fused: the weight crosses memory as 1 byte per
element, never as a float copy), accumulates ``x_tile @ q_tile`` in fp32, and applies the
per-output-channel scale once to the accumulator at the end (the scale is constant along K,
so ``sum_k x*q*s = s * sum_k x*q``), then adds the bias.

Under the Triton interpreter (``TRITON_INTERPRET=1``, set before this module is imported)
both ``tl.dot`` operands are cast to fp32, because the interpreter computes low-precision
``tl.dot`` wrongly; on a GPU bf16/fp16 operands use the tensor cores directly (int8 values
are exact in bf16/fp16) and fp32 operands use IEEE fp32.
"""
from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def triton_unavailable_reason() -> str | None:
    """Why the Triton int8 kernel cannot run here, or ``None`` if it can (Triton imports and
    either CUDA is available or the interpreter is on)."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e})"
    if not torch.cuda.is_available() and not _interpreter_enabled():
        return "no CUDA device (set TRITON_INTERPRET=1 to run the kernel on the CPU interpreter)"
    return None


def _interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def int8_mm_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
        M, N, K,
        stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
        HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm[:, None] < M
        n_ok = rn[None, :] < N
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :] * stride_xk
        w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + rk) < K
            x = tl.load(x_ptrs, mask=m_ok & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok & k_ok[:, None], other=0)
            if DOT_FP32:
                if IEEE:
                    acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
            else:
                acc += tl.dot(x, w.to(x.dtype))
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
        acc = acc * scale[None, :]
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
            acc = acc + bias[None, :]
        y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok & n_ok)

    return int8_mm_kernel


def block_sizes(M: int, N: int, K: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)`` for a problem: the smallest M tile that
    covers the rows (decode steps have few), and a narrower N tile when the grid would
    otherwise have too few programs to keep the memory system busy."""
    if M <= 16:
        bm = 16
    elif M <= 32:
        bm = 32
    else:
        bm = 64
    bn = 64 if M > 16 else (32 if N >= 4096 else 16)
    bk = 128 if M <= 32 else 64
    return bm, bn, bk, 4


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None, blocks: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``x [..., K] -> x @ (qweight * scale[:, None]).T + bias``, ``[..., N]`` in ``x``'s dtype.

    Args:
        x: activations, fp32/bf16/fp16, CUDA (or CPU under the interpreter).
        qweight: int8 ``[N, K]``; scale: fp32 ``[N]``; bias: ``[N]`` or None.
        blocks: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)`` override (default :func:`block_sizes`).

    Raises:
        ValueError: wrong dtypes or shapes (the message names them).
        RuntimeError: the kernel cannot run here (:func:`triton_unavailable_reason`).
    """
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError(f"qweight must be int8 [N, K], got {qweight.dtype} {tuple(qweight.shape)}")
    N, K = qweight.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {K}")
    if scale.shape != (N,) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be fp32 [{N}], got {scale.dtype} {tuple(scale.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be fp32, bf16 or fp16, got {x.dtype}")
    reason = triton_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"Triton int8 kernel unavailable: {reason}")
    interpreted = _interpreter_enabled()
    if x.device.type != "cuda" and not interpreted:
        raise RuntimeError(f"Triton int8 kernel got a tensor on {x.device} without TRITON_INTERPRET=1")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*lead, N)
    bm, bn, bk, warps = blocks or block_sizes(M, N, K)
    import triton

    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    dot_fp32 = interpreted or x.dtype == torch.float32
    _kernel()[grid](
        x2, qweight, scale, bias if bias is not None else scale, y,
        M, N, K,
        x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, DOT_FP32=dot_fp32, IEEE=dot_fp32,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
    )
    return y.reshape(*lead, N)
