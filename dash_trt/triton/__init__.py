"""Triton Inference Server deployment of a DASH model.

- :mod:`~dash_trt.serving.engine`: the generation engine (continuous batching of greedy
  generation over one paged KV pool); no Triton needed.
- :mod:`~dash_trt.triton.repository`: ``dash-triton write``, the model repository (Python
  backend generation models, the ``tensorrt_plan`` model of the exported graph).
- ``python_backend_model.py``: the Triton Python-backend ``model.py`` wrapping the engine
  (copied into the repository, not imported here).
- :mod:`~dash_trt.triton.server`: starts the ``tritonserver`` that the ``nvidia-pytriton``
  wheel ships, on 127.0.0.1 (``dash-triton serve``, the tests).
- :mod:`~dash_trt.triton.client`: ``dash-client`` and :class:`~dash_trt.triton.client.DashClient`.
- :mod:`~dash_trt.triton.loadtest`: concurrent requests checked against offline generation.
- :mod:`~dash_trt.triton_protocol` (re-exported as ``dash_trt.triton.protocol``): the models'
  inputs, outputs and parameters, shared with the OpenAI front door (:mod:`dash_trt.frontdoor`).
- ``dash-triton openai``, the OpenAI front door, is :mod:`dash_trt.frontdoor` (``openai.py`` and
  ``openai_models.py`` here re-export its names for one release).

See ``docs/triton.md``.
"""
