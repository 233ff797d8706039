"""dash-trt: DASH attention (block-sparse, page-aware RoPE) from PyTorch to
ONNX, TensorRT and Triton.

:mod:`dash_trt.attention.dash.reference` defines the function; :mod:`dash_trt.attention.dash.paged` is its
paged-KV form, the contract every kernel and plugin implements.
"""

from ._moved import __getattr__  # noqa: F401 - old module paths (dash_trt.paged, ...), one release
from ._moved import install as _install_moved
from .attention.dash.config import DashConfig, DashConfigError

_install_moved()

__version__ = "0.1.0"

__all__ = ["DashConfig", "DashConfigError", "__version__"]
