"""The attention families, one folder each, the same parts in each.

- :mod:`dash_trt.attention.dash`: DASH attention (Unlimited-OCR-2's block-sparse attention with
  page-aware RoPE): ``config`` (the ``sparse_attention_config`` keys), ``reference`` (the
  function), ``paged`` (its paged-KV form, the contract of every kernel and of the plugin),
  ``ops`` (PyTorch custom ops), ``onnx`` (the ``dash_trt.DashAttention`` node and its
  standard-ops function), ``cuda`` (the kernel library's binding), ``attributes`` (the node's
  and plugin's attribute table).
- :mod:`dash_trt.attention.dca`: Dual Chunk Attention: ``reference`` (the function and
  ``DcaConfig``), ``paged``, ``ops``, ``onnx`` (the ``dash_trt.DualChunkAttention`` node),
  ``kernels`` (the Triton kernels).
- :mod:`dash_trt.attention.errors`: ``ModelConfigError``, the base of every family's config error.

The modules' old top-level paths (``dash_trt.paged``, ``dash_trt.dca_ops``, ...) are the same
module objects for one release, served by the table in :mod:`dash_trt._moved`.
"""
