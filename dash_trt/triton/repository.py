"""Write a Triton model repository for a DASH model (``dash-triton write``).

Layout (model names from ``--name``, default ``dash``)::

    REPO/
      README.md                 how to serve it (written for this repository)
      dash/                     Python backend, unary (HTTP and gRPC): the generation service
        config.pbtxt
        1/model.py              dash_trt/triton/python_backend_model.py, copied
        1/model.pt              the checkpoint
      dash_stream/              the same service, decoupled: progress and tokens as they come (gRPC streaming)
        config.pbtxt
        1/model.py, 1/model.pt
      dash_plan/                only with --plan (and --onnx): the TensorRT engine, one forward step
        config.pbtxt            inputs/outputs and dims read from the ONNX file, dynamic axes -1
        1/model.plan
        1/libdash_trt_plugin_static.so  the plugin library Triton loads: registers itself when
                                        dlopened (--backend-config=tensorrt,plugins=<this file>)
        1/libdash_trt_plugin.so         the plugin code it links against ($ORIGIN)

Every ``config.pbtxt`` is plain protobuf text of Triton's ``inference.ModelConfig``
(the tests parse each one with the schema shipped in ``tritonclient``).

The repository is built in a temporary folder beside ``REPO`` and renamed into place,
so it appears complete or not at all.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import save_file

from .. import triton_protocol as P
from ..documents.render import RenderLimits
from ..fileio import file_mode
from ..modeling import DashModel
from ..models.checkpoint import CheckpointError, read_folder
from ..models.deepencoder import tower_state
from ..models.families import family_of
from ..models.interface import DOCUMENTS, TENSORRT
from ..models.registry import USER_MODULE_PREFIX
from ..onnx_graph import GraphIO, GraphReadError, GraphTensor, read_graph
from ..serving.engine import EngineConfig
from ..serving.limits import longest_request

__all__ = [
    "RepositoryError",
    "TensorSpec",
    "Enum",
    "to_pbtxt",
    "onnx_io",
    "python_model_config",
    "plan_model_config",
    "plugin_libraries",
    "PLUGIN_LIBRARY",
    "write_repository",
    "WrittenRepository",
    "PYTHON_MODEL_SOURCE",
    "NO_PLAN_MESSAGE",
]

#: The Python-backend model file copied into each generation model's version folder.
PYTHON_MODEL_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "python_backend_model.py")
DOCUMENT_MODEL_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "document_model.py")
#: Tokenizer files a document model carries from the checkpoint folder (those present).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

NO_PLAN_MESSAGE = (
    "no --plan given: the tensorrt_plan model was not written. Build a TensorRT engine from the ONNX file "
    "(with the DASH plugin, against the TensorRT version of your Triton server) and pass --plan model.plan "
    "--onnx model.onnx --plugin build/plugins/trt/libdash_trt_plugin_static.so."
)

#: The plugin library Triton's TensorRT backend loads, and the one it links against. The backend
#: only dlopens the libraries named in --backend-config=tensorrt,plugins=... (after loading
#: libnvinfer; tensorrt_backend src/tensorrt.cc, r24.12 to r26.01): it calls no entry point,
#: so the library must register its creator itself when loaded, which the static variant does.
PLUGIN_LIBRARY = "libdash_trt_plugin_static.so"
PLUGIN_DEPENDENCY = "libdash_trt_plugin.so"

#: What the tensorrt_plan model costs: Triton's TensorRT backend gives every input and output its
#: own device buffer (instance_state.cc), so present.* cannot be bound to past.*: each request
#: carries the whole KV pool in and out. For serving, the generation models own the pool.
PLAN_MODEL_NOTE = (
    "Triton's TensorRT backend gives every input and output its own buffer, so present.* cannot be bound to "
    "past.*: every request ships the whole KV cache in and out. This model is for inspecting and checking the "
    "engine; serving runs the generation models, which keep the pool in place."
)


class RepositoryError(ValueError):
    """Bad input for the repository (missing file, inconsistent ONNX and checkpoint, ...)."""


# --------------------------------------------------------------------- pbtxt
class Enum(str):
    """An enum value: written bare (``KIND_CPU``), not quoted."""


def _quote(s: str) -> str:
    out = ['"']
    for b in s.encode("utf-8"):
        c = chr(b)
        if c == '"':
            out.append('\\"')
        elif c == "\\":
            out.append("\\\\")
        elif c == "\n":
            out.append("\\n")
        elif 32 <= b < 127:
            out.append(c)
        else:  # octal escapes are valid protobuf text for any byte
            out.append(f"\\{b:03o}")
    out.append('"')
    return "".join(out)


def _scalar(v: Any) -> str:
    if isinstance(v, Enum):
        return str(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return _quote(v)
    raise TypeError(f"cannot write {type(v).__name__} to pbtxt")


def to_pbtxt(message: Mapping[str, Any], indent: int = 0) -> str:
    """Protobuf text of a message given as a dict: dicts are messages, lists of
    dicts repeated messages, lists of scalars repeated scalars, :class:`Enum`
    values bare identifiers; ``None`` values are left out; keys starting with
    ``#`` become comments."""
    pad = "  " * indent
    lines = []
    for key, val in message.items():
        if val is None:
            continue
        if key.startswith("#"):
            lines += [f"{pad}# {line}".rstrip() for line in str(val).splitlines()]
        elif isinstance(val, Mapping):
            lines.append(f"{pad}{key} {{\n{to_pbtxt(val, indent + 1)}{pad}}}")
        elif isinstance(val, (list, tuple)) and val and all(isinstance(x, Mapping) for x in val):
            items = [f"{pad}  {{\n{to_pbtxt(x, indent + 2)}{pad}  }}" for x in val]
            lines.append(f"{pad}{key} [\n" + ",\n".join(items) + f"\n{pad}]")
        elif isinstance(val, (list, tuple)):
            lines.append(f"{pad}{key}: [ " + ", ".join(_scalar(x) for x in val) + " ]")
        else:
            lines.append(f"{pad}{key}: {_scalar(val)}")
    return "".join(line + "\n" for line in lines)


