"""dash-trt: DASH attention (block-sparse, page-aware RoPE) from PyTorch to
ONNX, TensorRT and Triton.

:mod:`dash_trt.attention.dash.reference` defines the function; :mod:`dash_trt.attention.dash.paged` is its
paged-KV form, the contract every kernel and plugin implements.
"""

from .attention.dash.config import DashConfig, DashConfigError

__version__ = "0.1.0"

__all__ = ["DashConfig", "DashConfigError", "__version__"]
