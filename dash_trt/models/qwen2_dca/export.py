"""Export of the Qwen2 / Qwen2-MoE Dual Chunk Attention model to ONNX, and the family's
``dash-export`` program.

- :func:`export_program` / :func:`export_onnx`: ``torch.onnx.export`` (dynamo) of
  :meth:`~dash_trt.models.qwen2_dca.model.Qwen2DcaForCausalLM.export_forward` through
  :class:`Qwen2DcaExportGraph`: one ``dash_trt.DualChunkAttention`` node per layer with its
  standard-ops function; :func:`ort_forward` runs such a file in ONNX Runtime as a forward
  function of :func:`dash_trt.serving.generate.generate` (``forward=``).
- :func:`run_export`: the family's export program
  (:attr:`dash_trt.models.interface.ModelFamily.export_command`, which :mod:`dash_trt.export`
  runs for a checkpoint of the family): the file checked by onnx.checker
  (:func:`check_dca_onnx`, its structure too) and by ONNX Runtime generating PyTorch's tokens
  (prefill in chunks, then decode).

The ONNX modules are imported where they are used: the family record, and with it every tool
that loads a model, imports this module but not them."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np
import torch
from torch import nn

from ...attention.dca.reference import DcaConfigError
from ...export_tools import (
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
from ..checkpoint import CheckpointError
from ..config import DTYPES, ModelConfigError
from .load import load_dca
from .model import GRAPH_INPUTS, ForwardFn, Qwen2DcaForCausalLM

__all__ = ["Qwen2DcaExportGraph", "export_program", "export_onnx", "ort_forward", "check_dca_onnx", "run_export"]


class Qwen2DcaExportGraph(nn.Module):
    """The module ``torch.onnx.export`` traces: ``forward`` is
    :meth:`Qwen2DcaForCausalLM.export_forward` (parameters keep their names under ``model.``)."""

    def __init__(self, model: Qwen2DcaForCausalLM):
        super().__init__()
        self.model = model

    def forward(self, input_ids, block_tables, seq_lens, query_start_loc, prompt_lens, logits_indices, *caches):
        return self.model.export_forward(
            input_ids, block_tables, seq_lens, query_start_loc, prompt_lens, logits_indices, *caches
        )


# --------------------------------------------------------------------------- export
def _distinct(value: int, taken: set[int]) -> int:
    while value in taken:
        value += 1
    taken.add(value)
    return value


def _example_inputs(model: Qwen2DcaForCausalLM, kv_block_size: int) -> tuple:
    """A valid ragged batch (two sequences' prefill chunks over a pool) whose dynamic sizes are
    all >= 2 and differ from each other and from the model's static sizes, so the exporter
    specialises none of them."""
    c = model.config
    taken = {1, kv_block_size} | c.static_sizes()
    lens = [11, 6]
    tokens = _distinct(sum(lens), taken)
    lens[0] += tokens - sum(lens)
    seqs = 2
    taken |= {seqs, seqs + 1}
    need = [-(-n // kv_block_size) for n in lens]
    width = _distinct(max(need) + 2, taken)
    num_blocks = _distinct(sum(need) + 5, taken)
    scored = _distinct(5, taken)
    table = torch.full((seqs, width), -1, dtype=torch.int32)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    for s in range(seqs):
        table[s, : need[s]] = torch.tensor(order[sum(need[:s]) : sum(need[: s + 1])], dtype=torch.int32)
    ids = torch.randint(0, c.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.tensor([0, lens[0], tokens], dtype=torch.int32)
    prompt_lens = torch.tensor([lens[0] + 3, lens[1]], dtype=torch.int32)
    rows = torch.arange(scored, dtype=torch.long)
    device = model.device
    caches = [t for cache in model.allocate_cache(num_blocks, kv_block_size) for t in (cache.key, cache.value)]
    return tuple(x.to(device) for x in (ids, table, seq_lens, qsl, prompt_lens, rows, *caches))


def _dynamic_shapes(model: Qwen2DcaForCausalLM):
    Dim = torch.export.Dim
    tokens, seqs = Dim("num_tokens", min=1), Dim("num_seqs", min=1)
    width, blocks = Dim("block_table_width", min=1), Dim("num_kv_blocks", min=1)
    scored = Dim("num_logits", min=1)
    per_input = ({0: tokens}, {0: seqs, 1: width}, {0: seqs}, {0: seqs + 1}, {0: seqs}, {0: scored})
    return (*per_input, tuple({0: blocks} for _ in model.cache_names("past")))


def export_program(model: Qwen2DcaForCausalLM, *, kv_block_size: int = 8):
    """``torch.onnx.export`` (dynamo) of :meth:`Qwen2DcaForCausalLM.export_forward` as a
    ``torch.onnx.ONNXProgram``: one ``dash_trt.DualChunkAttention`` node per layer
    (:func:`dash_trt.attention.dca.onnx.translation_table`) and the node's standard-ops function
    (:func:`dash_trt.attention.dca.onnx.add_function`). Inputs :data:`GRAPH_INPUTS` then
    ``past.{layer}.{key,value}``; outputs ``logits`` then ``present.{layer}.{key,value}``; every
    size dynamic except the KV block size."""
    from ...attention.dca import onnx as dca_onnx

    reason = exporter_available()
    if reason:
        raise ExportError(reason)
    model = model.eval()
    args = _example_inputs(model, kv_block_size)
    with quiet_exporter(), torch.no_grad():
        program = torch.onnx.export(
            Qwen2DcaExportGraph(model),
            args,
            dynamo=True,
            dynamic_shapes=_dynamic_shapes(model),
            input_names=[*GRAPH_INPUTS, *model.cache_names("past")],
            output_names=["logits", *model.cache_names("present")],
            opset_version=dca_onnx.OPSET,
            custom_translation_table=dca_onnx.translation_table(),
            optimize=True,
            verbose=False,
        )
    dca_onnx.add_function(program)
    program.model.producer_name = "dash-trt"
    return program


def export_onnx(model: Qwen2DcaForCausalLM, path: str | os.PathLike, *, kv_block_size: int = 8) -> str:
    """:func:`export_program` saved to ``path`` (weights inside the file). Returns the path."""

    path = os.fspath(path)
    program = export_program(model, kv_block_size=kv_block_size)
    with quiet_exporter():
        program.save(path, external_data=False)
    return path


def ort_forward(path: str | os.PathLike) -> ForwardFn:
    """An ONNX Runtime (CPU) session over an exported file as a :data:`ForwardFn` for
    :func:`dash_trt.serving.generate.generate` (``forward=``): the caches it returns are fed back
    at the next step."""
    from ...attention.dash.onnx import import_onnxruntime, ort_session_options

    ort = import_onnxruntime()
    sess = ort.InferenceSession(os.fspath(path), ort_session_options(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]

    def forward(inputs: dict, caches: list) -> tuple[torch.Tensor, list]:
        values = [inputs[n] for n in GRAPH_INPUTS] + list(caches)
        feed = {n: v if isinstance(v, np.ndarray) else to_numpy(v) for n, v in zip(names, values)}
        out = sess.run(None, feed)
        return to_torch(out[0]), out[1:]

    return forward


# ---------------------------------------------------------------------- dash-export
def check_dca_onnx(path: str | os.PathLike, layers: int) -> None:
    """``onnx.checker`` full check of a Dual Chunk Attention export, and its structure: one
    ``dash_trt.DualChunkAttention`` node per layer and the op's local function."""
    import onnx

    from ...attention.dca import onnx as dca_onnx

    path = os.fspath(path)
    dca_onnx.register_schema()
    onnx.checker.check_model(path, full_check=True)
    model = onnx.load(path, load_external_data=False)
    ops = [n.op_type for n in model.graph.node if n.domain == dca_onnx.DOMAIN]
    if ops != [dca_onnx.OP_TYPE] * layers:
        raise ExportError(f"expected {layers} {dca_onnx.DOMAIN}.{dca_onnx.OP_TYPE} nodes, found {ops}")
    if not any(f.domain == dca_onnx.DOMAIN and f.name == dca_onnx.OP_TYPE for f in model.functions):
        raise ExportError(f"the model has no local function {dca_onnx.DOMAIN}.{dca_onnx.OP_TYPE}")


def _verify(
    a,
    model,
    path: str,
    out: str,
    out_stream: TextIO,
    progress: Any,
    fail: Callable[[int, str], int],
    generate: Callable,
) -> int | None:
    """ONNX Runtime running ``path`` against PyTorch, generating the same tokens through
    ``generate`` (:func:`dash_trt.serving.generate.generate`): None if they agree, else
    ``fail``'s exit code (``out``: the file that will not be written)."""
    c = model.config
    with progress.step("ONNX Runtime vs PyTorch (chunked prefill + decode)"):
        span = c.dca.chunk_len
        gen = torch.Generator().manual_seed(a.seed)
        prompts = [
            torch.randint(0, c.vocab_size, (n,), generator=gen).tolist()
            for n in (span + span // 2 + 3, max(2, span // 3))
        ]
        chunk = max(a.kv_block_size, span // 2)
        steps = max(1, a.decode_steps)
        try:
            kw = dict(prefill_chunk=chunk, kv_block_size=a.kv_block_size, stop_at_eos=False)
            ref = generate(model, prompts, steps, **kw)
            got = generate(model, prompts, steps, forward=ort_forward(path), **kw)
        except Exception as exc:
            return fail(
                EXIT_EXPORT_FAILED, f"ONNX Runtime could not run the model: {type(exc).__name__}: {short_message(exc)}"
            )
    atol, rtol = VERIFY_TOLERANCES[model.dtype]
    worst = max(float((g - r).abs().max()) for g, r in zip(got.logits, ref.logits))
    ok = got.tokens == ref.tokens and all(
        torch.allclose(g, r, atol=atol, rtol=rtol) for g, r in zip(got.logits, ref.logits)
    )
    print(
        f"ONNX Runtime vs PyTorch ({len(prompts)} prompts, {steps} tokens each): max |logits err| "
        f"{worst:.2e}, tokens {'equal' if got.tokens == ref.tokens else 'DIFFER'}",
        file=out_stream,
        flush=True,
    )
    if not ok:
        return fail(
            EXIT_MISMATCH,
            f"the ONNX model does not reproduce PyTorch (tolerance {(atol, rtol)}); {out} was not written",
        )
    return None


def run_export(a, out_stream: TextIO, progress: Any, fail: Callable[[int, str], int], generate: Callable) -> int:
    """dash-export of a Qwen2 or Qwen2-MoE Dual Chunk Attention folder (``a``: dash-export's
    arguments; ``progress``: its step printer; ``fail(code, message)``: prints the error and
    returns the exit code; ``generate``: the serving runtime's generation,
    :func:`dash_trt.serving.generate.generate`, handed in by dash-export, which stands above the
    serving package as the models stand below it). The ONNX modules are imported here: the family record, and with it
    every tool that loads a model, does not import them."""
    from ...attention.dash import onnx as onnx_ops

    if a.demo or a.random_init or a.config or a.model_class or a.vision:
        return fail(
            EXIT_BAD_INPUT, "a Dual Chunk Attention folder takes none of --demo, --random-init, --config, --model"
        )
    try:
        out = check_output_path(a.out)
        with progress.step("loading the model"):
            model = load_dca(a.checkpoint, dtype=DTYPES[a.dtype] if a.dtype else None)
            model.config.dca.check_kv_block_size(a.kv_block_size)
        c = model.config
        progress.note(
            f"{c.label}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, heads "
            f"{c.num_attention_heads}/{c.num_key_value_heads} x {c.head_dim}, chunk {c.dca.chunk_size}, local "
            f"{c.dca.local_size}, {model.dtype}, KV blocks of {a.kv_block_size}"
        )
    except (BadInput, CheckpointError, ModelConfigError, DcaConfigError) as exc:
        return fail(EXIT_BAD_INPUT, str(exc))
    except (OSError, ValueError) as exc:
        return fail(EXIT_BAD_INPUT, f"{type(exc).__name__}: {exc}")
    tmpdir = tempfile.mkdtemp(prefix=".dash-export-", dir=os.path.dirname(out))
    tmp = os.path.join(tmpdir, os.path.basename(out))
    try:
        try:
            with progress.step(f"exporting to ONNX (torch {torch.__version__}, opset {onnx_ops.OPSET})"):
                export_onnx(model, tmp, kv_block_size=a.kv_block_size)
            with progress.step("onnx.checker (full check)"):
                check_dca_onnx(tmp, c.num_hidden_layers)
        except OSError as exc:
            return fail(EXIT_BAD_INPUT, f"cannot write {out}: {exc}")
        except Exception as exc:
            return fail(EXIT_EXPORT_FAILED, f"export failed: {type(exc).__name__}: {short_message(exc)}")
        if not a.no_verify:
            code = _verify(a, model, tmp, out, out_stream, progress, fail, generate)
            if code is not None:
                return code
        with progress.step(f"writing {out}"):
            if os.path.exists(tmp + ".data"):
                os.replace(tmp + ".data", out + ".data")
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    print(f"wrote {out} ({c.num_hidden_layers} {onnx_ops.DOMAIN}.DualChunkAttention nodes)", file=out_stream)
    print(
        "RESULT: exported; the checker "
        + ("and ONNX Runtime agree with PyTorch" if not a.no_verify else "passed (ONNX Runtime check skipped)"),
        file=out_stream,
        flush=True,
    )
    return EXIT_OK
