"""``dash-export``: a DASH model checkpoint to ONNX, checked against PyTorch.

``dash-export model.pt --out model.onnx`` (or ``--demo`` for the built-in random demo
model) exports with the dynamo ``torch.onnx`` exporter. Every DASH attention call
becomes one ``dash_trt.DashAttention`` node with the configuration as attributes, and
the file carries the model-local function of that name (:mod:`dash_trt.attention.dash.onnx`), so
ONNX Runtime runs it as is and TensorRT can run the plugin instead.

Graph interface (T new tokens, B sequences, NB KV blocks, W block-table width, N rows
scored; all five dynamic; the KV block size is fixed at export, ``--kv-block-size``):

inputs  ``input_ids`` [T] int64, ``coords`` [T, 4] int32, ``block_tables`` [B, W] int32,
        ``seq_lens`` [B] int32, ``query_start_loc`` [B+1] int32, ``prompt_lens`` [B] int32,
        ``logits_indices`` [N] int64 (rows of the new tokens to score),
        ``past.{layer}.{key,value,index_key,image_page,summary,summary_pages}``
outputs ``logits`` [N, vocab] float32, ``present.{layer}.{...}`` (the updated caches)

The file is written atomically: everything goes to a temporary folder beside the
output, is checked there (``onnx.checker`` full check, then ONNX Runtime against
PyTorch on random prompts: chunked prefill and decode steps with the caches threaded
through), and only then renamed into place. Exit codes: 0 success, 1 the ONNX model
does not reproduce PyTorch, 2 bad input (arguments, checkpoint, config, output path),
3 the export itself failed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TextIO

import numpy as np
import torch

from .attention.dash import onnx as onnx_ops
from .attention.dash.config import DashConfigError
from .attention.dash.paged import sequence_coords
from .cliutil import EXIT_INTERNAL, cli_main
from .export_tools import (
    EXIT_BAD_INPUT,
    EXIT_EXPORT_FAILED,
    EXIT_MISMATCH,
    EXIT_OK,
    VERIFY_TOLERANCES,
    BadInput,
    ExportError,
    check_output_path,
    exporter_available,
    quiet_exporter,
    short_message,
    to_numpy,
    to_torch,
)
from .modeling import MODEL_INPUTS, DashModel, ExportGraph, ModelContractError, image_feature_rows, token_roles
from .models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, save_pretrained
from .models.config import DTYPES, ModelConfigError, load_model_config
from .models.families import family_of_checkpoint
from .models.prompts import check_prompts, document_prompt
from .models.registry import demo_model, random_model
from .onnx_graph import read_graph
from .serving.generate import PagedState, generate
from .versions import version_line as _version_line

__all__ = [
    "EXIT_OK",
    "EXIT_MISMATCH",
    "EXIT_BAD_INPUT",
    "EXIT_EXPORT_FAILED",
    "VERIFY_TOLERANCES",
    "ExportError",
    "Progress",
    "exporter_available",
    "export_program",
    "export_onnx",
    "check_onnx",
    "verify_onnx",
    "VerifyReport",
    "main",
]

#: Largest model (bytes of weights) written as one file; protobuf caps a file at 2 GiB.
EXTERNAL_DATA_THRESHOLD = 1_800_000_000


# -------------------------------------------------------------------------- progress
class Progress:
    """Step-by-step progress on a stream (stderr): ``[i/n] title ... done (1.2 s)``.
    On a terminal, a long step shows its elapsed time while it runs."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True):
        self.total, self.index = total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled

    def note(self, msg: str) -> None:
        if self.enabled:
            print(f"      {msg}", file=self.stream, flush=True)

    @contextlib.contextmanager
    def step(self, title: str) -> Iterator[None]:
        self.index += 1
        head = f"[{self.index}/{self.total}] {title}"
        t0 = time.perf_counter()
        stop = threading.Event()
        ticker = None
        tty = self.enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        if self.enabled:
            print(head + " ...", file=self.stream, end="" if tty else "\n", flush=True)
        if tty:

            def tick() -> None:
                while not stop.wait(0.5):
                    print(f"\r{head} ... {time.perf_counter() - t0:5.1f} s", file=self.stream, end="", flush=True)

            ticker = threading.Thread(target=tick, daemon=True)
            ticker.start()
        ok = False
        try:
            yield
            ok = True
        finally:
            stop.set()
            if ticker is not None:
                ticker.join()
            if self.enabled:
                took = time.perf_counter() - t0
                status = "done" if ok else "FAILED"
                print(("\r" if tty else "") + f"{head}: {status} ({took:.1f} s)", file=self.stream, flush=True)


