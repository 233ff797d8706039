"""Moved to :mod:`dash_trt.attention.dca.reference`; this path is the same module, kept for one release."""

import sys

from dash_trt.attention.dca import reference as _moved

sys.modules[__name__] = _moved
