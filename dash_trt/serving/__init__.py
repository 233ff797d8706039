"""Serving a DASH model: the KV block pool (:mod:`.block_pool`), the model runner
(:mod:`.runner`), sampling, :func:`~.generate.generate`, the continuous-batching engine
(:mod:`.engine`) and the TensorRT backend (:mod:`.tensorrt`); free of Triton, which
:mod:`dash_trt.triton` puts in front of them."""