# ---------------------------------------------------------------------------- export
def _example_inputs(model: DashModel, kv_block_size: int):
    """A real ragged batch (two sequences, prefill chunks) as export example. Every
    dynamic size is >= 2 and distinct, so the exporter specialises none of them."""
    cfg = model.config
    prompts = [document_prompt([5], "ab", cfg), document_prompt([3], "", cfg)]  # 8 + 4 tokens
    n = [len(p) for p in prompts]
    need = [-(-x // kv_block_size) for x in n]
    width = max(need) + 2
    width += width == len(prompts) + 1  # keep W apart from B + 1
    state = PagedState(model, num_blocks=sum(need) + 5, kv_block_size=kv_block_size)
    for i, p in enumerate(prompts):
        state.pool.add(i, prompt_length=cfg.prompt_length(len(p)))
    batch = state.pool.schedule([(0, n[0]), (1, n[1])], device=model.device, table_width=width)
    coords = torch.cat([sequence_coords(token_roles(p, cfg)) for p in prompts]).to(model.device)
    ids = torch.tensor(prompts[0] + prompts[1], dtype=torch.long, device=model.device)
    # Rows to score: each sequence's last token, then others (9 rows: apart from every other size).
    rows = torch.tensor([n[0] - 1, n[0] + n[1] - 1, 0, 1, 2, 3, 4, 5, 6], dtype=torch.long, device=model.device)
    images = ()
    if model.takes_image_features:  # features for the first prompt's 5 image tokens, none for the second's
        index = image_feature_rows(prompts[0], cfg, 5) + [-1] * n[1]
        feats = torch.randn(5, cfg.image_feature_dim, generator=torch.Generator().manual_seed(0)).to(model.dtype)
        images = (feats.to(model.device), torch.tensor(index, dtype=torch.long, device=model.device))
    return (ids, coords, *batch.tensors(), rows, *images, *state.tensors())


def _dynamic_shapes(model: DashModel):
    Dim = torch.export.Dim
    tokens = Dim("num_tokens", min=1)
    seqs = Dim("num_seqs", min=1)
    blocks = Dim("num_kv_blocks", min=1)
    width = Dim("block_table_width", min=1)
    scored = Dim("num_logits", min=1)
    per_input = {
        "input_ids": {0: tokens},
        "coords": {0: tokens},
        "block_tables": {0: seqs, 1: width},
        "seq_lens": {0: seqs},
        "query_start_loc": {0: seqs + 1},
        "prompt_lens": {0: seqs},
        "logits_indices": {0: scored},
        "image_features": {0: Dim("num_image_features", min=0)},
        "image_feature_index": {0: tokens},
    }
    # forward(*inputs, *caches): torch.export sees the caches as one varargs tuple
    # forward(*MODEL_INPUTS, *rest): torch.export sees the rest (image inputs, caches) as one tuple
    rest = [per_input[n] for n in model.input_names()[len(MODEL_INPUTS) :]]
    return (*(per_input[n] for n in MODEL_INPUTS), (*rest, *({0: blocks} for _ in model.cache_names("past"))))


def export_program(model: DashModel, *, kv_block_size: int = 16):
    """Export ``model`` to an ``torch.onnx.ONNXProgram`` with the DashAttention
    function attached (nothing written)."""
    import onnx_ir as ir

    reason = exporter_available()
    if reason:
        raise ExportError(reason)
    model = model.eval()
    model.dash_layers()  # the contract's checks, before a long trace
    args = _example_inputs(model, kv_block_size)
    with quiet_exporter(), torch.no_grad():
        program = torch.onnx.export(
            ExportGraph(model),
            args,
            dynamo=True,
            dynamic_shapes=_dynamic_shapes(model),
            input_names=[*model.input_names(), *model.cache_names("past")],
            output_names=["logits", *model.cache_names("present")],
            opset_version=onnx_ops.OPSET,
            custom_translation_table=onnx_ops.translation_table(),
            optimize=True,
            verbose=False,
        )
    fn = ir.serde.deserialize_function(onnx_ops.dash_attention_function())
    program.model.functions[fn.identifier()] = fn
    program.model.opset_imports.setdefault(onnx_ops.DOMAIN, onnx_ops.DOMAIN_VERSION)
    program.model.producer_name = "dash-trt"
    return program


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.state_dict().values())


def export_onnx(
    model: DashModel, path: str | os.PathLike, *, kv_block_size: int = 16, external_data: bool | None = None
) -> str:
    """Export ``model`` to ``path`` (written non-atomically; :func:`main` wraps this).
    ``external_data`` None decides by size (weights over ~1.8 GB go to ``path.data``).
    Returns the path."""
    path = os.fspath(path)
    if external_data is None:
        external_data = _weight_bytes(model) > EXTERNAL_DATA_THRESHOLD
    program = export_program(model, kv_block_size=kv_block_size)
    with quiet_exporter():
        program.save(path, external_data=external_data)
    return path


def check_onnx(path: str | os.PathLike) -> None:
    """``onnx.checker`` full check (strict shape inference through the function), and
    the structural contract: DashAttention nodes and their local function."""
    import onnx

    path = os.fspath(path)
    onnx_ops.register_schema()
    onnx.checker.check_model(path, full_check=True)
    graph = read_graph(path)
    ops = {op for op, _ in graph.domain_nodes}
    if not graph.domain_nodes or ops != {onnx_ops.OP_TYPE}:
        raise ExportError(f"expected {onnx_ops.DOMAIN}.{onnx_ops.OP_TYPE} nodes, found {sorted(ops)}")
    if not graph.has_dash_function:
        raise ExportError(f"the model has no local function {onnx_ops.DOMAIN}.{onnx_ops.OP_TYPE}")


# ---------------------------------------------------------------------------- verify
@dataclass
class VerifyReport:
    steps: int = 0
    tokens: int = 0
    max_logit_err: float = 0.0
    max_cache_err: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    shapes: list[tuple[int, int, int, int]] = field(default_factory=list)  #: (T, B, NB, W) per step

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        caches = ", ".join(f"{k} {v:.2e}" for k, v in self.max_cache_err.items())
        return (
            f"{self.steps} steps, {self.tokens} tokens: max |logits err| {self.max_logit_err:.3e}; "
            f"max cache err: {caches}"
        )


# ------------------------------------------------------------------------ vision tower
#: The vision graph's input and outputs.
VISION_INPUT = "pixel_values"
VISION_OUTPUTS = ("features", "image_newline", "view_separator")


class VisionGraph(torch.nn.Module):
    """The vision tower for views of one size, as the exported graph computes it: views [N, 3,
    S, S] (normalised) to features [N, (S/64)^2, hidden], plus the newline and separator vectors
    that :func:`~dash_trt.models.deepencoder.assemble_page` lays between them."""

    def __init__(self, tower, size: int):
        super().__init__()
        self.encoder = tower.views(size)
        self.size = size

    def forward(self, pixel_values: torch.Tensor):
        t = self.encoder.tower
        return self.encoder(pixel_values), t.image_newline * 1.0, t.view_seperator * 1.0


def export_vision(tower, path: str, size: int, *, check: bool = True, seed: int = 0) -> float | None:
    """Export the tower for ``size`` x ``size`` views to ``path`` (any number of views a call;
    standard ONNX ops only: the position tables are resized in PyTorch first) and, with
    ``check``, run it in ONNX Runtime on two random views: the largest difference from PyTorch
    (ExportError above 1e-4 relative to the features' scale)."""
    graph = VisionGraph(tower.float().eval(), size).eval()
    example = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(seed))
    with quiet_exporter(), torch.no_grad():
        torch.onnx.export(
            graph,
            (example,),
            path,
            dynamo=True,
            verbose=False,
            input_names=[VISION_INPUT],
            output_names=list(VISION_OUTPUTS),
            dynamic_shapes=({0: torch.export.Dim("views", min=1, max=1024)},),
            opset_version=onnx_ops.OPSET,
        )
    if not check:
        return None
    sess = _ort_session(path)
    views = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(seed + 1))
    got = sess.run(None, {VISION_INPUT: views.numpy()})
    with torch.no_grad():
        want = graph(views)
    err = max(float(np.abs(g - w.numpy()).max()) for g, w in zip(got, want))
    scale = max(1.0, float(want[0].abs().max()))
    if err > 1e-4 * scale:
        raise ExportError(f"ONNX Runtime's vision features differ from PyTorch's by {err:.3e}")
    return err


