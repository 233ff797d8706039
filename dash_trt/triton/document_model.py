"""Triton Python-backend model: a document's file in, one text section per page out.

``dash-triton write`` copies this file to ``<repo>/<name>_document/1/model.py`` with the
checkpoint's vision tower (``vision.safetensors``), tokenizer files and ``config.json`` beside
it, when the checkpoint has a vision tower and a tokenizer. Like the generation model's
``model.py`` it runs inside Triton's Python backend stub only.

Each request: the processor (:class:`~dash_trt.documents.processor.DocumentProcessor`: PDF pages
rendered with pypdfium2 or image files decoded, views, the prompt) and the vision tower run here
(image features of a page already seen come from an LRU keyed by the page's pixels); the prompt
and features go to the generation model through a BLS request with upstream's decoding rules
(the page-count guard, no-repeat n-grams; a request may override them); the answer is split into
one section per page and decoded, each page with how it ended (``finish_reason`` ``stop``,
``length`` or ``guard``), its token count and its share of the seconds. A request without
``max_new_tokens`` gets the document's budget derived from the page budget
(:func:`~dash_trt.documents.budget.document_max_new_tokens`: every page its own
``max_page_tokens``, 20000 unless the request says), held to what the generation model admits
(its longest request after the prompt, its ``max_new_tokens_limit``). Errors: a document that
cannot be read, a page over the budget, bad options are ``INVALID_ARG`` naming the page and the
arithmetic; the generation model's errors are passed on with their code. PDFs are read and
rendered in a worker process held to the model's ``render_limits`` parameter
(:class:`~dash_trt.documents.render.RenderLimits`: CPU seconds a page and a request, memory;
``dash-triton write --render-page-seconds``, ``--render-seconds``, ``--render-memory-mb``): a
page over them is ``INVALID_ARG`` naming the page and the limit. A request cancelled by its
client (Triton's ``is_cancelled``, e.g. the front door's client went away) stops rendering
there (the worker is killed) and is answered ``CANCELLED``. The worker is warm: started at
``initialize``, it serves this instance's requests one after another (``execute`` takes one at a
time) until one kills it (a fresh one is started in the background), and ``finalize`` stops it.
Requests in one call
are independent: one failing does not fail the others. Several CPU instances
(``instance_group``) serve documents in parallel, and the generation model batches their
prompts.
"""