# ---------------------------------------------------------------------- ONNX
@dataclass(frozen=True)
class TensorSpec:
    """A model input or output as Triton declares it."""

    name: str
    data_type: str  #: TYPE_*
    dims: tuple[int, ...]  #: -1 for a dynamic axis

    def to_config(self) -> dict[str, Any]:
        return {"name": self.name, "data_type": Enum(self.data_type), "dims": list(self.dims)}


#: ONNX TensorProto element type name -> Triton data type.
ONNX_TO_TRITON = {
    "FLOAT": "TYPE_FP32",
    "FLOAT16": "TYPE_FP16",
    "BFLOAT16": "TYPE_BF16",
    "DOUBLE": "TYPE_FP64",
    "INT8": "TYPE_INT8",
    "INT16": "TYPE_INT16",
    "INT32": "TYPE_INT32",
    "INT64": "TYPE_INT64",
    "UINT8": "TYPE_UINT8",
    "UINT16": "TYPE_UINT16",
    "UINT32": "TYPE_UINT32",
    "UINT64": "TYPE_UINT64",
    "BOOL": "TYPE_BOOL",
    "STRING": "TYPE_STRING",
}


def onnx_io(path: str | os.PathLike) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Graph inputs and outputs of an ONNX file (:func:`dash_trt.onnx_graph.read_graph`; weights are
    not loaded): names, Triton data types, dims with every symbolic or unknown axis as -1."""
    try:
        graph = read_graph(path)
    except GraphReadError as exc:
        raise RepositoryError(str(exc)) from None

    def spec(t: GraphTensor) -> TensorSpec:
        if t.elem_type is None:
            raise RepositoryError(f"{graph.path}: graph input/output '{t.name}' is not a tensor")
        if t.elem_type not in ONNX_TO_TRITON:
            raise RepositoryError(f"{graph.path}: '{t.name}' has ONNX type {t.elem_type}, which Triton cannot serve")
        if t.dims is None:
            raise RepositoryError(f"{graph.path}: '{t.name}' has no shape (rank unknown); Triton needs dims")
        return TensorSpec(t.name, ONNX_TO_TRITON[t.elem_type], tuple(d if d > 0 else -1 for d in t.dims))

    inputs = [spec(t) for t in graph.inputs]
    outputs = [spec(t) for t in graph.outputs]
    if not inputs or not outputs:
        raise RepositoryError(f"{graph.path}: the graph has no inputs or no outputs")
    return inputs, outputs


def _plan_sizing(
    plan: str, onnx: str, inputs: list[TensorSpec], outputs: list[TensorSpec]
) -> tuple[list[TensorSpec], list[TensorSpec], str]:
    """The plan model's inputs and outputs with the dims its engine's profile fixes (from the
    record dash-build writes beside the plan), and a line saying what Triton will allocate."""
    from ..build import PROFILE_SUFFIX, fixed_dims, read_profile_record

    try:
        record = read_profile_record(plan)
    except ValueError as exc:
        raise RepositoryError(str(exc)) from None
    if record is None:
        return (
            inputs,
            outputs,
            f"no {os.path.basename(plan)}{PROFILE_SUFFIX} beside the plan: how much memory Triton's TensorRT "
            "backend will take is not known here (it allocates every input and output at the engine profile's "
            "maximum); dash-build writes that record (and prints the figure), also with --print-trtexec --out",
        )
    io = read_graph(onnx)
    graph = {t.name: t for t in (*io.inputs, *io.outputs)}

    def sized(spec: TensorSpec) -> TensorSpec:
        names = graph[spec.name].dim_names if spec.name in graph else ()
        return TensorSpec(spec.name, spec.data_type, fixed_dims(spec.name, spec.dims, names, record))

    gib = int(record["binding_bytes"]) / 2**30
    unknown = record.get("binding_bytes_unknown") or []
    line = (
        f"the tensorrt_plan model: Triton's TensorRT backend allocates {'at least ' if unknown else ''}{gib:.2f} GiB "
        f"per instance (every input and output at the profile's maximum, {record['kv_blocks']} KV blocks)"
    )
    return [sized(s) for s in inputs], [sized(s) for s in outputs], line


def _check_onnx_matches(graph: GraphIO, model: DashModel, kv_block_size: int) -> None:
    """The ONNX graph and the checkpoint must be the same model (layers, cache shapes,
    vocabulary: :meth:`GraphIO.mismatches`) with the generation models' KV block size."""
    problems = []
    if graph.kv_block_size not in (None, kv_block_size):
        problems.append(
            f"KV blocks of {graph.kv_block_size} tokens, the generation models use {kv_block_size} "
            f"(pass --kv-block-size {graph.kv_block_size})"
        )
    problems += graph.mismatches(model, kv_block_size)
    if problems:
        raise RepositoryError(f"{graph.path} does not match the checkpoint: " + "; ".join(problems))