def _ort_session(path: str):
    ort = onnx_ops.import_onnxruntime()

    return ort.InferenceSession(path, onnx_ops.ort_session_options(), providers=["CPUExecutionProvider"])


def verify_onnx(
    path: str | os.PathLike,
    model: DashModel,
    *,
    kv_block_size: int = 16,
    seed: int = 0,
    prompts: Sequence[Sequence[int]] | None = None,
    decode_steps: int = 3,
    prefill_chunk: int | None = 40,
    num_blocks: int | None = None,
    progress: Progress | None = None,
    image_features: Sequence[torch.Tensor | None] | None = None,
) -> VerifyReport:
    """Run the ONNX file in ONNX Runtime next to PyTorch on the same steps (chunked
    prefill and decode of random document prompts, caches threaded through each
    runtime separately) and compare the logits and every cache tensor."""
    path = os.fspath(path)
    dtype = model.dtype
    atol, rtol = VERIFY_TOLERANCES[dtype]
    if prompts is None:
        prompts, default_features = check_prompts(model, seed)
        image_features = default_features if image_features is None else image_features
    sess = _ort_session(path)
    in_names = [i.name for i in sess.get_inputs()]
    report = VerifyReport()
    ort_caches: list[np.ndarray] | None = None
    names = model.cache_names("present")

    def forward(inputs: dict, caches: list):
        nonlocal ort_caches
        # Score every new token in both runtimes (a stronger check than the sampled rows);
        # generation gets the rows it asked for.
        wanted = inputs["logits_indices"]
        inputs = dict(inputs, logits_indices=torch.arange(inputs["input_ids"].shape[0], device=wanted.device))
        with torch.no_grad():
            out = model.export_forward(*inputs.values(), *caches)
        if ort_caches is None:
            ort_caches = [to_numpy(c) for c in caches]
        feed = dict(zip(in_names, [to_numpy(v) for v in inputs.values()] + ort_caches))
        res = sess.run(None, feed)
        t, b = inputs["input_ids"].shape[0], inputs["seq_lens"].shape[0]
        report.shapes.append((t, b, caches[0].shape[0], inputs["block_tables"].shape[1]))
        report.steps += 1
        report.tokens += t
        got = to_torch(res[0]).float()
        err = (got - out[0].float()).abs()
        report.max_logit_err = max(report.max_logit_err, float(err.max()))
        if not torch.allclose(got, out[0].float(), atol=atol, rtol=rtol):
            report.failures.append(f"step {report.steps}: logits differ by up to {float(err.max()):.3e}")
        for name, a, want in zip(names, res[1:], out[1:]):
            got_c = to_torch(a)
            kind = name.split(".")[-1]
            if got_c.shape != want.shape or got_c.dtype != want.dtype:
                report.failures.append(
                    f"step {report.steps}: {name} is {got_c.dtype}{list(got_c.shape)}, "
                    f"expected {want.dtype}{list(want.shape)}"
                )
                continue
            if want.dtype.is_floating_point:
                e = float((got_c.float() - want.float()).abs().max()) if want.numel() else 0.0
                bad = not torch.allclose(got_c.float(), want.float(), atol=atol, rtol=rtol)
            else:
                e = float((got_c.long() - want.long()).abs().max()) if want.numel() else 0.0
                bad = e != 0
            report.max_cache_err[kind] = max(report.max_cache_err.get(kind, 0.0), e)
            if bad:
                report.failures.append(f"step {report.steps}: {name} differs by up to {e:.3e}")
        ort_caches = res[1:]
        if progress is not None:
            progress.note(
                f"step {report.steps}: {t} new tokens in {b} sequences, max |logits err| {float(err.max()):.2e}"
            )
        return out[0][wanted], out[1:]

    generate(
        model,
        prompts,
        decode_steps,
        prefill_chunk=prefill_chunk,
        kv_block_size=kv_block_size,
        num_blocks=num_blocks,
        stop_at_eos=False,
        forward=forward,
        image_features=image_features,
    )
    return report


