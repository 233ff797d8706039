"""Dual Chunk Attention: see :mod:`dash_trt.attention`."""