def onnx_kv_block_size(path: str | os.PathLike) -> int | None:
    """The KV block size fixed in an exported graph (:attr:`GraphIO.kv_block_size`), if any."""
    try:
        return read_graph(path).kv_block_size
    except GraphReadError as exc:
        raise RepositoryError(str(exc)) from None


# ----------------------------------------------------------------- configs
def _check_gpus(device: str, gpus: Sequence[int] | None) -> None:
    if gpus is None:
        return
    if device != "cuda":
        raise RepositoryError("--gpus needs --device cuda (it picks the GPUs of KIND_GPU instances)")
    if (
        not gpus
        or any(isinstance(g, bool) or not isinstance(g, int) or g < 0 for g in gpus)
        or len(set(gpus)) != len(gpus)
    ):
        raise RepositoryError(f"--gpus must list distinct GPU ids >= 0, got {list(gpus)!r}")


def python_model_config(
    name: str,
    model: DashModel,
    engine: EngineConfig,
    *,
    streaming: bool,
    device: str = "cpu",
    checkpoint: str = "model.pt",
    model_class: str = "",
    warmup: bool = True,
    torch_num_threads: int = 0,
    allow_engine_control: bool = False,
    gpus: Sequence[int] | None = None,
) -> dict[str, Any]:
    """config.pbtxt (as a dict) of a Python-backend generation model. ``gpus`` (with
    ``device="cuda"``): the GPUs that get an instance, each with its own engine and KV pool
    (data parallel; default every GPU Triton sees)."""
    if device not in ("cpu", "cuda"):
        raise RepositoryError(f"device must be 'cpu' or 'cuda', got {device!r}")
    _check_gpus(device, gpus)
    inputs = []
    for iname, dtype, dims, optional in P.INPUTS:
        spec = {"name": iname, "data_type": Enum(dtype), "dims": list(dims)}
        if optional:
            spec["optional"] = True
        inputs.append(spec)
    outputs = [{"name": oname, "data_type": Enum(dtype), "dims": list(dims)} for oname, dtype, dims in P.OUTPUTS]
    kind = "KIND_GPU" if device == "cuda" else "KIND_CPU"
    mode = (
        "decoupled: progress and each new token are sent as they come (gRPC streaming only)"
        if streaming
        else "unary: one response per request (HTTP and gRPC)"
    )
    return {
        "# ": (
            f"DASH generation service ({mode}), written by dash-triton.\n"
            "One instance owns one paged KV pool; its engine thread batches every request in flight\n"
            "(continuous batching), so requests are not batched by Triton (max_batch_size 0)."
        ),
        "name": name,
        "backend": "python",
        "max_batch_size": 0,
        "model_transaction_policy": {"decoupled": bool(streaming)},
        "input": inputs,
        "output": outputs,
        # One instance per device: a second instance would be a second process with a
        # second pool, halving what each can admit. With KIND_GPU, Triton starts one per GPU
        # (of `gpus`, when given), each on its own device with its own pool: data parallel,
        # Triton spreading the requests over them.
        "instance_group": [{"kind": Enum(kind), "count": 1, **({"gpus": [int(g) for g in gpus]} if gpus else {})}],
        "parameters": [
            {"key": P.PARAM_CHECKPOINT, "value": {"string_value": checkpoint}},
            {"key": P.PARAM_MODEL_CLASS, "value": {"string_value": model_class}},
            {"key": P.PARAM_DEVICE, "value": {"string_value": device}},
            {"key": P.PARAM_ENGINE, "value": {"string_value": engine.to_json()}},
            {
                "key": P.PARAM_MODEL_CONFIG,
                "value": {"string_value": json.dumps(model.config.to_dict(), sort_keys=True)},
            },
            {"key": P.PARAM_WARMUP, "value": {"string_value": "true" if warmup else "false"}},
            {"key": P.PARAM_TORCH_THREADS, "value": {"string_value": str(int(torch_num_threads))}},
            {"key": P.PARAM_ALLOW_CONTROL, "value": {"string_value": "true" if allow_engine_control else "false"}},
        ],
    }


