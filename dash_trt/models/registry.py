"""Which model class a config names, and building one: :func:`resolve_model_class`,
:func:`build_model`, random weights (:func:`random_model`, :func:`demo_model`)."""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..modeling import DashModel, ModelContractError
from .config import ARCHITECTURE, DashModelConfig
from .decoder import DEMO_CONFIG, DashForCausalLM
from .unlimited_ocr2 import UnlimitedOCR2ForCausalLM

__all__ = [
    "resolve_model_class",
    "build_model",
    "model_class_spec",
    "random_model",
    "demo_model",
    "init_weights",
    "USER_MODULE_PREFIX",
    "MODEL_ENTRY_POINTS",
    "BUILTIN_ARCHITECTURES",
    "architecture_name",
    "is_default_class",
]


# --------------------------------------------------------------------------- models
#: Module-name prefix of model classes loaded from a file (``--model path/file.py:Class``).
USER_MODULE_PREFIX = "dash_trt_user_model_"


#: Entry-point group under which installed packages register DASH model classes by name (the
#: name is the config.json's ``architectures[0]``).
MODEL_ENTRY_POINTS = "dash_trt.models"

#: The model classes built in, by the ``architectures[0]`` their config.json names.
BUILTIN_ARCHITECTURES: dict[str, type[DashModel]] = {
    ARCHITECTURE: DashForCausalLM,
    UnlimitedOCR2ForCausalLM.architecture_name: UnlimitedOCR2ForCausalLM,
}


def is_default_class(cls: type) -> bool:
    """Whether ``cls`` is the class a config without ``architectures`` builds (the built-in
    decoder): a served repository then names no class."""
    return cls is DashForCausalLM


def resolve_model_class(spec: str | type | None = None, config: DashModelConfig | None = None) -> type[DashModel]:
    """The model class to build: ``spec`` (a class, ``"package.module:Class"`` or
    ``"path/to/file.py:Class"``), else the class the config's ``architectures[0]`` names
    (``DashForCausalLM``, or one registered under the ``dash_trt.models`` entry points).
    Raises :class:`ModelContractError` with what to do."""
    if isinstance(spec, type):
        cls = spec
    elif spec:
        cls = _import_class(spec)
    else:
        arch = config.architecture if config is not None else ARCHITECTURE
        if arch in BUILTIN_ARCHITECTURES:
            return BUILTIN_ARCHITECTURES[arch]
        from importlib.metadata import entry_points

        found = [ep for ep in entry_points(group=MODEL_ENTRY_POINTS) if ep.name == arch]
        if not found:
            raise ModelContractError(
                f"the config names the architecture {arch!r}, which is not built in "
                f"({', '.join(BUILTIN_ARCHITECTURES)}) nor registered under the '{MODEL_ENTRY_POINTS}' entry "
                f"points: pass the class with --model module:Class or --model path/to/file.py:Class (dash-export, "
                f"dash-triton write, dash-compare)"
            )
        cls = found[0].load()
    if not (isinstance(cls, type) and issubclass(cls, DashModel)):
        raise ModelContractError(f"{spec or cls!r} is not a dash_trt.modeling.DashModel subclass (see docs/models.md)")
    return cls


def _import_class(spec: str) -> type:
    import importlib
    import importlib.util

    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ModelContractError(f"--model {spec!r}: expected module:Class or path/to/file.py:Class")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            path = os.path.abspath(module_name)
            if not os.path.isfile(path):
                raise ModelContractError(f"--model {spec!r}: {module_name} is not a file")
            name = USER_MODULE_PREFIX + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
            loaded = sys.modules.get(name)
            if loaded is None or getattr(loaded, "__file__", None) != path:
                mod_spec = importlib.util.spec_from_file_location(name, path)
                loaded = importlib.util.module_from_spec(mod_spec)
                sys.modules[name] = loaded
                mod_spec.loader.exec_module(loaded)
            module = loaded
        else:
            module = importlib.import_module(module_name)
    except ModelContractError:
        raise
    except ImportError as exc:
        raise ModelContractError(f"--model {spec!r}: cannot import {module_name}: {exc}") from None
    except Exception as exc:  # the user's module raised while importing
        raise ModelContractError(
            f"--model {spec!r}: importing {module_name} failed: {type(exc).__name__}: {exc}"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ModelContractError(f"--model {spec!r}: {module_name} has no {attr}") from None


def architecture_name(cls: type) -> str:
    """The ``architectures[0]`` a checkpoint of ``cls`` names (its ``architecture_name``, or
    its class name)."""
    return getattr(cls, "architecture_name", None) or cls.__name__


def model_class_spec(cls: type) -> str:
    """``module:Class`` for a class (what a repository records)."""
    return f"{cls.__module__}:{cls.__qualname__}"


def build_model(config: DashModelConfig, model_class: str | type | None = None) -> DashModel:
    """An untrained model of ``config`` (its class from ``model_class`` or the config), checked
    against the contract (one DashAttention module per layer, sizes as configured)."""
    cls = resolve_model_class(model_class, config)
    try:
        model = cls(config)
    except ModelContractError:
        raise
    except Exception as exc:
        raise ModelContractError(f"{cls.__name__}(config) failed: {type(exc).__name__}: {exc}") from None
    model.dash_layers()
    return model


def init_weights(model: DashModel, gen: torch.Generator) -> None:
    """Random weights with O(1) activations and logits (fan-in scaled), so that greedy
    decoding and top-k routing are not decided by float rounding: norm weights near 1,
    embedding tables and other vectors N(0, 1), biases N(0, 0.1), matrices N(0, 1/fan_in); the
    weights of norms applied as ``1 + weight`` (``zero_centered``, the DASH router's) N(0, 0.1)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    norm_modules = [
        m for n, m in model.named_modules() if "norm" in type(m).__name__.lower() or "norm" in n.split(".")[-1]
    ]
    norms = {id(p): getattr(m, "zero_centered", False) for m in norm_modules for p in m.parameters(recurse=False)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            kw = {"generator": gen, "device": gen.device, "dtype": torch.float32}
            if id(p) in norms and p.ndim == 1 and not name.endswith("bias"):
                p.copy_((0.0 if norms[id(p)] else 1.0) + 0.1 * torch.randn(p.shape, **kw))
            elif p.ndim == 2 and id(p) not in embeddings:
                p.copy_(torch.randn(p.shape, **kw) / math.sqrt(p.shape[1]))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, **kw))
            else:
                p.copy_(torch.randn(p.shape, **kw))


def random_model(
    config: DashModelConfig | Mapping[str, Any],
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    model_class: str | type | None = None,
) -> DashModel:
    """A model of ``config`` with random weights (for demos, tests and benchmarks); its class
    from ``model_class`` or the config (:func:`resolve_model_class`). ``device`` builds and
    fills it there (a GPU's generator: other numbers than the CPU's, and seconds instead of
    minutes for a billion-parameter benchmark model)."""
    if not isinstance(config, DashModelConfig):
        config = DashModelConfig.from_dict(config)
    device = torch.device(device) if device is not None else torch.device("cpu")
    dtype = dtype or config.dtype
    with torch.device(device):
        model = build_model(config, model_class).to(dtype)
    init_weights(model, torch.Generator(device=device).manual_seed(seed))
    return model.eval()


def demo_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> DashModel:
    """The built-in random demo model (:data:`DEMO_CONFIG`)."""
    return random_model(DEMO_CONFIG, seed=seed, dtype=dtype)
