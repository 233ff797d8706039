"""Moved to :mod:`dash_trt.attention.dash.reference`; this path is the same module, kept for one release."""

import sys

from dash_trt.attention.dash import reference as _moved

sys.modules[__name__] = _moved
