"""Serving a DASH model: the KV block pool (:mod:`.block_pool`), owned by the scheduler
(:mod:`.scheduler`), the model runner (:mod:`.runner`), which sees the pool only through
:class:`.kv.KVBlocks`, sampling, :func:`~.generate.generate`, the continuous-batching engine
(:mod:`.engine`) and the TensorRT backend (:mod:`.tensorrt`); free of Triton, which
:mod:`dash_trt.triton` puts in front of them."""
