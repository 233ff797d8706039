"""Moved to :mod:`dash_trt.attention.dca.onnx`; this path is the same module, kept for one release."""

import sys

from dash_trt.attention.dca import onnx as _moved

sys.modules[__name__] = _moved
