"""Fused elementwise kernels for the decoder's non-attention parts on a GPU (Triton).

A prefill step of the benchmark model spends about a sixth of its GPU time outside the
matrix products and the DASH kernels (``docs/performance.md``): the float32 RMSNorm makes five
passes over the hidden states, the gated MLP two over its [T, intermediate] activations. These
kernels do each in one pass, with the same roundings as the PyTorch code they replace:

- :func:`rms_norm`: ``(x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype) * weight``
  (the normalised row rounded to the model's dtype, then multiplied by the weight in it);
- :func:`silu_mul`: ``F.silu(gate) * up`` (SiLU in float32, rounded, then the product).

Only the order of the row reduction (and the ``exp`` of SiLU) differs from PyTorch's, so a
result may differ from the unfused one in its last bit. They run only on CUDA tensors when
Triton is importable (``ENABLED`` turns them off); every caller keeps the PyTorch code as its
fallback, which is what runs on the CPU and in exported graphs.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["ENABLED", "available", "rms_norm", "silu_mul"]

#: Set False to run the PyTorch code on CUDA too (A/B measurements, debugging).
ENABLED = True


@functools.lru_cache(maxsize=1)
def _kernels():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def rms_norm_kernel(x_ptr, w_ptr, y_ptr, n, x_stride, y_stride, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
        y = (x * r).to(y_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = (y.to(tl.float32) * w.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * y_stride + cols, out, mask=mask)

    @triton.jit
    def silu_mul_kernel(g_ptr, u_ptr, o_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        g = tl.load(g_ptr + i, mask=mask, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(o_ptr.dtype.element_ty)
        u = tl.load(u_ptr + i, mask=mask, other=0.0)
        tl.store(o_ptr + i, (s.to(tl.float32) * u.to(tl.float32)).to(o_ptr.dtype.element_ty), mask=mask)

    return triton, rms_norm_kernel, silu_mul_kernel


def available(x: torch.Tensor) -> bool:
    """The fused kernels run ``x``'s device (CUDA, Triton installed, ``ENABLED``)."""
    return ENABLED and x.is_cuda and _kernels() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm over the last dim in one pass, or None where the kernel does not run."""
    if not available(x) or x.dim() < 1 or weight.dtype != x.dtype or x.shape[-1] > 65536:
        return None
    triton, kernel, _ = _kernels()
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        kernel[(x2.shape[0],)](
            x2,
            weight.contiguous(),
            y,
            n,
            x2.stride(0),
            y.stride(0),
            float(eps),
            BLOCK=block,
            num_warps=8 if block >= 2048 else 4,
        )
    return y.view(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """``F.silu(gate) * up`` in one pass, or None where the kernel does not run."""
    if not available(gate) or gate.shape != up.shape or gate.dtype != up.dtype:
        return None
    triton, _, kernel = _kernels()
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty_like(g)
    n = g.numel()
    if n:
        block = 1024
        kernel[(triton.cdiv(n, block),)](g, u, out, n, BLOCK=block, num_warps=4)
    return out
