"""The versions that must agree between this package, its kernel library and the TensorRT
plugin an engine was built with (nothing here imports torch or loads a library)."""

from __future__ import annotations

from . import __version__

__all__ = ["KERNEL_ABI_VERSION", "PLUGIN_VERSION", "version_line"]

#: ``DASH_ABI_VERSION`` of plugins/include/dash/params.h that this package's binding mirrors.
KERNEL_ABI_VERSION = 9

#: Version string of the DASH attention node/plugin contract (ONNX attribute
#: ``plugin_version``; the TensorRT plugin creator registers the same version). "2": the
#: function is Unlimited-OCR-2's DASH (entmax prior routing) and the attributes its keys;
#: a node of version "1" computed the withdrawn routing and finds no plugin.
PLUGIN_VERSION = "2"


def version_line() -> str:
    """``dash-trt X (kernel ABI N, plugin V)``: what every command's ``--version`` prints."""
    return f"dash-trt {__version__} (kernel ABI {KERNEL_ABI_VERSION}, plugin {PLUGIN_VERSION})"
