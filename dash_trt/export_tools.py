"""What every ONNX exporter of the package shares (the DASH models' in :mod:`dash_trt.export`,
the other model families' beside their models, :mod:`dash_trt.models`): whether this torch can
export, the exporter's logging kept quiet, the exporter's error, tensors to and from the NumPy
arrays ONNX Runtime takes, and what a family's ``dash-export`` program shares with dash-export's
own (exit codes, tolerances, the output path's check, the user's error)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator

import numpy as np
import torch

__all__ = [
    "ExportError",
    "BadInput",
    "quiet_exporter",
    "exporter_available",
    "to_numpy",
    "to_torch",
    "check_output_path",
    "short_message",
    "EXIT_OK",
    "EXIT_MISMATCH",
    "EXIT_BAD_INPUT",
    "EXIT_EXPORT_FAILED",
    "VERIFY_TOLERANCES",
]

#: dash-export's exit codes: success, the ONNX model does not reproduce PyTorch, bad input
#: (arguments, checkpoint, config, output path), the export itself failed.
EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT, EXIT_EXPORT_FAILED = 0, 1, 2, 3

#: (atol, rtol) of ONNX Runtime against PyTorch, same dtype, for logits and float caches.
#: fp32: summation order only. fp16/bf16: both runtimes round every op to the low
#: precision dtype, in different places (ORT fuses and reorders), and errors compound
#: over the layers; the check is against gross errors (a wrong block, a wrong slot),
#: which are O(1).
VERIFY_TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-2, 5e-2),
    torch.bfloat16: (2e-1, 1e-1),
}


class ExportError(RuntimeError):
    """The exporter failed (not the user's input)."""


class BadInput(Exception):
    """A user error with a message to print (exit code 2)."""


def check_output_path(out: str) -> str:
    """``out`` as an absolute path, if a file can be written there (else :class:`BadInput`)."""
    out = os.path.abspath(out)
    if os.path.isdir(out):
        raise BadInput(f"cannot write {out}: it is a directory")
    folder = os.path.dirname(out)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise BadInput(f"cannot write {out}: {folder} is a file, not a folder")
    if not os.path.isdir(folder):
        raise BadInput(f"cannot write {out}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise BadInput(f"cannot write {out}: folder {folder} is not writable")
    return out


def short_message(exc: BaseException, limit: int = 600) -> str:
    """An error's message, cut at ``limit`` characters."""
    text = str(exc).strip()
    return text if len(text) <= limit else text[:limit] + " ..."


@contextlib.contextmanager
def quiet_exporter() -> Iterator[None]:
    """The exporter logs and warns a lot about things that are fine here."""
    loggers = [
        logging.getLogger(n)
        for n in (
            "torch.onnx",
            "torch.export",
            "torch._export",
            "onnxscript",
            "torch.fx.experimental.symbolic_shapes",
            "torch._dynamo",
        )
    ]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.redirect_stdout(sys.stderr):
                yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def exporter_available() -> str | None:
    """None if this torch has the dynamo ONNX exporter with custom translations,
    else the reason (torch >= 2.4 runs the rest of the package; export needs more)."""
    import inspect

    params = inspect.signature(torch.onnx.export).parameters
    if "dynamo" not in params or "custom_translation_table" not in params:
        return (
            f"torch {torch.__version__} has no dynamo ONNX exporter with custom_translation_table; "
            f"dash-export needs a newer torch (developed and tested with torch 2.13)"
        )
    return None


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor as a NumPy array (bfloat16 as ml_dtypes.bfloat16, what ONNX Runtime takes)."""
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.detach().cpu().numpy()


def to_torch(a: np.ndarray) -> torch.Tensor:
    """The inverse of :func:`to_numpy`."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))
