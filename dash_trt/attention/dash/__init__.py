"""DASH attention: see :mod:`dash_trt.attention`."""
