"""The interface of the DASH models on Triton, declared once: the repository writer
(:mod:`dash_trt.triton.repository`) puts it in ``config.pbtxt``, the Python-backend ``model.py``
reads requests with it, and the clients build requests with it (``dash-client``, the load test,
the OpenAI front door :mod:`dash_trt.frontdoor`). It sits beneath both :mod:`dash_trt.triton`
and :mod:`dash_trt.frontdoor`, so neither wing imports the other's modules for it
(``dash_trt.triton.protocol``, its former path, re-exports it).

Inputs (``max_batch_size: 0``: no batch dimension, the engine batches on its own):

==================  ===========  ======  ========  ====================================================
name                Triton type  dims    optional  meaning
==================  ===========  ======  ========  ====================================================
``input_ids``       TYPE_INT64   [-1]    no        the prompt's token ids (text bytes, ``<PAGE>``, ``<image>``)
``max_new_tokens``  TYPE_INT32   [1]     yes       tokens to generate (default: the model's parameter)
``stop_at_eos``     TYPE_BOOL    [1]     yes       stop at ``eos_token_id`` (default true)
``stop_token_ids``  TYPE_INT64   [-1]    yes       generating any of these ends the request (kept in the
                                                   output, as EOS is); at most 256
``temperature``     TYPE_FP32    [1]     yes       0 (default): greedy, identical to offline generation;
                                                   > 0: sample from logits / temperature
``top_k``           TYPE_INT32   [1]     yes       sample among the k most likely tokens (0: all)
``top_p``           TYPE_FP32    [1]     yes       sample within the smallest set of probability >= top_p
``seed``            TYPE_INT64   [1]     yes       the request's generator seed: the same seed, prompt and
                                                   parameters give the same tokens (default: random)
``page_guard``      TYPE_BOOL    [1]     yes       the page-count guard: exactly one ``<PAGE>`` in the answer
                                                   for each one of the prompt (default false)
``max_page_tokens`` TYPE_INT32   [1]     yes       with the guard: tokens a page may take before the guard
                                                   moves on (default 20000; <= 0: no cap)
``no_repeat_ngram`` TYPE_INT32   [1]     yes       mask tokens that would repeat an n-gram of this many
                                                   tokens (default 0: off)
``no_repeat_window`` TYPE_INT32  [1]     yes       ... among the last this many generated tokens (0: all)
``image_features``  TYPE_FP32    [-1,-1] yes       one row per ``<image>`` token of ``input_ids``, in order
                                                   ([image tokens, image_feature_dim]: the vision
                                                   encoder's output); only for models whose config sets
                                                   ``image_feature_dim``; absent: token embeddings
``get_stats``       TYPE_BOOL    [1]     yes       true: answer with the pool's statistics only
                                                   (``input_ids`` is then ignored and may be empty)
``engine_control``  TYPE_UINT8   [-1]    yes       ``pause`` or ``resume`` (UTF-8) the engine's model
                                                   steps, answered with the statistics; refused unless
                                                   the model was written with ``--allow-engine-control``
==================  ===========  ======  ========  ====================================================

While paused, the engine still accepts and admits requests (reserving their KV blocks) and
drops cancelled ones, but runs no model step: an operator drains or inspects it, and a test
holds requests in a known state without racing the engine.

Outputs:

======================  ============  ====  =====================================================
name                    Triton type   dims  meaning
======================  ============  ====  =====================================================
``output_ids``          TYPE_INT64    [-1]  generated token ids (all of them; in the streaming model
                                            the ones new since the previous response)
``prompt_tokens_done``  TYPE_INT64    [1]   prompt tokens prefilled so far (progress)
``prompt_tokens_cached``  TYPE_INT64  [1]   prompt tokens found in the prefix cache (not computed)
``stats``               TYPE_UINT8    [-1]  JSON statistics (UTF-8), only in answers to ``get_stats``
                                            and ``engine_control``
======================  ============  ====  =====================================================

No tensor is ``TYPE_STRING`` (BYTES): the Python backend stub of Triton 2.51 (the one in
``nvidia-pytriton`` 0.7.0) corrupts BYTES tensors under numpy 2.x, and text travels as UTF-8
in ``TYPE_UINT8`` instead (the model reads and writes every tensor through DLPack).
"""

from __future__ import annotations

