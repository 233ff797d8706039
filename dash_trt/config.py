"""Moved to :mod:`dash_trt.attention.dash.config`; this path is the same module, kept for one release."""

import sys

from dash_trt.attention.dash import config as _moved

sys.modules[__name__] = _moved
