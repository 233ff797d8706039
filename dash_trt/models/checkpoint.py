"""Checkpoints of DASH decoders: ``model.pt`` (``{"config": ..., "state_dict": ...}``, read with
``torch.load(weights_only=True)``), Hugging Face folders (``config.json`` beside
``model.safetensors``, or shards listed by ``model.safetensors.index.json``, as
``save_pretrained`` writes them) and single ``.safetensors`` files with their config.

Hugging Face parameter names follow the Llama convention of ``transformers``
(``model.embed_tokens.weight``, ``model.layers.N...``, ``model.norm.weight``,
``lm_head.weight``); a model class names its own tensors without its ``checkpoint_prefix``
(``model.`` for :class:`~dash_trt.models.decoder.DashForCausalLM`), and both spellings are
read. With ``tie_word_embeddings`` the output projection is the embedding table:
``lm_head.weight`` is not written (safetensors cannot hold one storage twice) and may be
absent when reading. safetensors files hold tensors only, so reading one runs no code.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..fileio import atomic_write
from ..modeling import DashModel, ModelContractError
from .config import DTYPES, DashModelConfig, load_model_config
from .deepencoder import DeepEncoderConfig, VisionTower, tower_state
from .registry import architecture_name, build_model

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "save_pretrained",
    "load_checkpoint",
    "saved_config",
    "read_folder",
    "read_safetensors",
    "is_pretrained_folder",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "INDEX_FILE",
    "TORCH_FILE",
]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read (missing, corrupt, unsafe or inconsistent)."""


def saved_config(model: DashModel) -> dict[str, Any]:
    """The config.json of ``model`` as saved: its dtype and its class's name as the architecture."""
    c = model.config
    return c.replace(
        torch_dtype=next(k for k, v in DTYPES.items() if v == model.dtype),
        extra={**c.extra, "architectures": [architecture_name(type(model))]},
    ).to_dict()


