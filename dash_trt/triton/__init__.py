"""Triton Inference Server deployment of a DASH model.

- :mod:`~dash_trt.triton.engine`: the generation engine (continuous batching of greedy
  generation over one paged KV pool); no Triton needed.
- :mod:`~dash_trt.triton.protocol`: the generation model's inputs, outputs and parameters.
"""
