"""Moved to :mod:`dash_trt.attention.dash.cuda`; this path is the same module, kept for one release."""

import sys

from dash_trt.attention.dash import cuda as _moved

sys.modules[__name__] = _moved
