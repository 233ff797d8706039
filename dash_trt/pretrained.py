"""Hugging Face checkpoint folders: ``config.json`` beside ``model.safetensors`` (or shards
listed by ``model.safetensors.index.json``), as ``save_pretrained`` writes them.

Parameter names follow the Llama convention of ``transformers``: ``model.embed_tokens.weight``,
``model.layers.N...``, ``model.norm.weight``, ``lm_head.weight``; :class:`~dash_trt.model.DashForCausalLM`
names the same tensors without the ``model.`` prefix, and both spellings are read. With
``tie_word_embeddings`` the output projection is the embedding table: ``lm_head.weight`` is
not written (safetensors cannot hold one storage twice) and may be absent when reading.
safetensors files hold tensors only, so reading one runs no code.

:func:`dash_trt.model.load_checkpoint` reads these folders (and single ``.safetensors``
files) wherever a ``model.pt`` is accepted; :func:`save_pretrained` writes one.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import torch

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TORCH_FILE = "model.pt"
HF_PREFIX = "model."
LM_HEAD = "lm_head.weight"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

__all__ = [
    "save_pretrained",
    "read_folder",
    "read_safetensors",
    "to_local_names",
    "is_pretrained_folder",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "INDEX_FILE",
]


class PretrainedError(RuntimeError):
    """A checkpoint folder or safetensors file cannot be read (the message says why)."""


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError:  # a declared dependency; only a broken install lacks it
        raise PretrainedError(
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
            raise PretrainedError(
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
        raise PretrainedError(f"weights file not found: {path}") from None
    except Exception as exc:  # safetensors raises its own SafetensorError on a bad header
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PretrainedError(f"{path} is not a readable safetensors file (corrupt or truncated?): {first}") from None


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise PretrainedError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PretrainedError(f"{what} {path} is not valid JSON: {exc}") from None


def read_folder(folder: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(state dict as stored, config.json dict)`` of a checkpoint folder:
    ``model.safetensors``, or the shards ``model.safetensors.index.json`` maps (every file
    it names must exist and hold exactly the tensors mapped to it)."""
    config_path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise PretrainedError(f"checkpoint folder {folder} has no {CONFIG_FILE}")
    config = _read_json(config_path, "model config")
    index_path = os.path.join(folder, INDEX_FILE)
    single = os.path.join(folder, WEIGHTS_FILE)
    if os.path.isfile(index_path):
        index = _read_json(index_path, "shard index")
        weight_map = index.get("weight_map") if isinstance(index, Mapping) else None
        if not isinstance(weight_map, Mapping) or not weight_map:
            raise PretrainedError(f"{index_path} has no 'weight_map' (tensor name -> shard file)")
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if not isinstance(shard, str) or os.path.basename(shard) != shard:
                raise PretrainedError(f"{index_path} names the shard {shard!r}: shards must be files in the folder")
            tensors = read_safetensors(os.path.join(folder, shard))
            want = {k for k, v in weight_map.items() if v == shard}
            if set(tensors) != want:
                missing, extra = sorted(want - set(tensors)), sorted(set(tensors) - want)
                raise PretrainedError(
                    f"{shard} does not hold what {INDEX_FILE} maps to it (missing "
                    f"{missing[:4]}, unexpected {extra[:4]})"
                )
            state.update(tensors)
    elif os.path.isfile(single):
        state = read_safetensors(single)
    else:
        there = sorted(os.listdir(folder))[:8]
        raise PretrainedError(
            f"checkpoint folder {folder} has no {WEIGHTS_FILE} or {INDEX_FILE} (it holds: "
            f"{', '.join(there) or 'nothing'})"
        )
    return state, config


def save_pretrained(model, folder: str | os.PathLike, *, max_shard_bytes: int | None = None) -> list[str]:
    """Write ``model`` (a :class:`~dash_trt.model.DashForCausalLM`) as a Hugging Face folder:
    ``config.json`` and ``model.safetensors``, or with ``max_shard_bytes`` shards of at most
    that size (a tensor larger than it gets a shard of its own) and their index. Each file is
    written whole and renamed into place, the index and config last; weight files of an
    earlier save that the new one does not use are removed. Returns the files written."""
    from .model import _atomic_write, saved_config

    st = _safetensors()
    folder = os.fspath(folder)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise PretrainedError(f"cannot write {folder}: it is a file, not a folder")
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
    shards: list[dict[str, torch.Tensor]] = [{}]
    if max_shard_bytes is not None:
        if max_shard_bytes < 1:
            raise PretrainedError("max_shard_bytes must be positive")
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
        _atomic_write(os.path.join(folder, fname), lambda tmp, part=part: st.save_file(part, tmp, metadata=meta))
        written.append(fname)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
            "weight_map": {k: fname for fname, part in zip(names, shards) for k in part},
        }
        _atomic_write(os.path.join(folder, INDEX_FILE), lambda tmp: _dump(index, tmp))
        written.append(INDEX_FILE)
    _atomic_write(os.path.join(folder, CONFIG_FILE), lambda tmp: _dump(config, tmp))
    written.append(CONFIG_FILE)
    for old in os.listdir(folder):  # an earlier save's weights would contradict this one
        if old not in written and (old in (WEIGHTS_FILE, INDEX_FILE) or _SHARD.fullmatch(old)):
            os.unlink(os.path.join(folder, old))
    return written


def _dump(obj: Any, path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")