def document_model_config(
    name: str,
    generation_model: str,
    *,
    max_prompt_tokens: int,
    device: str = "cpu",
    instances: int = 2,
    torch_num_threads: int = 0,
    render_limits: RenderLimits | None = None,
) -> dict[str, Any]:
    """config.pbtxt (as a dict) of the document model (:mod:`dash_trt.triton.document_model`).
    ``render_limits``: what reading and rendering one request's PDFs may take (the defaults
    when None)."""
    if instances < 1:
        raise RepositoryError(f"document model instances must be >= 1, got {instances}")
    inputs = []
    for iname, dtype, dims, optional in P.DOCUMENT_INPUTS:
        spec = {"name": iname, "data_type": Enum(dtype), "dims": list(dims)}
        if optional:
            spec["optional"] = True
        inputs.append(spec)
    outputs = [{"name": o, "data_type": Enum(t), "dims": list(d)} for o, t, d in P.DOCUMENT_OUTPUTS]
    return {
        "# ": (
            "DASH documents: a PDF or image in, one text section per page out (JSON), written by dash-triton.\n"
            f"Pages, views, the prompt and the vision tower run here; {generation_model} generates (BLS).\n"
            "Each instance is a process of its own: instances serve documents in parallel."
        ),
        "name": name,
        "backend": "python",
        "max_batch_size": 0,
        "input": inputs,
        "output": outputs,
        "instance_group": [{"kind": Enum("KIND_CPU"), "count": int(instances)}],
        "parameters": [
            {"key": P.PARAM_GENERATION_MODEL, "value": {"string_value": generation_model}},
            {"key": P.PARAM_MAX_PROMPT_TOKENS, "value": {"string_value": str(int(max_prompt_tokens))}},
            {"key": P.PARAM_DEVICE, "value": {"string_value": device}},
            {"key": P.PARAM_TORCH_THREADS, "value": {"string_value": str(int(torch_num_threads))}},
            {"key": P.PARAM_RENDER_LIMITS, "value": {"string_value": (render_limits or RenderLimits()).to_json()}},
        ],
    }


def document_sources(folder: str | None) -> tuple[str, dict[str, torch.Tensor]] | None:
    """(the folder, its vision tower's tensors) when ``folder`` is a checkpoint folder with a
    tokenizer and a vision tower (what the document model needs), else None."""
    if folder is None or not os.path.isdir(folder) or not os.path.isfile(os.path.join(folder, TOKENIZER_FILES[0])):
        return None
    try:
        state, _ = read_folder(folder)
    except CheckpointError:
        return None
    tower = tower_state(state)
    return (folder, tower) if tower else None


def plan_model_config(
    name: str,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    *,
    instances: int = 1,
    gpus: Sequence[int] | None = None,
) -> dict[str, Any]:
    """config.pbtxt (as a dict) of the ``tensorrt_plan`` model: one forward step of
    the exported graph; the caller owns the cache (it passes ``past.*`` in and gets
    ``present.*`` back) and the block tables."""
    if instances < 1:
        raise RepositoryError(f"plan instances must be >= 1, got {instances}")
    group: dict[str, Any] = {"kind": Enum("KIND_GPU"), "count": int(instances)}
    if gpus:
        group["gpus"] = [int(g) for g in gpus]
    return {
        "# ": (
            "TensorRT engine of the exported DASH graph, written by dash-triton. The DASH plugin must be\n"
            f"loaded into tritonserver: {PLUGIN_LIBRARY} (in the version folder, beside\n"
            f"{PLUGIN_DEPENDENCY}) registers its creator when the TensorRT backend opens it:\n"
            f"  tritonserver --model-repository=<repo> --backend-config=tensorrt,plugins=<repo>/{name}/1/"
            f"{PLUGIN_LIBRARY}\n"
            "Build plan and plugin against the TensorRT version of the server.\n"
            + "\n".join(_wrap(PLAN_MODEL_NOTE))
            + "\n"
            "Inputs/outputs and dims come from the ONNX graph (dynamic axes are -1); no batch\n"
            "dimension: the graph takes ragged batches of tokens with their block tables."
        ),
        "name": name,
        "platform": "tensorrt_plan",
        "max_batch_size": 0,
        "default_model_filename": "model.plan",
        "input": [s.to_config() for s in inputs],
        "output": [s.to_config() for s in outputs],
        "instance_group": [group],
    }