import json
import os
import re
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        import torch

        from dash_trt import triton_protocol as P
        from dash_trt.documents import budget
        from dash_trt.documents.pages import DocumentError
        from dash_trt.documents.processor import DocumentOptions, DocumentProcessor, split_pages
        from dash_trt.documents.render import RenderCancelled, RenderLimits
        from dash_trt.documents.tokenizer import load_tokenizer
        from dash_trt.models.config import load_model_config
        from dash_trt.models.deepencoder import DeepEncoderConfig, VisionTower
        from dash_trt.serving.documents import FeatureCache, page_features
        from dash_trt.serving.rules import DecodingRules, RulesError, document_rules

        self.torch, self.P = torch, P
        self.DocumentError, self.DocumentOptions, self.split_pages = DocumentError, DocumentOptions, split_pages
        self.DecodingRules, self.RulesError, self.document_rules = DecodingRules, RulesError, document_rules
        self.page_features = page_features
        self.RenderCancelled = RenderCancelled
        self.budget = budget
        config = json.loads(args["model_config"])
        self.name = config["name"]
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.generation_model = params[P.PARAM_GENERATION_MODEL]
        self.max_prompt_tokens = int(params.get(P.PARAM_MAX_PROMPT_TOKENS, "0") or 0)
        threads = int(params.get(P.PARAM_TORCH_THREADS, "0") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        device = params.get(P.PARAM_DEVICE, "cpu")
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        folder = os.path.join(args["model_repository"], args["model_version"])
        self.max_new_tokens_limit = _generation_limit(
            os.path.dirname(os.path.abspath(args["model_repository"])), self.generation_model
        )
        self.model_config = load_model_config(os.path.join(folder, P.DOCUMENT_CONFIG))
        self.tokenizer = load_tokenizer(folder)
        render_limits = RenderLimits.from_json(params.get(P.PARAM_RENDER_LIMITS))
        self.processor = DocumentProcessor.for_config(self.tokenizer, self.model_config, render_limits)
        self.processor.render_workers.warm()  # the first request pays no process start either
        import safetensors.torch as st

        state = st.load_file(os.path.join(folder, P.VISION_WEIGHTS))
        tower = VisionTower(DeepEncoderConfig.from_config(self.model_config))
        tower.load_state_dict(state)
        self.tower = tower.to(device).eval()
        self.cache = FeatureCache()
        pb_utils.Logger.log_info(
            f"{self.name}: documents for {self.generation_model}; vision tower on {device}; "
            f"prompts up to {self.max_prompt_tokens or 'any number of'} tokens; rendering {render_limits.to_json()}"
        )

    def finalize(self):
        """Triton unloads the model: its rendering worker is stopped (killed, waited for)."""
        processor = getattr(self, "processor", None)
        if processor is not None:
            processor.close()

    # ------------------------------------------------------------------ requests
    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except self.DocumentError as exc:
                responses.append(self._error(str(exc), pb_utils.TritonError.INVALID_ARG))
            except self.RenderCancelled as exc:
                responses.append(self._error(str(exc), _cancelled_code()))
            except _Refused as exc:
                responses.append(self._error(exc.message, exc.code))
            except Exception as exc:  # one request never takes the model down
                responses.append(self._error(f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL))
        return responses

    def _one(self, request):
        P = self.P
        t0 = time.perf_counter()
        data = self._bytes(request, P.DOCUMENT)
        if not data:
            name = (self._bytes(request, P.DOCUMENT_NAME) or b"").decode("utf-8", "replace").split("\n")[0][:200]
            raise _Refused(
                f"{name}: the file is empty"
                if name
                else f"{P.DOCUMENT} is required: the bytes of a PDF or an image file"
            )
        sizes = self._read(request, P.DOCUMENT_SIZES)
        sizes = [len(data)] if sizes is None else [int(x) for x in sizes.reshape(-1)]
        if not sizes or len(sizes) > P.MAX_DOCUMENT_FILES or min(sizes) < 1 or sum(sizes) != len(data):
            raise _Refused(
                f"{P.DOCUMENT_SIZES} must be 1..{P.MAX_DOCUMENT_FILES} positive sizes adding up to the "
                f"{len(data)} bytes of {P.DOCUMENT}, got {sizes[:8]}"
            )
        names = (self._bytes(request, P.DOCUMENT_NAME) or b"").decode("utf-8", "replace").split("\n")
        names = [n[:200] for n in names] + [f"document {i + 1}" for i in range(len(names), len(sizes))]
        if len(sizes) == 1 and not names[0]:
            names[0] = "document"
        files, start = [], 0
        for i, n in enumerate(sizes):
            files.append((names[i] or f"document {i + 1}", data[start : start + n]))
            start += n
        instruction = self._bytes(request, P.INSTRUCTION)
        crop = self._int(request, P.CROP_MODE, -1)
        if crop not in (-1, 0, 1):
            raise _Refused(f"{P.CROP_MODE} must be -1 (auto), 0 or 1, got {crop}")
        max_page = self._int(request, P.MAX_PAGE_IMAGE_TOKENS, None)
        options = self.DocumentOptions(
            crop=None if crop == -1 else bool(crop),
            instruction=None if instruction is None else instruction.decode("utf-8"),
            max_page_tokens=max_page,
        )
        max_new = self._int(request, P.MAX_NEW_TOKENS, None)
        budget = None
        if self.max_prompt_tokens:
            budget = self.max_prompt_tokens - (max_new if max_new is not None else 1) + 1
        cancelled = getattr(request, "is_cancelled", None)  # Triton 23.10 on
        # no page rendered yet: page_features renders them a few at a time as the tower takes
        # them, the request's renderer checking cancelled() between pages and while one renders
        doc = self.processor.plan(files, options, max_prompt_tokens=budget, cancelled=cancelled)
        try:
            feats = self.page_features(self.tower, doc, self.cache)
        finally:
            doc.close()
        if cancelled is not None and cancelled():  # no generation for a client gone
            raise self.RenderCancelled("the request was cancelled")
        overrides = {}
        for field, (iname, dtype) in P.RULE_INPUTS.items():
            arr = self._read(request, iname)
            if arr is not None:
                value = arr.reshape(-1)[0]
                overrides[field] = bool(value) if dtype == "TYPE_BOOL" else int(value)
        try:
            rules = self.document_rules(len(doc.pages), **overrides)
        except self.RulesError as exc:
            raise _Refused(str(exc)) from None
        if max_new is None:  # every page its own budget, within what the generation model admits
            room = self.max_new_tokens_limit
            if self.max_prompt_tokens:
                room = min(room, self.max_prompt_tokens - len(doc.prompt_ids) + 1)
            max_new = self.budget.document_max_new_tokens(len(doc.pages), rules.max_page_tokens, room)
        tokens = self._generate(doc.prompt_ids, feats, max_new, rules)
        cfg = self.model_config
        pages = self.budget.document_page_entries(
            tokens, doc, self.tokenizer, cfg, rules, seconds=time.perf_counter() - t0
        )
        result = {
            "pages": pages,
            "prompt_tokens": len(doc.prompt_ids),
            "image_tokens": sum(doc.page_tokens),
            "generated_tokens": len(tokens),
            "finish_reason": self.budget.document_finish_reason([p["finish_reason"] for p in pages]),
            "max_new_tokens": max_new,
            "max_page_tokens": rules.max_page_tokens,
            "image_feature_cache": {"hits": self.cache.hits, "misses": self.cache.misses},
        }
        blob = bytearray(json.dumps(result, ensure_ascii=False).encode("utf-8"))
        torch = self.torch
        return pb_utils.InferenceResponse(
            [pb_utils.Tensor.from_dlpack(P.RESULT, torch.frombuffer(blob, dtype=torch.uint8))]
        )

    def _generate(self, ids, feats, max_new, rules):
        P, torch = self.P, self.torch
        inputs = [
            pb_utils.Tensor.from_dlpack(P.INPUT_IDS, torch.tensor(ids, dtype=torch.int64)),
            pb_utils.Tensor.from_dlpack(P.IMAGE_FEATURES, feats.float().contiguous()),
        ]
        inputs.append(pb_utils.Tensor.from_dlpack(P.MAX_NEW_TOKENS, torch.tensor([max_new], dtype=torch.int32)))
        for field, (iname, dtype) in P.RULE_INPUTS.items():
            value = getattr(rules, field)
            t = torch.tensor([value], dtype=torch.bool if dtype == "TYPE_BOOL" else torch.int32)
            inputs.append(pb_utils.Tensor.from_dlpack(iname, t))
        bls = pb_utils.InferenceRequest(
            model_name=self.generation_model, inputs=inputs, requested_output_names=[P.OUTPUT_IDS]
        )
        response = bls.exec()
        if response.has_error():
            err = response.error()
            code = err.code() if hasattr(err, "code") else pb_utils.TritonError.INTERNAL
            raise _Refused(f"{self.generation_model}: {err.message()}", code)
        out = pb_utils.get_output_tensor_by_name(response, P.OUTPUT_IDS)
        return torch.utils.dlpack.from_dlpack(out.to_dlpack()).cpu().tolist()

    # ------------------------------------------------------------------ tensors
    def _read(self, request, name):
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is None:
            return None
        return self.torch.utils.dlpack.from_dlpack(t.to_dlpack()).cpu().numpy()

    def _bytes(self, request, name):
        arr = self._read(request, name)
        return None if arr is None else np.ascontiguousarray(arr, dtype=np.uint8).tobytes()

    def _int(self, request, name, default):
        arr = self._read(request, name)
        if arr is None:
            return default
        if arr.size != 1:
            raise _Refused(f"{name} must hold one value, got shape {list(arr.shape)}")
        return int(arr.reshape(-1)[0])

    def _error(self, message, code):
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


def _generation_limit(repository, name):
    """The generation model's ``max_new_tokens_limit``: from the engine configuration in its
    config.pbtxt beside this model (what ``dash-triton write`` writes), else the engine's default."""
    from dash_trt import triton_protocol as P
    from dash_trt.serving.engine import EngineConfig

    try:
        with open(os.path.join(repository, name, "config.pbtxt"), encoding="utf-8") as fh:
            text = fh.read()
        pattern = r'key:\s*"' + P.PARAM_ENGINE + r'"\s*value\s*\{\s*string_value:\s*"((?:[^"\\]|\\.)*)"'
        found = re.search(pattern, text)
        engine = json.loads(re.sub(r"\\(.)", r"\1", found.group(1))) if found else {}
        return int(engine.get("max_new_tokens_limit") or EngineConfig.max_new_tokens_limit)
    except (OSError, ValueError, TypeError, AttributeError):
        return EngineConfig.max_new_tokens_limit


def _cancelled_code():
    """Triton's CANCELLED error code (UNAVAILABLE on a Python backend without it)."""
    return getattr(pb_utils.TritonError, "CANCELLED", pb_utils.TritonError.UNAVAILABLE)


class _Refused(Exception):
    def __init__(self, message, code=None):
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else pb_utils.TritonError.INVALID_ARG
