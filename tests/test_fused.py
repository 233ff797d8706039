"""The fused RMSNorm and SiLU-gate kernels (dash_trt.fused) against the PyTorch code they
replace: the same roundings, so at most the last bit differs, and rarely."""

import pytest
import torch
import torch.nn.functional as F

from dash_trt import fused

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
#: One unit in the last place of a value near 1, per dtype (bf16 8 bits, fp16 11, fp32 24).
ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-23}


def test_cpu_tensors_keep_the_pytorch_code():
    x = torch.randn(4, 8)
    assert fused.rms_norm(x, torch.ones(8), 1e-6) is None
    assert fused.silu_mul(x, x) is None


def _reference_rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _check(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    if dtype == torch.float32:
        # nothing rounds to a coarser dtype: 1/sqrt against rsqrt, exp against expf, the
        # reduction's order show as a few units in the last place (measured: under 5e-7)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        return
    bound = 2 * ULP[dtype] * want.float().abs().clamp(min=1.0)
    assert bool((diff <= bound).all()), float((diff - bound).max())
    assert float((diff > 0).float().mean()) < 0.05  # a last-bit difference, now and then


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(3000, 4096), (7, 1000), (1, 128)])
def test_rms_norm_matches_the_pytorch_norm(dtype, rows, width):
    if not torch.cuda.is_available() or not fused.available(torch.empty(0, device="cuda")):
        pytest.skip("needs a CUDA GPU and Triton")
    gen = torch.Generator(device="cuda").manual_seed(rows + width)
    x = (torch.randn(rows, width, device="cuda", generator=gen) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(width, device="cuda", generator=gen)).to(dtype)
    _check(fused.rms_norm(x, w, 1e-5), _reference_rms_norm(x, w, 1e-5), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_pytorch(dtype):
    if not torch.cuda.is_available() or not fused.available(torch.empty(0, device="cuda")):
        pytest.skip("needs a CUDA GPU and Triton")
    gen = torch.Generator(device="cuda").manual_seed(1)
    g = (torch.randn(513, 1433, device="cuda", generator=gen) * 4).to(dtype)
    u = torch.randn(513, 1433, device="cuda", generator=gen).to(dtype)
    _check(fused.silu_mul(g, u), F.silu(g) * u, dtype)
    fused.ENABLED = False
    try:
        assert fused.silu_mul(g, u) is None
    finally:
        fused.ENABLED = True