def _wrap(text: str, width: int = 96) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width)


def plugin_libraries(plugin: str) -> tuple[str, str]:
    """(the self-registering library, the one it links against) for ``--plugin``: either file
    of the plugin build, the other one found beside it."""
    folder, base = os.path.dirname(os.path.abspath(plugin)), os.path.basename(plugin)
    if base == PLUGIN_DEPENDENCY:
        pair = (os.path.join(folder, PLUGIN_LIBRARY), os.path.abspath(plugin))
    else:
        pair = (os.path.abspath(plugin), os.path.join(folder, PLUGIN_DEPENDENCY))
    for path in pair:
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            raise RepositoryError(
                f"plugin library not found or empty: {path}. Triton's TensorRT backend loads {PLUGIN_LIBRARY} (which "
                f"registers the DashAttention creator when it is opened) and that needs {PLUGIN_DEPENDENCY} beside "
                f"it: pass --plugin build/plugins/trt/{PLUGIN_LIBRARY} from a plugin build (plugins/trt/README.md)"
            )
    return pair


# ---------------------------------------------------------------- the writer
@dataclass
class WrittenRepository:
    path: str
    models: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


#: Characters a repository path may hold: Triton's Python backend starts each model's stub
#: through a shell with the model's path in the command line, so ``$(...)``, ``;``, quotes,
#: spaces and the like would be run or split by that shell.
_SAFE_CHAR = re.compile(r"[A-Za-z0-9._/+@:,=~%-]")


def check_served_path(path: str) -> None:
    """RepositoryError unless ``path`` is safe to hand to Triton's Python backend."""
    bad = sorted(set(_SAFE_CHAR.sub("", path)))
    if bad:
        raise RepositoryError(
            f"the repository path {path!r} holds {''.join(bad)!r}: Triton's Python backend starts its models through "
            "a shell, which would run or split such characters; "
            "use a path of letters, digits and . _ / + @ : , = ~ % -"
        )


def model_class_source(model: DashModel) -> tuple[str | None, str]:
    """``(file to copy into the version folder or None, the model_class parameter)`` of a
    model: "" for the built-in DashForCausalLM; a class loaded from a file (``--model
    path/file.py:Class``) is served from a copy of that file ("file.py:Class"); any other class
    as ``module:Class``, which the server's Python must import (PYTHONPATH or an installed
    package)."""
    from ..models.registry import is_default_class, model_class_spec

    cls = type(model)
    if is_default_class(cls):
        return None, ""
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    if cls.__module__.startswith(USER_MODULE_PREFIX) and path and os.path.isfile(path):
        if os.path.basename(path) in ("model.py",):
            raise RepositoryError(
                f"the model class's file is named {os.path.basename(path)}, which is the Python "
                f"backend's own file in the repository: rename it"
            )
        return path, f"{os.path.basename(path)}:{cls.__qualname__}"
    return None, model_class_spec(cls)


#: The file that marks a folder as a repository ``dash-triton write`` wrote (and so may replace);
#: after a line of text it lists what was written (:func:`_manifest`).
MARKER = ".dash-trt-repository"


def _manifest(folder: str) -> dict[str, int | None]:
    """Every file (relative path -> size) and folder (-> None) under ``folder`` but the marker;
    symlinks are listed as files of size -1 (this tool writes none)."""
    found: dict[str, int | None] = {}
    for root, dirs, files in os.walk(folder):
        for entry in dirs + files:
            path = os.path.join(root, entry)
            rel = os.path.relpath(path, folder)
            if rel == MARKER:
                continue
            if os.path.islink(path):
                found[rel] = -1
            else:
                found[rel] = None if entry in dirs else os.path.getsize(path)
    return found


def _bytecode_cache(rel: str, size: int | None) -> bool:
    """A ``__pycache__`` folder or a ``.pyc`` file in one: what Triton's Python backend writes
    beside a served ``model.py`` (replacing the repository loses nothing of the user's)."""
    parts = rel.split(os.sep)
    if parts[-1] == "__pycache__":
        return size is None
    return (
        len(parts) > 1 and parts[-2] == "__pycache__" and parts[-1].endswith(".pyc") and size is not None and size >= 0
    )