INPUT_IDS = "input_ids"
MAX_NEW_TOKENS = "max_new_tokens"
STOP_AT_EOS = "stop_at_eos"
STOP_TOKEN_IDS = "stop_token_ids"
#: Sampling inputs: ``dash_trt.serving.sampling.SamplingParams`` field -> (input name, Triton type).
SAMPLING_INPUTS = {
    "temperature": ("temperature", "TYPE_FP32"),
    "top_k": ("top_k", "TYPE_INT32"),
    "top_p": ("top_p", "TYPE_FP32"),
    "seed": ("seed", "TYPE_INT64"),
}
#: Decoding-rule inputs: ``dash_trt.serving.rules.DecodingRules`` field -> (input name, Triton type).
RULE_INPUTS = {
    "page_guard": ("page_guard", "TYPE_BOOL"),
    "max_page_tokens": ("max_page_tokens", "TYPE_INT32"),
    "no_repeat_ngram": ("no_repeat_ngram", "TYPE_INT32"),
    "no_repeat_window": ("no_repeat_window", "TYPE_INT32"),
}
IMAGE_FEATURES = "image_features"
GET_STATS = "get_stats"
ENGINE_CONTROL = "engine_control"
#: Values of ``engine_control``.
CONTROL_ACTIONS = ("pause", "resume")
#: ``drain <token> <grace seconds>``: the graceful shutdown that ``dash-triton serve`` sends
#: each generation model on SIGTERM / Ctrl-C (refuse new requests, answer queued ones
#: UNAVAILABLE, give running ones the grace, then UNAVAILABLE). Served only with the token
#: that serve passes to the server's processes in DRAIN_TOKEN_ENV, so no client can drain.
DRAIN_ACTION = "drain"
DRAIN_TOKEN_ENV = "DASH_TRT_DRAIN_TOKEN"

OUTPUT_IDS = "output_ids"
PROMPT_TOKENS_DONE = "prompt_tokens_done"
PROMPT_TOKENS_CACHED = "prompt_tokens_cached"
STATS = "stats"

#: (name, Triton data type, dims, optional)
INPUTS = (
    (INPUT_IDS, "TYPE_INT64", (-1,), False),
    (MAX_NEW_TOKENS, "TYPE_INT32", (1,), True),
    (STOP_AT_EOS, "TYPE_BOOL", (1,), True),
    (STOP_TOKEN_IDS, "TYPE_INT64", (-1,), True),
    *((name, dtype, (1,), True) for name, dtype in SAMPLING_INPUTS.values()),
    *((name, dtype, (1,), True) for name, dtype in RULE_INPUTS.values()),
    (IMAGE_FEATURES, "TYPE_FP32", (-1, -1), True),
    (GET_STATS, "TYPE_BOOL", (1,), True),
    (ENGINE_CONTROL, "TYPE_UINT8", (-1,), True),
)

#: (name, Triton data type, dims)
OUTPUTS = (
    (OUTPUT_IDS, "TYPE_INT64", (-1,)),
    (PROMPT_TOKENS_DONE, "TYPE_INT64", (1,)),
    (PROMPT_TOKENS_CACHED, "TYPE_INT64", (1,)),
    (STATS, "TYPE_UINT8", (-1,)),
)

#: Triton's gRPC streaming answer carries an error's message but not its code, so the decoupled
#: model ends the message with the code, as the unary answer's gRPC status spells it:
#: ``"dash_stream: max_new_tokens must be 1..4096 [StatusCode.INVALID_ARGUMENT]"``.
STREAM_CODE_FORMAT = "{message} [{code}]"


def split_stream_code(message: str) -> tuple[str, str | None]:
    """``(message, code)`` of a streamed error (:data:`STREAM_CODE_FORMAT`; code None when absent)."""
    import re

    m = re.fullmatch(r"(.*) \[(StatusCode\.[A-Z_]+)\]", message, flags=re.S)
    return (m.group(1), m.group(2)) if m else (message, None)


#: Keys of the generation models' ``parameters`` (all strings in config.pbtxt).
PARAM_CHECKPOINT = "checkpoint"  # file name of model.pt in the version folder
PARAM_MODEL_CLASS = "model_class"  # module:Class, or file.py:Class in the version folder ("": built-in)
PARAM_DEVICE = "device"  # cpu | cuda | auto
PARAM_ENGINE = "engine_config"  # JSON of EngineConfig
PARAM_MODEL_CONFIG = "dash_model_config"  # JSON of the model's config.json (the client tokenizes with it)
PARAM_WARMUP = "warmup"  # "true": one tiny generation before the model reports ready
PARAM_TORCH_THREADS = "torch_num_threads"  # "0": torch's default
PARAM_ALLOW_CONTROL = "allow_engine_control"  # "true": engine_control requests are served