# ------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dash-export",
        description="Export a DASH attention model checkpoint (model.pt, or a Hugging Face folder of "
        "config.json and safetensors) to ONNX: one "
        "dash_trt.DashAttention node per layer plus its ONNX-function fallback, then check "
        "the file with onnx.checker and against PyTorch in ONNX Runtime.",
        epilog="Exit codes: 0 ok, 1 ONNX Runtime does not reproduce PyTorch, 2 bad input, "
        "3 export failed, 130 / 143 interrupted (Ctrl-C / SIGTERM; nothing written), "
        f"{EXIT_INTERNAL} an unexpected internal error (one line; --verbose prints its traceback). "
        "See export/README.md.",
    )
    p.add_argument("--version", action="version", version=_version_line())
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "checkpoint",
        nargs="?",
        help="model.pt ({'config': config.json dict, 'state_dict': ...}), a Hugging Face folder "
        "(config.json + model.safetensors, or shards and model.safetensors.index.json; "
        "'model.' parameter prefixes and tied embeddings without lm_head.weight are read), "
        "or a .safetensors file with its config.json beside it",
    )
    src.add_argument("--demo", action="store_true", help="export the built-in random demo model")
    src.add_argument(
        "--random-init",
        metavar="CONFIG_JSON",
        help="export a model of this config.json with random weights (for engine builds and "
        "benchmarks, see export/configs)",
    )
    p.add_argument("--out", "-o", required=True, help="output .onnx path (with --vision: a folder)")
    p.add_argument(
        "--vision",
        action="store_true",
        help="export the checkpoint's vision tower instead: OUT/vision_<S>.onnx for the global views and the "
        "tiles (S their sizes), each checked against PyTorch in ONNX Runtime",
    )
    p.add_argument(
        "--model",
        metavar="MODULE:CLASS",
        dest="model_class",
        help="the model class, a dash_trt.modeling.DashModel subclass: package.module:Class or "
        "path/to/file.py:Class (default: the config's architectures[0], DashForCausalLM or one "
        "registered under the 'dash_trt.models' entry points; see docs/models.md)",
    )
    p.add_argument(
        "--config",
        metavar="CONFIG_JSON",
        help="config.json to use instead of the checkpoint's own (for a bare state dict)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="export dtype (default: the checkpoint's; float32 for --demo)",
    )
    p.add_argument("--kv-block-size", type=int, default=16, help="tokens per KV-cache block (fixed in the graph)")
    p.add_argument(
        "--external-data",
        choices=("auto", "always", "never"),
        default="auto",
        help="weights in OUT.data beside the model (auto: when over ~1.8 GB)",
    )
    p.add_argument(
        "--unsafe-load",
        action="store_true",
        help="allow unpickling arbitrary Python objects from the checkpoint (runs code from the "
        "file: only for files you trust)",
    )
    p.add_argument("--no-verify", action="store_true", help="skip the ONNX Runtime comparison (the checker still runs)")
    p.add_argument("--decode-steps", type=int, default=3, help="decode steps of the ONNX Runtime check")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and check prompts")
    p.add_argument(
        "--save-checkpoint",
        metavar="MODEL_PT",
        help="also write the exported model's weights as model.pt (with --demo / --random-init)",
    )
    p.add_argument(
        "--save-pretrained",
        metavar="DIR",
        help="also write them as a Hugging Face folder: config.json + model.safetensors",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    p.add_argument(
        "--verbose", action="store_true", help="the traceback of a failed export or check, and of an unexpected error"
    )
    return p


def _load(a) -> DashModel:
    dtype = DTYPES[a.dtype] if a.dtype else None
    if a.demo:
        if a.model_class:
            raise BadInput("--demo is the built-in DashForCausalLM; --model takes a checkpoint or --random-init")
        return demo_model(seed=a.seed, dtype=dtype or torch.float32)
    if a.random_init:
        return random_model(load_model_config(a.random_init), seed=a.seed, dtype=dtype, model_class=a.model_class)
    config = load_model_config(a.config) if a.config else None
    model = load_checkpoint(a.checkpoint, allow_pickle=a.unsafe_load, config=config, model_class=a.model_class)
    return model.to(dtype) if dtype else model


@cli_main("dash-export")
def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """``dash-export``: results on stdout, progress and errors on stderr."""
    parser = _parser()
    a = parser.parse_args(argv)
    out_stream = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    if not (a.checkpoint or a.demo or a.random_init):
        parser.error("give a checkpoint (model.pt or a Hugging Face folder), --demo or --random-init CONFIG_JSON")
    if a.kv_block_size < 1 or a.decode_steps < 0:
        parser.error("--kv-block-size must be >= 1 and --decode-steps >= 0")
    # Ctrl-C and SIGTERM end the run through the cleanup below (no temporary folder or
    # half-written file left), with the shell's exit code for the signal (130 / 143).
    got: dict[str, int] = {}

    def on_signal(signum, _frame):
        got["signal"] = signum
        raise _Interrupted(signum)

    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run(a, out_stream, err, got)
    except _Interrupted:
        pass
    finally:
        for sig, old in handlers.items():
            signal.signal(sig, old)
    name = signal.Signals(got["signal"]).name
    print(f"dash-export: interrupted ({name}); nothing was written", file=err, flush=True)
    return 128 + got["signal"]


class _Interrupted(BaseException):
    """Raised by dash-export's SIGINT / SIGTERM handler (a BaseException: no handler of
    ordinary errors swallows it)."""


def _run_vision(a, out_stream: TextIO, err: TextIO) -> int:
    """``dash-export CHECKPOINT --vision --out DIR``."""
    from .documents.views import ViewSpec
    from .models.checkpoint import load_vision_tower

    if not a.checkpoint or not os.path.isdir(a.checkpoint):
        print("dash-export: error: --vision takes a checkpoint folder (its vision tower)", file=err)
        return EXIT_BAD_INPUT
    try:
        tower = load_vision_tower(a.checkpoint)
        spec = ViewSpec.from_config(load_model_config(os.path.join(a.checkpoint, "config.json")))
    except (CheckpointError, ModelConfigError, ValueError) as exc:
        print(f"dash-export: error: {exc}", file=err)
        return EXIT_BAD_INPUT
    os.makedirs(a.out, exist_ok=True)
    for size in sorted({spec.base_size, spec.image_size}, reverse=True):
        path = os.path.join(a.out, f"vision_{size}.onnx")
        # written in a temporary folder under its final name: the weights file the exporter may
        # put beside it is named (inside the .onnx too) as it will be: vision_<S>.onnx.data
        tmpdir = tempfile.mkdtemp(prefix=".dash-export-", dir=a.out)
        try:
            tmp = os.path.join(tmpdir, os.path.basename(path))
            try:
                worst = export_vision(tower, tmp, size, check=not a.no_verify, seed=a.seed)
            except Exception as exc:
                print(
                    f"dash-export: error: the vision export failed: {type(exc).__name__}: {short_message(exc)}",
                    file=err,
                )
                return EXIT_EXPORT_FAILED
            has_data = _commit(tmp, path, err)
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
        check = "not checked" if worst is None else f"ONNX Runtime vs PyTorch max |err| {worst:.2e}"
        weights = f", weights in {os.path.basename(path)}.data" if has_data else ""
        print(f"wrote {path} ({_size(path, has_data)}{weights}; views of {size} px; {check})", file=out_stream)
        print(
            f"  trtexec --onnx={path} --minShapes={VISION_INPUT}:1x3x{size}x{size} "
            f"--optShapes={VISION_INPUT}:4x3x{size}x{size} --maxShapes={VISION_INPUT}:16x3x{size}x{size} "
            f"--saveEngine={os.path.splitext(path)[0]}.plan",
            file=out_stream,
        )
    print("RESULT: exported the vision tower", file=out_stream)
    return EXIT_OK


def _run(a, out_stream: TextIO, err: TextIO, got: dict) -> int:
    if a.vision:
        return _run_vision(a, out_stream, err)
    progress = Progress(total=4 if a.no_verify else 5, stream=err, enabled=not a.quiet)

    def fail(code: int, msg: str) -> int:
        if "signal" in got:  # an exporter that turned the interruption into its own error
            raise _Interrupted(got["signal"])
        if a.verbose and sys.exc_info()[1] is not None:  # called in an except block: what failed, in full
            traceback.print_exc(file=err)
        print(f"dash-export: error: {msg}", file=err, flush=True)
        return code

    if exporter_available():
        return fail(EXIT_EXPORT_FAILED, exporter_available())
    if not a.no_verify and importlib.util.find_spec("onnxruntime") is None:
        return fail(
            EXIT_BAD_INPUT,
            f"{onnx_ops.ORT_MISSING}; it runs the exported file against PyTorch (or pass "
            f"--no-verify to export with onnx.checker only)",
        )
    family = family_of_checkpoint(a.checkpoint) if a.checkpoint else None
    if family is not None and family.export_command is not None:  # a family with its own program
        return family.export_command(a, out_stream, progress, fail, generate)
    try:
        out = check_output_path(a.out)
        with progress.step("loading the model"):
            model = _load(a)
        c = model.config
        progress.note(
            f"{c.num_hidden_layers} layers, hidden {c.hidden_size}, heads {c.num_attention_heads}/"
            f"{c.num_key_value_heads} x {c.head_dim}, indexer {c.index_head_dim}, {model.dtype}, "
            f"KV blocks of {a.kv_block_size}"
        )
        if a.save_checkpoint:
            save_checkpoint(model, a.save_checkpoint)
        if a.save_pretrained:
            save_pretrained(model, a.save_pretrained)
    except (BadInput, CheckpointError, ModelConfigError, DashConfigError, ModelContractError) as exc:
        return fail(EXIT_BAD_INPUT, str(exc))
    except (OSError, ValueError) as exc:
        return fail(EXIT_BAD_INPUT, f"{type(exc).__name__}: {exc}")

    external = {"auto": None, "always": True, "never": False}[a.external_data]
    base = os.path.basename(out)
    try:
        tmpdir = tempfile.mkdtemp(prefix=".dash-export-", dir=os.path.dirname(out))
    except OSError as exc:
        return fail(EXIT_BAD_INPUT, f"cannot write {out}: {exc}")
    tmp = os.path.join(tmpdir, base)
    try:
        try:
            with progress.step(f"exporting to ONNX (torch {torch.__version__}, opset {onnx_ops.OPSET})"):
                export_onnx(model, tmp, kv_block_size=a.kv_block_size, external_data=external)
            with progress.step("onnx.checker (full check)"):
                check_onnx(tmp)
        except OSError as exc:
            return fail(EXIT_BAD_INPUT, f"cannot write {out}: {exc}")
        except Exception as exc:
            return fail(EXIT_EXPORT_FAILED, f"export failed: {type(exc).__name__}: {short_message(exc)}")
        if not a.no_verify:
            with progress.step("ONNX Runtime vs PyTorch (prefill + decode)"):
                try:
                    report, checked = _verify_with_fallback(tmp, model, a, progress)
                except Exception as exc:
                    return fail(
                        EXIT_EXPORT_FAILED,
                        f"ONNX Runtime could not run the model: {type(exc).__name__}: {short_message(exc)}",
                    )
            print(f"ONNX Runtime vs PyTorch ({checked}): {report.summary()}", file=out_stream, flush=True)
            if not report.ok:
                for f in report.failures[:10]:
                    print(f"  {f}", file=out_stream, flush=True)
                return fail(
                    EXIT_MISMATCH,
                    f"the ONNX model does not reproduce PyTorch (tolerance "
                    f"{VERIFY_TOLERANCES[model.dtype]}); {out} was not written",
                )
        with progress.step(f"writing {out}"):
            has_data = _commit(tmp, out, err)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    nodes = _count_dash_nodes(out)
    print(
        f"wrote {out} ({_size(out, has_data)}; {nodes} {onnx_ops.DOMAIN}.{onnx_ops.OP_TYPE} nodes"
        + (f", weights in {base}.data" if has_data else "")
        + ")",
        file=out_stream,
        flush=True,
    )
    print(
        "RESULT: "
        + (
            "exported; the checker and ONNX Runtime agree with PyTorch"
            if not a.no_verify
            else "exported; the checker passed (ONNX Runtime check skipped)"
        ),
        file=out_stream,
        flush=True,
    )
    return EXIT_OK


def _verify_with_fallback(path: str, model: DashModel, a, progress: Progress):
    """Verify ``path``; for bfloat16, where ONNX Runtime's CPU provider has no kernels
    (NOT_IMPLEMENTED for Mul and others), verify a float32 export of the same weights
    instead: the graph is the same, only the dtype differs. Returns (report, what was
    checked)."""
    kwargs = dict(kv_block_size=a.kv_block_size, seed=a.seed, decode_steps=a.decode_steps, progress=progress)
    try:
        return verify_onnx(path, model, **kwargs), f"{model.dtype}"
    except Exception as exc:
        if model.dtype != torch.bfloat16 or "NOT_IMPLEMENTED" not in str(exc):
            raise
    progress.note(
        "ONNX Runtime's CPU provider has no bfloat16 kernels: checking a float32 export of the same "
        "weights instead (the bfloat16 file passed onnx.checker)"
    )
    f32 = copy.deepcopy(model).float()
    f32_path = os.path.join(os.path.dirname(path), "float32-check.onnx")
    export_onnx(f32, f32_path, kv_block_size=a.kv_block_size, external_data=None)
    return verify_onnx(f32_path, f32, **kwargs), "torch.bfloat16 weights, checked as a float32 export"


def _commit(tmp: str, out: str, err: TextIO) -> bool:
    """Move an export written as ``tmp`` (in a temporary folder, under ``out``'s name, so that its
    external weights file is named as ``out`` expects: ``<name>.data``) to ``out``; True when it
    has such a weights file. An earlier export's ``.data`` beside ``out`` that the new file does
    not read is removed."""
    data = tmp + ".data"
    has_data = os.path.exists(data)
    if has_data:
        os.replace(data, out + ".data")
    os.replace(tmp, out)  # the commit point: the .onnx appears complete or not at all
    if not has_data and os.path.exists(out + ".data"):
        os.unlink(out + ".data")
        base = os.path.basename(out)
        print(f"removed {base}.data of an earlier export (the weights are inside {base} now)", file=err, flush=True)
    return has_data


def _size(path: str, has_data: bool) -> str:
    n = os.path.getsize(path) + (os.path.getsize(path + ".data") if has_data else 0)
    return f"{n / 1e6:.1f} MB"


def _count_dash_nodes(path: str) -> int:
    return len(read_graph(path).dash_nodes)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