def _not_replaceable(out: str) -> str | None:
    """Why ``--force`` may not replace the existing folder ``out``, or None when it may: an empty
    folder, or a repository this tool wrote holding only what it wrote there (its marker lists
    each file and its size; a file added or changed since is the user's)."""
    if not os.listdir(out):
        return None
    try:
        with open(os.path.join(out, MARKER), encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return f"it has no {MARKER} (not a repository dash-triton wrote)"
    try:
        written = json.loads(text.split("\n", 1)[1])["written"]
        assert isinstance(written, dict)
    except (IndexError, ValueError, KeyError, TypeError, AssertionError):
        return f"its {MARKER} does not list what dash-triton wrote there (an older or a foreign one)"
    now = {rel: size for rel, size in _manifest(out).items() if not _bytecode_cache(rel, size)}
    foreign = sorted(rel for rel, size in now.items() if rel not in written or written[rel] != size)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        return f"it holds what dash-triton did not write there, or changed since: {shown}"
    return None


def _check_destination(out: str, force: bool) -> None:
    """RepositoryError unless ``out`` may be written: new, or (``force``) empty or a repository
    this module wrote holding nothing else, in a folder that exists."""
    if os.path.exists(out) and not force:
        raise RepositoryError(f"{out} already exists (pass --force to replace it)")
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise RepositoryError(f"cannot write {out}: it is a file, not a folder")
        why = _not_replaceable(out)
        if why is not None:
            raise RepositoryError(
                f"--force replaces only a repository that dash-triton wrote, holding only what it wrote, or an empty "
                f"folder; {out}: {why}. Nothing was changed: choose another --out, or remove it yourself"
            )
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise RepositoryError(f"cannot write {out}: folder {parent} does not exist")


def _write_generation_models(tmp: str, model, family, names, checkpoint, class_file, *, engine, **config) -> list[str]:
    """The Python-backend generation models ``names`` (``(name, streaming)``) in ``tmp``: the
    backend file, the user's model source, the family's checkpoint (a DASH model's model.pt, a
    DCA model's Hugging Face folder) written once and linked into the other version folders,
    and each config. Returns the names."""
    first_ckpt = None
    for model_name, stream in names:
        vdir = os.path.join(tmp, model_name, "1")
        os.makedirs(vdir)
        shutil.copyfile(PYTHON_MODEL_SOURCE, os.path.join(vdir, "model.py"))
        if class_file is not None:  # the user's model source travels with the repository
            shutil.copyfile(class_file, os.path.join(vdir, os.path.basename(class_file)))
        ckpt = os.path.join(vdir, family.checkpoint_name)
        if first_ckpt is not None and os.path.isdir(first_ckpt):
            shutil.copytree(first_ckpt, ckpt, copy_function=_link_or_copy)
        elif first_ckpt is not None:
            _link_or_copy(first_ckpt, ckpt)
        else:
            family.save(model, ckpt, checkpoint)
        first_ckpt = first_ckpt or ckpt
        cfg = python_model_config(
            model_name, model, engine, streaming=stream, checkpoint=os.path.basename(ckpt), **config
        )
        _write(os.path.join(tmp, model_name, "config.pbtxt"), to_pbtxt(cfg))
    return [n for n, _ in names]


def _write_document_model(tmp: str, name: str, docs, model, engine: EngineConfig, **config) -> str:
    """The ``<name>_document`` model in ``tmp``: the backend file, the vision tower's weights,
    the tokenizer files and the decoder's config. Returns its name."""
    doc_name = name + P.DOCUMENT_SUFFIX
    vdir = os.path.join(tmp, doc_name, "1")
    os.makedirs(vdir)
    shutil.copyfile(DOCUMENT_MODEL_SOURCE, os.path.join(vdir, "model.py"))
    save_file({k: v.contiguous() for k, v in docs[1].items()}, os.path.join(vdir, P.VISION_WEIGHTS))
    for fname in TOKENIZER_FILES:
        src = os.path.join(docs[0], fname)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(vdir, fname))
    _write(os.path.join(vdir, P.DOCUMENT_CONFIG), json.dumps(model.config.to_dict(), indent=2) + "\n")
    limit = longest_request(engine.to_json())
    dcfg = document_model_config(doc_name, name, max_prompt_tokens=limit, **config)
    _write(os.path.join(tmp, doc_name, "config.pbtxt"), to_pbtxt(dcfg))
    return doc_name


def _write_plan_model(tmp: str, out: str, plan_cfg: dict, plan: str, libraries) -> str:
    """The ``tensorrt_plan`` model in ``tmp``: the engine and the plugin libraries. Returns the
    message that says how to start the server for it."""
    vdir = os.path.join(tmp, plan_cfg["name"], "1")
    os.makedirs(vdir)
    shutil.copyfile(plan, os.path.join(vdir, "model.plan"))
    for lib, target in zip(libraries, (PLUGIN_LIBRARY, PLUGIN_DEPENDENCY)):
        shutil.copy2(lib, os.path.join(vdir, target))
    _write(os.path.join(tmp, plan_cfg["name"], "config.pbtxt"), to_pbtxt(plan_cfg))
    return (
        f"{plan_cfg['name']}: start tritonserver with --backend-config=tensorrt,plugins="
        f"{out}/{plan_cfg['name']}/1/{PLUGIN_LIBRARY}. {PLAN_MODEL_NOTE}"
    )


