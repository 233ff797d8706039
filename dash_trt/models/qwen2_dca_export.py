"""``dash-export`` of a Qwen2 or Qwen2-MoE Dual Chunk Attention folder: the family's export
program (:attr:`dash_trt.models.interface.ModelFamily.export_command`, which :mod:`dash_trt.export`
runs for a checkpoint of the family), and :func:`check_dca_onnx`, the structural check of its file.

One ``dash_trt.DualChunkAttention`` node per layer with its standard-ops function
(:func:`dash_trt.models.qwen2_dca.export_onnx`), checked by onnx.checker and by ONNX Runtime
generating PyTorch's tokens (prefill in chunks, then decode)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any, TextIO

import torch

from ..attention.dca.reference import DcaConfigError
from ..export_tools import (
    EXIT_BAD_INPUT,
    EXIT_EXPORT_FAILED,
    EXIT_MISMATCH,
    EXIT_OK,
    VERIFY_TOLERANCES,
    BadInput,
    ExportError,
    check_output_path,
    short_message,
)
from . import qwen2_dca
from .checkpoint import CheckpointError
from .config import DTYPES, ModelConfigError
from .qwen2_dca_load import load_dca

__all__ = ["check_dca_onnx", "run_export"]


def check_dca_onnx(path: str | os.PathLike, layers: int) -> None:
    """``onnx.checker`` full check of a Dual Chunk Attention export, and its structure: one
    ``dash_trt.DualChunkAttention`` node per layer and the op's local function."""
    import onnx

    from ..attention.dca import onnx as dca_onnx

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
    a, model, path: str, out: str, out_stream: TextIO, progress: Any, fail: Callable[[int, str], int]
) -> int | None:
    """ONNX Runtime running ``path`` against PyTorch, generating the same tokens: None if they
    agree, else ``fail``'s exit code (``out``: the file that will not be written)."""
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
            ref = qwen2_dca.generate(model, prompts, steps, prefill=chunk, kv_block_size=a.kv_block_size)
            got = qwen2_dca.generate(
                model,
                prompts,
                steps,
                prefill=chunk,
                kv_block_size=a.kv_block_size,
                forward=qwen2_dca.ort_forward(path),
            )
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


def run_export(a, out_stream: TextIO, progress: Any, fail: Callable[[int, str], int]) -> int:
    """dash-export of a Qwen2 or Qwen2-MoE Dual Chunk Attention folder (``a``: dash-export's
    arguments; ``progress``: its step printer; ``fail(code, message)``: prints the error and
    returns the exit code). The ONNX modules are imported here: the family record, and with it
    every tool that loads a model, does not import them."""
    from ..attention.dash import onnx as onnx_ops

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
                qwen2_dca.export_onnx(model, tmp, kv_block_size=a.kv_block_size)
            with progress.step("onnx.checker (full check)"):
                check_dca_onnx(tmp, c.num_hidden_layers)
        except OSError as exc:
            return fail(EXIT_BAD_INPUT, f"cannot write {out}: {exc}")
        except Exception as exc:
            return fail(EXIT_EXPORT_FAILED, f"export failed: {type(exc).__name__}: {short_message(exc)}")
        if not a.no_verify:
            code = _verify(a, model, tmp, out, out_stream, progress, fail)
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
