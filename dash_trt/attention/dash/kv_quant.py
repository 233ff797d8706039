"""The fp8 (e4m3) KV cache of the paged DASH operator: names, quantisation, scales.

An fp8 cache stores the page-RoPE'd keys and the values as ``torch.float8_e4m3fn`` with one
float32 scale per KV head for each (``k_scale`` and ``v_scale``, [Hkv]): vLLM's
``kv_cache_dtype="fp8"`` / ``"fp8_e4m3"`` with its per-attention-head scale option (a per-tensor
scale is the same scale repeated over the heads). Writing a token stores
``e4m3(clamp(x / scale, -448, 448))`` (448 is e4m3's largest finite value, so out-of-range values
saturate instead of becoming NaN; vLLM's ``__NV_SATFINITE`` conversion); reading it gives
``(x8 * scale)`` in the compute dtype (the model's, ``q``'s). Everything else of the cache
(index keys, block summaries, page ranges) and all of routing stay in the model dtype: only
``key`` and ``value`` are quantised. See docs/spec.md, "fp8 KV cache".
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "KV_CACHE_DTYPES",
    "KVCacheDtypeError",
    "kv_storage_dtype",
    "kv_cache_dtype_name",
    "is_fp8",
    "quantize_fp8",
    "dequantize_fp8",
    "fp8_scales",
    "check_scale",
]

#: The storage dtype of an fp8 cache's keys and values.
FP8_DTYPE = torch.float8_e4m3fn
#: e4m3's largest finite magnitude: quantised values saturate here.
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0

#: Accepted ``kv_cache_dtype`` names (vLLM's spellings) and the storage dtype each means;
#: ``None``: the model dtype.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp8": FP8_DTYPE,
    "fp8_e4m3": FP8_DTYPE,
}

#: Names vLLM knows that this package refuses, with the reason.
_REFUSED = {
    "fp8_e5m2": "e5m2 is not supported: the DASH fp8 cache is e4m3 only (kv_cache_dtype='fp8_e4m3')",
    "fp8_inc": "Intel Gaudi's fp8 cache is not supported (kv_cache_dtype='fp8_e4m3')",
    "fp8_ds_mla": "the MLA fp8 layout does not apply to DASH attention (kv_cache_dtype='fp8_e4m3')",
}


class KVCacheDtypeError(ValueError):
    """An unknown or unsupported ``kv_cache_dtype``, or one that does not fit the model dtype."""


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is the fp8 cache's storage dtype."""
    return dtype == FP8_DTYPE


def kv_storage_dtype(kv_cache_dtype: str | torch.dtype | None, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype ``key`` and ``value`` are stored in for ``kv_cache_dtype`` (a name of
    :data:`KV_CACHE_DTYPES`, a torch dtype, or None for ``"auto"``) in a model of ``model_dtype``.

    Only two storages exist: the model dtype (``"auto"``, or its own name) and fp8 e4m3. A 16-bit
    name for a model of another dtype is refused (the paged operator computes in ``q``'s dtype and
    reads the cache in it: a cache of another float dtype would be a silent cast)."""
    if kv_cache_dtype is None:
        return model_dtype
    if isinstance(kv_cache_dtype, torch.dtype):
        want, label = kv_cache_dtype, str(kv_cache_dtype)
        if want == torch.float8_e5m2:
            raise KVCacheDtypeError(_REFUSED["fp8_e5m2"])
    elif isinstance(kv_cache_dtype, str):
        name = kv_cache_dtype.strip().lower()
        if name in _REFUSED:
            raise KVCacheDtypeError(f"kv_cache_dtype={kv_cache_dtype!r}: {_REFUSED[name]}")
        if name not in KV_CACHE_DTYPES:
            raise KVCacheDtypeError(
                f"unknown kv_cache_dtype {kv_cache_dtype!r} (accepted: {', '.join(KV_CACHE_DTYPES)})"
            )
        want, label = KV_CACHE_DTYPES[name], repr(kv_cache_dtype)
        if want is None:
            return model_dtype
    else:
        raise KVCacheDtypeError(f"kv_cache_dtype must be a name or a torch dtype, got {type(kv_cache_dtype).__name__}")
    if want == FP8_DTYPE or want == model_dtype:
        return want
    raise KVCacheDtypeError(
        f"kv_cache_dtype {label} for a {model_dtype} model: the DASH cache stores keys and values in the "
        f"model dtype ('auto') or in fp8 e4m3 ('fp8_e4m3')"
    )


def kv_cache_dtype_name(storage: torch.dtype) -> str:
    """``"fp8_e4m3"`` for an fp8 storage, else ``"auto"`` (the model dtype)."""
    return "fp8_e4m3" if is_fp8(storage) else "auto"


def check_scale(name: str, scale, num_kv_heads: int) -> None:
    """An fp8 cache's scale: a float32 tensor [Hkv] of positive finite values."""
    if not isinstance(scale, torch.Tensor):
        raise ValueError(f"{name} must be a float32 tensor [{num_kv_heads}] (one scale per KV head), got {scale!r}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (num_kv_heads,):
        raise ValueError(
            f"{name} must be a float32 tensor [{num_kv_heads}] (one scale per KV head), "
            f"got {scale.dtype} {list(scale.shape)}"
        )
    if scale.device.type != "meta" and not bool(torch.isfinite(scale).all() & (scale > 0).all()):
        raise ValueError(f"{name} must hold positive finite scales, got {scale.tolist()}")


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` [..., Hkv, D] as e4m3: ``x / scale`` per KV head (float32), saturated to +-448, rounded
    to nearest even. NaN stays NaN."""
    y = x.float() / scale.float()[:, None]
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x8`` [..., Hkv, D] (e4m3) back in ``dtype``: ``x8 * scale`` per KV head (float32, then
    rounded to ``dtype``)."""
    return (x8.float() * scale.float()[:, None]).to(dtype)


def fp8_scales(x: torch.Tensor, margin: float = 1.0) -> torch.Tensor:
    """Per-KV-head scales [Hkv] float32 that map the largest magnitude of ``x`` [..., Hkv, D]
    (calibration keys or values) to ``448 / margin``: ``amax * margin / 448``, at least the
    smallest normal float32 (a head of zeros gets a tiny scale, not 0)."""
    if x.dim() < 2:
        raise ValueError(f"calibration tensor must be [..., Hkv, D], got {list(x.shape)}")
    if not margin >= 1.0:
        raise ValueError(f"margin must be >= 1, got {margin}")
    hkv = x.shape[-2]
    amax = x.detach().float().abs().transpose(0, -2).reshape(hkv, -1).amax(-1)
    return (amax * margin / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