def save_checkpoint(model: DashModel, path: str | os.PathLike, *, config_json: bool = False) -> None:
    """Write ``model.pt`` = ``{"config": ..., "state_dict": ...}`` atomically (and a
    ``config.json`` beside it if asked)."""
    path = os.fspath(path)
    config = saved_config(model)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    atomic_write(path, lambda tmp: torch.save({"config": config, "state_dict": state}, tmp))
    if config_json:
        target = os.path.join(os.path.dirname(os.path.abspath(path)), "config.json")

        def dump(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(config, fh, indent=2)
                fh.write("\n")

        atomic_write(target, dump)


def load_checkpoint(
    path: str | os.PathLike,
    *,
    allow_pickle: bool = False,
    config: DashModelConfig | Mapping[str, Any] | None = None,
    model_class: str | type | None = None,
) -> DashModel:
    """Read a checkpoint: a ``model.pt``; a Hugging Face folder (``config.json`` with
    ``model.safetensors`` or sharded safetensors and their index, :mod:`dash_trt.models.checkpoint`;
    or with a ``model.pt``); or one ``.safetensors`` file with the ``config.json`` beside it.
    ``config`` (a ``config.json`` dict or :class:`DashModelConfig`) overrides the checkpoint's
    own, so a bare state dict plus a ``config.json`` works too. ``model_class`` (a class or
    ``module:Class``) is the model to build, by default the config's architecture
    (:func:`resolve_model_class`).

    Uses ``torch.load(weights_only=True)``: tensors and plain containers only. A file
    holding other Python objects (e.g. a pickled module) is refused unless
    ``allow_pickle=True``: unpickling can run arbitrary code, only do it for files you
    trust. Raises :class:`CheckpointError` or :class:`ModelConfigError` with a message
    that says what is wrong.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    if os.path.isdir(path):
        torch_file, config_file = os.path.join(path, TORCH_FILE), os.path.join(path, CONFIG_FILE)
        if not is_pretrained_folder(path) and os.path.isfile(torch_file):  # a folder holding model.pt
            if config is None and os.path.isfile(config_file):
                config = load_model_config(config_file)
            return load_checkpoint(torch_file, allow_pickle=allow_pickle, config=config, model_class=model_class)
        state, folder_config = read_folder(path)  # or the error that says what is missing
        return _from_state(path, state, config if config is not None else folder_config, model_class)
    if path.endswith(".safetensors"):
        if config is None:
            beside = os.path.join(os.path.dirname(os.path.abspath(path)), CONFIG_FILE)
            if not os.path.isfile(beside):
                raise CheckpointError(
                    f"{path}: a safetensors file holds no config; put the model's "
                    f"{CONFIG_FILE} beside it (or pass it: dash-export --config)"
                )
            config = load_model_config(beside)
        return _from_state(path, read_safetensors(path), config, model_class)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as exc:
        # The weights-only unpickler names the first class it refused ("Unsupported
        # global: GLOBAL pkg.Class"); any other unpickling error is a damaged file.
        blocked = re.search(r"unsupported GLOBAL ([\w.]+) whose module ([\w.]+) is blocked", str(exc))
        if blocked:
            raise CheckpointError(
                f"{path} is unsafe: unpickling it would call {blocked.group(1)} (module {blocked.group(2)}), which "
                f"runs code on this machine; a checkpoint holds tensors, so the file is malicious or broken. It was "
                f"not loaded; do not load it with --unsafe-load (allow_pickle=True), which would make that call"
            ) from None
        found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", str(exc))
        if found:
            raise CheckpointError(
                f"{path} holds pickled Python objects ({found.group(1)}; for example a whole nn.Module), "
                f"which the safe "
                f"loader (torch.load(weights_only=True)) refuses. Save it as "
                f"{{'config': ..., 'state_dict': ...}} (dash_trt.model.save_checkpoint), or, only if you "
                f"trust the file, pass --unsafe-load (allow_pickle=True): unpickling can run arbitrary "
                f"code."
            ) from None
        # Not torch's advice to drop weights_only (that would unpickle untrusted code, and
        # does not mend a damaged file): the unpickler's own reason.
        why = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\n|$)", str(exc), re.S)
        raise CheckpointError(
            f"{path} is not a readable PyTorch checkpoint (corrupt or truncated?): "
            f"{' '.join(why.group(1).split()) if why else _first_line(exc)}"
        ) from None
    except Exception as exc:  # zip errors, EOF, bad magic number, ...
        raise CheckpointError(
            f"{path} is not a readable PyTorch checkpoint (corrupt or truncated?): "
            f"{type(exc).__name__}: {_first_line(exc)}"
        ) from None

    if isinstance(obj, DashModel):  # only reachable with allow_pickle
        model = obj
        if config is not None:
            raise CheckpointError(f"{path} holds a whole model; a separate config cannot be applied to it")
        return model.eval()
    if isinstance(obj, nn.Module):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a DashModel (docs/models.md)")
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}; expected a dict with 'config' and 'state_dict'")
    if "state_dict" in obj:
        state, ckpt_config = obj["state_dict"], obj.get("config")
    elif all(isinstance(v, torch.Tensor) for v in obj.values()) and obj:
        state, ckpt_config = obj, None  # a bare state dict
    else:
        raise CheckpointError(f"{path} has no 'state_dict' entry (keys: {sorted(map(str, obj))[:8]})")
    if config is None:
        if ckpt_config is None:
            raise CheckpointError(
                f"{path} has no 'config' entry; give a folder holding it as {TORCH_FILE} beside the model's "
                f"{CONFIG_FILE} (or pass the {CONFIG_FILE}: dash-export --config)"
            )
        config = ckpt_config
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{path}: 'state_dict' is a {type(state).__name__}, expected a dict of tensors")
    return _from_state(path, state, config, model_class)


def _from_state(path: str, state: Mapping[str, torch.Tensor], config, model_class=None) -> DashModel:
    """The model of ``config`` with the weights ``state``, named as the module names them or
    with the class's Hugging Face prefix (``model.`` for :class:`DashForCausalLM`). A tied
    weight (``lm_head.weight`` with tied embeddings) may be absent: the tensor it shares is
    loaded. The dtype is the weights' where they agree, else the config's ``torch_dtype``."""
    if not isinstance(config, DashModelConfig):
        config = DashModelConfig.from_dict(config, source=f"config of {path}")
    nonfinite = [
        k
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())
    ]
    if nonfinite:
        raise CheckpointError(
            f"{path}: {len(nonfinite)} weight tensor(s) hold NaN or inf values "
            f"({_few(nonfinite, 3)}); the model would compute NaN logits"
        )
    try:
        model = build_model(config, model_class)
    except ModelContractError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    ignore = [re.compile(p) for p in getattr(type(model), "checkpoint_ignore", ())]
    if ignore:  # tensors of parts this class does not build (the class says which)
        state = {k: v for k, v in state.items() if not any(p.search(k) for p in ignore)}
    expected = model.state_dict()
    try:
        state = match_names(state, set(expected), type(model).checkpoint_prefix)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    wrong = [
        f"{k} is {list(v.shape)} in the checkpoint, {list(expected[k].shape)} in the model"
        for k, v in state.items()
        if k in expected and isinstance(v, torch.Tensor) and v.shape != expected[k].shape
    ]
    if wrong:
        raise CheckpointError(f"{path}: weights do not match the config: {_few(wrong, 3)}")
    result = model.load_state_dict(state, strict=False)
    shared: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    loaded = set(state)
    tied = {n for names in shared.values() if len(names) > 1 and loaded & set(names) for n in names}
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"{path}: weights do not match the config: missing {_few(missing)}, "
            f"unexpected {_few(result.unexpected_keys)}"
        )
    dtypes = {v.dtype for v in state.values() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    return model.to(dtypes.pop() if len(dtypes) == 1 else config.dtype).eval()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _few(keys: Sequence[str], n: int = 5) -> str:
    if not keys:
        return "none"
    more = f" and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


# --------------------------------------------------------------- Hugging Face folders
CONFIG_FILE = "config.json"


WEIGHTS_FILE = "model.safetensors"


INDEX_FILE = "model.safetensors.index.json"


TORCH_FILE = "model.pt"


HF_PREFIX = "model."


LM_HEAD = "lm_head.weight"


_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError:  # a declared dependency; only a broken install lacks it
        raise CheckpointError(
            "reading or writing safetensors needs the 'safetensors' package (pip install safetensors)"
        ) from None
    return st


def is_pretrained_folder(path: str) -> bool:
    """A folder with a config.json and weights this module reads."""
    return (
        os.path.isdir(path)
        and os.path.isfile(os.path.join(path, CONFIG_FILE))
        and any(os.path.isfile(os.path.join(path, f)) for f in (WEIGHTS_FILE, INDEX_FILE))
    )


def to_local_names(state: Mapping[str, torch.Tensor], prefix: str = HF_PREFIX) -> dict[str, torch.Tensor]:
    """Hugging Face names (``prefix``, ``model.``) to the module's; names without it are kept."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        local = name[len(prefix) :] if prefix and name.startswith(prefix) else name
        if local in out:
            raise CheckpointError(
                f"parameter {local!r} is present twice (as {name!r} and without the '{prefix}' prefix)"
            )
        out[local] = tensor
    return out


def match_names(state: Mapping[str, torch.Tensor], expected: set[str], prefix: str) -> dict[str, torch.Tensor]:
    """``state`` named as the module names its parameters (``expected``): as it is, or with the
    Hugging Face ``prefix`` removed, whichever matches more of them."""
    state = dict(state)
    if not prefix or not any(k.startswith(prefix) for k in state):
        return state
    local = to_local_names(state, prefix)
    return local if len(expected & set(local)) > len(expected & set(state)) else state


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, on the CPU."""
    st = _safetensors()
    try:
        return st.load_file(path, device="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"weights file not found: {path}") from None
    except Exception as exc:  # safetensors raises its own SafetensorError on a bad header
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path} is not a readable safetensors file (corrupt or truncated?): {first}") from None


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{what} {path} is not valid JSON: {exc}") from None


def read_folder(folder: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(state dict as stored, config.json dict)`` of a checkpoint folder:
    ``model.safetensors``, or the shards ``model.safetensors.index.json`` maps (every file
    it names must exist and hold exactly the tensors mapped to it)."""
    config_path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise CheckpointError(f"checkpoint folder {folder} has no {CONFIG_FILE}")
    config = _read_json(config_path, "model config")
    index_path = os.path.join(folder, INDEX_FILE)
    single = os.path.join(folder, WEIGHTS_FILE)
    if os.path.isfile(index_path):
        index = _read_json(index_path, "shard index")
        weight_map = index.get("weight_map") if isinstance(index, Mapping) else None
        if not isinstance(weight_map, Mapping) or not weight_map:
            raise CheckpointError(f"{index_path} has no 'weight_map' (tensor name -> shard file)")
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if not isinstance(shard, str) or os.path.basename(shard) != shard:
                raise CheckpointError(f"{index_path} names the shard {shard!r}: shards must be files in the folder")
            tensors = read_safetensors(os.path.join(folder, shard))
            want = {k for k, v in weight_map.items() if v == shard}
            if set(tensors) != want:
                missing, extra = sorted(want - set(tensors)), sorted(set(tensors) - want)
                raise CheckpointError(
                    f"{shard} does not hold what {INDEX_FILE} maps to it (missing "
                    f"{missing[:4]}, unexpected {extra[:4]})"
                )
            state.update(tensors)
    elif os.path.isfile(single):
        state = read_safetensors(single)
    else:
        there = sorted(os.listdir(folder))[:8]
        raise CheckpointError(
            f"checkpoint folder {folder} has no {WEIGHTS_FILE} or {INDEX_FILE} (it holds: "
            f"{', '.join(there) or 'nothing'})"
        )
    return state, config


def save_pretrained(
    model: DashModel,
    folder: str | os.PathLike,
    *,
    max_shard_bytes: int | None = None,
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
) -> list[str]:
    """Write ``model`` as a Hugging Face folder:
    ``config.json`` and ``model.safetensors``, or with ``max_shard_bytes`` shards of at most
    that size (a tensor larger than it gets a shard of its own) and their index. Each file is
    written whole and renamed into place, the index and config last; weight files of an
    earlier save that the new one does not use are removed. ``extra_tensors`` (checkpoint names)
    are stored beside the model's: parts of the checkpoint the model class does not build (a
    vision tower). Returns the files written."""
    st = _safetensors()
    folder = os.fspath(folder)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise CheckpointError(f"cannot write {folder}: it is a file, not a folder")
    os.makedirs(folder, exist_ok=True)
    config = saved_config(model)
    prefix = type(model).checkpoint_prefix
    state, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue  # a tied weight (lm_head.weight with tied embeddings): the tensor is stored once
        seen.add(id(tensor))
        hf = name if (name == LM_HEAD or not prefix) else prefix + name
        state[hf] = tensor.detach().cpu().contiguous()
    for name, tensor in (extra_tensors or {}).items():
        if name in state:
            raise CheckpointError(f"extra tensor {name!r} has the name of one of the model's")
        state[name] = tensor.detach().cpu().contiguous()
    shards: list[dict[str, torch.Tensor]] = [{}]
    if max_shard_bytes is not None:
        if max_shard_bytes < 1:
            raise CheckpointError("max_shard_bytes must be positive")
        size = 0
        for name, tensor in state.items():
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = tensor
            size += nbytes
    else:
        shards[0] = state
    written: list[str] = []
    meta = {"format": "pt"}
    if len(shards) == 1:
        names = [WEIGHTS_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, part in zip(names, shards):
        atomic_write(os.path.join(folder, fname), lambda tmp, part=part: st.save_file(part, tmp, metadata=meta))
        written.append(fname)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
            "weight_map": {k: fname for fname, part in zip(names, shards) for k in part},
        }
        atomic_write(os.path.join(folder, INDEX_FILE), lambda tmp: _dump(index, tmp))
        written.append(INDEX_FILE)
    atomic_write(os.path.join(folder, CONFIG_FILE), lambda tmp: _dump(config, tmp))
    written.append(CONFIG_FILE)
    for old in os.listdir(folder):  # an earlier save's weights would contradict this one
        if old not in written and (old in (WEIGHTS_FILE, INDEX_FILE) or _SHARD.fullmatch(old)):
            os.unlink(os.path.join(folder, old))
    return written


def _dump(obj: Any, path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")


def load_vision_tower(path, config=None, dtype: torch.dtype | None = None) -> VisionTower:
    """The vision tower of a checkpoint folder (safetensors, sharded or not). ``config`` (the
    folder's config.json dict or :class:`~dash_trt.models.config.DashModelConfig`) defaults to the
    folder's. Raises :class:`CheckpointError` naming what is missing,
    unexpected or of the wrong shape."""
    state, folder_config = read_folder(str(path))
    cfg = DeepEncoderConfig.from_config(config if config is not None else folder_config)
    tensors = tower_state(state)
    if not tensors:
        raise CheckpointError(f"{path}: the checkpoint holds no vision tower (model.sam_model., model.vision_model.)")
    with torch.device("meta"):
        tower = VisionTower(cfg)
    want = tower.state_dict()
    wrong = [f"{k} is {list(v.shape)} in the checkpoint, {list(want[k].shape)} in the tower"
             for k, v in tensors.items() if k in want and v.shape != want[k].shape]  # fmt: skip
    missing = sorted(set(want) - set(tensors))
    unexpected = sorted(set(tensors) - set(want))
    if wrong or missing or unexpected:
        raise CheckpointError(
            f"{path}: the vision tower's weights do not match its config: "
            + "; ".join(
                wrong[:3]
                + ([f"missing {', '.join(missing[:4])}"] if missing else [])
                + ([f"unexpected {', '.join(unexpected[:4])}"] if unexpected else [])
            )  # fmt: skip
        )
    tower = tower.to_empty(device="cpu")
    tower.load_state_dict(tensors)
    dtypes = {v.dtype for v in tensors.values() if v.is_floating_point()}
    return tower.to(dtype or (dtypes.pop() if len(dtypes) == 1 else torch.float32)).eval()
