"""What every ONNX exporter of the package shares (the DASH models' in :mod:`dash_trt.export`,
the Dual Chunk Attention model's in :mod:`dash_trt.models.qwen2_dca`): whether this torch can
export, the exporter's logging kept quiet, the exporter's error, and tensors to and from the
NumPy arrays ONNX Runtime takes."""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["ExportError", "quiet_exporter", "exporter_available", "to_numpy", "to_torch"]


class ExportError(RuntimeError):
    """The exporter failed (not the user's input)."""


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