def _seal(tmp: str, out: str, private: bool) -> None:
    """Give ``tmp``'s files the umask's modes (or private ones), write the marker, and move it to
    ``out`` (the old repository moves aside first: a failure leaves one of the two)."""
    for root, dirs, files in os.walk(tmp):  # the umask's modes (mkdtemp made the top 0700), or private
        for entry in dirs:
            os.chmod(os.path.join(root, entry), file_mode(directory=True, private=private))
        for entry in files:  # every file too: safetensors' save_file leaves its own 0600
            os.chmod(os.path.join(root, entry), file_mode(private=private))
    os.chmod(tmp, file_mode(directory=True, private=private))
    _write(
        os.path.join(tmp, MARKER),
        "A Triton model repository written by `dash-triton write`; `dash-triton write --force` may replace "
        "this folder while it holds only these files:\n" + json.dumps({"written": _manifest(tmp)}, indent=1) + "\n",
    )
    if private:
        os.chmod(os.path.join(tmp, MARKER), file_mode(private=True))
    old = None
    if os.path.exists(out):
        old = tempfile.mkdtemp(prefix=".dash-triton-old-", dir=os.path.dirname(out))
        os.replace(out, os.path.join(old, "repo"))
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_repository(
    out: str | os.PathLike,
    model: DashModel,
    *,
    checkpoint: str | None = None,
    engine: EngineConfig | None = None,
    name: str = P.DEFAULT_NAME,
    device: str = "cpu",
    streaming: bool = True,
    onnx: str | None = None,
    plan: str | None = None,
    plugin: str | None = None,
    plan_instances: int = 1,
    plan_gpus: Sequence[int] | None = None,
    warmup: bool = True,
    torch_num_threads: int = 0,
    allow_engine_control: bool = False,
    force: bool = False,
    gpus: Sequence[int] | None = None,
    documents: str | None = None,
    document_instances: int = 2,
    render_limits: RenderLimits | None = None,
    private: bool = False,
) -> WrittenRepository:
    """Write the repository at ``out``.

    Its files and folders get the modes of the umask (as ``open`` and ``mkdir`` give them), so a
    server running as another user can read it where the umask allows; ``private``: readable by
    the owner only (0600 files, 0700 folders). ``force`` replaces an existing ``out`` only when
    it is empty or a repository this function wrote holding nothing else.

    ``model`` is the loaded checkpoint (its config goes into the parameters);
    ``checkpoint`` the ``model.pt`` to copy (written from ``model`` when None).
    The plan model needs ``plan``, ``onnx`` and ``plugin`` together. ``documents``: the checkpoint
    folder, when it holds a vision tower and a tokenizer: a ``<name>_document`` model is written
    too (``document_instances`` CPU instances), documents in, text out, rendering each request's
    PDFs within ``render_limits`` (the defaults when None).
    """
    out = os.path.abspath(os.fspath(out))
    check_served_path(out)
    _check_gpus(device, gpus)
    engine = engine or EngineConfig()
    if not name or not all(c.isalnum() or c in "_-" for c in name):
        raise RepositoryError(f"model name must be letters, digits, '_' or '-', got {name!r}")
    _check_destination(out, force)
    parent = os.path.dirname(out)
    if checkpoint is not None and not os.path.isfile(checkpoint):
        raise RepositoryError(f"checkpoint not found: {checkpoint}")

    messages: list[str] = []
    plan_cfg = None
    if plan is not None and plugin is None:
        from ..libraries import STATIC_PLUGIN_NAME, plugin_path

        found = plugin_path(STATIC_PLUGIN_NAME)  # the installation's plugin, when it carries one
        plugin = str(found) if found else None
    if plan is not None or plugin is not None:
        if plan is None or onnx is None or plugin is None:
            raise RepositoryError(
                "the tensorrt_plan model needs --plan, --onnx (for its inputs and outputs) and "
                "--plugin (the DASH plugin library the engine was built with) together"
            )
        if not os.path.isfile(plan) or os.path.getsize(plan) == 0:
            raise RepositoryError(f"plan not found or empty: {plan}")
        libraries = plugin_libraries(plugin)
    family = family_of(model)
    refused = family.refuse([TENSORRT] if onnx is not None or plan is not None else []) or family.refuse(
        [DOCUMENTS] if documents is not None else []
    )
    if refused:
        raise RepositoryError(
            f"a {family.label} is served by the Python generation model only: no --onnx, --plan or "
            f"document model ({refused})"
        )
    if onnx is not None:
        inputs, outputs = onnx_io(onnx)
        _check_onnx_matches(read_graph(onnx), model, engine.kv_block_size)
        if plan is not None:
            inputs, outputs, sizing = _plan_sizing(plan, onnx, inputs, outputs)
            messages.append(sizing)
            plan_cfg = plan_model_config(
                name + P.PLAN_SUFFIX, inputs, outputs, instances=plan_instances, gpus=plan_gpus
            )
    if plan_cfg is None:  # a family the plugin cannot run gets no advice to build an engine
        messages.append(
            NO_PLAN_MESSAGE if not family.refuse([TENSORRT]) else f"no TensorRT engine: {family.refuse([TENSORRT])}"
        )

    docs = None
    if documents is not None:
        docs = document_sources(documents)
        if docs is None:
            raise RepositoryError(
                f"{documents}: no document model without a tokenizer.json and a vision tower (model.sam_model., "
                f"model.vision_model.) in the checkpoint folder"
            )

    family.check_contract(model)
    class_file, class_spec = model_class_source(model)
    tmp = tempfile.mkdtemp(prefix=".dash-triton-", dir=parent)
    try:
        models = _write_generation_models(
            tmp,
            model,
            family,
            [(name, False)] + ([(name + P.STREAM_SUFFIX, True)] if streaming else []),
            checkpoint,
            class_file,
            engine=engine,
            device=device,
            model_class=class_spec,
            warmup=warmup,
            torch_num_threads=torch_num_threads,
            allow_engine_control=allow_engine_control,
            gpus=gpus,
        )
        if docs is not None:
            models.append(
                _write_document_model(
                    tmp,
                    name,
                    docs,
                    model,
                    engine,
                    device=device,
                    instances=document_instances,
                    torch_num_threads=torch_num_threads,
                    render_limits=render_limits,
                )
            )
        if plan_cfg is not None:
            messages.append(_write_plan_model(tmp, out, plan_cfg, plan, libraries))
            models.append(plan_cfg["name"])
        _write(os.path.join(tmp, "README.md"), _readme(out, name, models, engine, model, plan_cfg))
        _seal(tmp, out, private)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return WrittenRepository(out, models, messages)


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def pool_bytes(model: DashModel, engine: EngineConfig) -> int:
    """Memory of the KV pool of one generation model instance (``num_blocks`` blocks)."""
    from ..serving.runner import pool_block_bytes

    return pool_block_bytes(model, engine.kv_block_size) * engine.num_blocks


