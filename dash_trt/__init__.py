"""dash-trt: DASH attention (block-sparse, page-aware RoPE) from PyTorch to
ONNX, TensorRT and Triton.

:mod:`dash_trt.reference` defines the function; :mod:`dash_trt.paged` is its
paged-KV form, the contract every kernel and plugin implements.
"""

from .config import DashConfig, DashConfigError

__version__ = "0.1.0"

__all__ = ["DashConfig", "DashConfigError", "__version__"]
