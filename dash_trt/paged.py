"""Moved to :mod:`dash_trt.attention.dash.paged`; this path is the same module, kept for one release."""

import sys

from dash_trt.attention.dash import paged as _moved

sys.modules[__name__] = _moved