def _readme(
    out: str, name: str, models: list[str], engine: EngineConfig, model: DashModel, plan_cfg: dict | None
) -> str:
    c = model.config
    lines = [
        "# DASH model repository (written by dash-triton)",
        "",
        "| model | backend | what |",
        "| --- | --- | --- |",
        f"| `{name}` | python | greedy generation, one response per request (HTTP and gRPC) |",
    ]
    if name + P.STREAM_SUFFIX in models:
        lines.append(
            f"| `{name}{P.STREAM_SUFFIX}` | python, decoupled | the same, streaming prefill progress and "
            f"tokens (gRPC streaming) |"
        )
    if name + P.DOCUMENT_SUFFIX in models:
        lines.append(
            f"| `{name}{P.DOCUMENT_SUFFIX}` | python | a PDF or image in, one text section per page out "
            f"(`dash-trt ocr FILE --server URL`) |"
        )
    if plan_cfg is not None:
        lines.append(
            f"| `{plan_cfg['name']}` | tensorrt_plan | one forward step of the exported graph (caller owns the cache) |"
        )
    lines += [
        "",
        f"Model: {c.num_hidden_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}, "
        f"`<PAGE>` = {c.page_token_id}, `<image>` = {c.image_token_id}, EOS = {c.eos_token_id}.",
        f"KV pool per generation model: {engine.num_blocks} blocks of {engine.kv_block_size} tokens "
        f"({pool_bytes(model, engine) / 2**20:.1f} MiB); engine: `{engine.to_json()}`.",
        "",
        "## Serve",
        "",
        "On this machine, with the Triton server that the `nvidia-pytriton` wheel ships (CPU, 127.0.0.1):",
        "",
        "```bash",
        f"dash-triton serve {out}",
        "dash-client --prompt '<PAGE><image*32>What is the title?'",
        "```",
        "",
        "In a Triton container: install dash-trt (and torch) into the Python that the Python backend",
        f"uses, then `tritonserver --model-repository={out}`.",
    ]
    if plan_cfg is not None:
        lib = f"{out}/{plan_cfg['name']}/1/{PLUGIN_LIBRARY}"
        lines += [
            "",
            f"The TensorRT model needs the DASH plugin in the server process. Triton's TensorRT backend opens the "
            f"libraries named in `--backend-config=tensorrt,plugins=...` after loading TensorRT; {PLUGIN_LIBRARY} "
            f"registers its creator when opened ({PLUGIN_DEPENDENCY}, beside it, is the code it links against):",
            "",
            "```bash",
            f"tritonserver --model-repository={out} --backend-config=tensorrt,plugins={lib}",
            "```",
            "",
            "The plan and the plugin must be built against the TensorRT version of the server. " + PLAN_MODEL_NOTE,
        ]
    return "\n".join(lines) + "\n"