#: Default model names written by ``dash-triton write --name dash``.
DEFAULT_NAME = "dash"
STREAM_SUFFIX = "_stream"
PLAN_SUFFIX = "_plan"


# ------------------------------------------------------------------ the document model
#: ``<name>_document`` (Python backend, written when the checkpoint has a vision tower and a
#: tokenizer): a document's file in, one text section per page out. It runs the processor and
#: the vision tower in its own process and asks the generation model for the tokens (BLS).
#:
#: ==========================  ===========  ======  ========  =======================================================
#: name                        Triton type  dims    optional  meaning
#: ==========================  ===========  ======  ========  =======================================================
#: ``document``                TYPE_UINT8   [-1]    no        the file's bytes: a PDF or an image (PNG, JPEG, TIFF...);
#:                                                            several files one after the other with ``document_sizes``
#: ``document_sizes``          TYPE_INT64   [-1]    yes       the bytes of each file in ``document``, in order (their
#:                                                            pages form one document; default: one file)
#: ``document_name``           TYPE_UINT8   [-1]    yes       the files' names (UTF-8, one a line), used in messages
#: ``instruction``             TYPE_UINT8   [-1]    yes       the instruction after the pages (UTF-8; default
#:                                                            "Multi page parsing." for several pages)
#: ``crop_mode``               TYPE_INT32   [1]     yes       -1 (default): upstream's, tiles for every page; 0:
#:                                                            global views only; 1: tiles for every page
#: ``max_page_image_tokens``   TYPE_INT32   [1]     yes       image tokens a page may take (default: no limit but the
#:                                                            model's context)
#: ``max_new_tokens``          TYPE_INT32   [1]     yes       tokens to generate (default: the generation model's)
#: ``page_guard`` ...          as the generation model's decoding-rule inputs, defaults upstream's recipe
#: ==========================  ===========  ======  ========  =======================================================
#:
#: Output ``result`` (TYPE_UINT8 [-1]): UTF-8 JSON ``{"pages": [{"page": 1, "source": ..., "text": ...},
#: ...], "prompt_tokens": N, "image_tokens": I, "generated_tokens": M, "finish_reason": "stop" | "length",
#: "image_feature_cache": {"hits": .., "misses": ..}}``.
DOCUMENT_SUFFIX = "_document"
DOCUMENT = "document"
DOCUMENT_NAME = "document_name"
DOCUMENT_SIZES = "document_sizes"
#: Files a document request may hold.
MAX_DOCUMENT_FILES = 256
INSTRUCTION = "instruction"
CROP_MODE = "crop_mode"
MAX_PAGE_IMAGE_TOKENS = "max_page_image_tokens"
RESULT = "result"

DOCUMENT_INPUTS = (
    (DOCUMENT, "TYPE_UINT8", (-1,), False),
    (DOCUMENT_SIZES, "TYPE_INT64", (-1,), True),
    (DOCUMENT_NAME, "TYPE_UINT8", (-1,), True),
    (INSTRUCTION, "TYPE_UINT8", (-1,), True),
    (CROP_MODE, "TYPE_INT32", (1,), True),
    (MAX_PAGE_IMAGE_TOKENS, "TYPE_INT32", (1,), True),
    (MAX_NEW_TOKENS, "TYPE_INT32", (1,), True),
    *((name, dtype, (1,), True) for name, dtype in RULE_INPUTS.values()),
)
DOCUMENT_OUTPUTS = ((RESULT, "TYPE_UINT8", (-1,)),)

#: Parameters of the document model.
PARAM_GENERATION_MODEL = "generation_model"  # the generation model it calls
PARAM_MAX_PROMPT_TOKENS = "max_prompt_tokens"  # the longest prompt the generation model admits
PARAM_RENDER_LIMITS = "render_limits"  # JSON of documents.render.RenderLimits ("": the defaults)
#: Files of the document model's version folder.
VISION_WEIGHTS = "vision.safetensors"
DOCUMENT_CONFIG = "config.json"
