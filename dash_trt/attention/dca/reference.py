"""The PyTorch reference of Dual Chunk Attention (DCA): the function every DCA backend computes.

DCA (An et al., "Training-Free Long-Context Scaling of Large Language Models", ICML 2024) runs
a RoPE model far past its trained context by never letting a query see a relative distance
larger than ``chunk_size``. This module states the function as vLLM's Qwen2 integration
computes it (``DualChunkRotaryEmbedding`` and the ``DUAL_CHUNK_FLASH_ATTN`` backend; not part
of this repository, and never imported), as one softmax per query instead of vLLM's three
flash-attention calls and log-sum-exp merge. docs/dca.md states the formulas, the sources and
where they differ.

With ``C = chunk_size``, ``W = local_size``, ``c = C - W`` (the chunk length) and
``p' = p mod c``:

* keys are rotated at ``p'``;
* a query at position ``i`` attending key ``j <= i`` is rotated at ``i'`` when ``j`` is in its
  own chunk (``j // c == i // c``, "intra"), at ``min(i' + c, C)`` when ``j`` is in the
  previous chunk ("successive"), and at the constant ``min(2c - 1, C)`` for every earlier
  chunk ("inter");
* one softmax over all keys ``j <= i``;
* with ``original_max_position_embeddings`` set, queries and keys are multiplied by
  ``s(L) = max(1, 0.1 ln(L / original_max_position_embeddings) + 1)`` (see
  :func:`dual_chunk_attention` for which ``L``).

Everything is computed in float32 (RoPE angles in float64), grouped by KV head (GQA), and the
query rows are processed in blocks bounded by a memory budget; blocking never changes the
result.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..errors import ModelConfigError

__all__ = [
    "CONFIG_KEY",
    "SPARSE_CONFIG_FILE",
    "DcaConfig",
    "DcaConfigError",
    "DcaPositions",
    "dca_positions",
    "dual_chunk_attention",
    "length_scale",
    "read_model_config",
    "sparse_attention_enabled",
    "check_dense",
]

#: The Hugging Face ``config.json`` key vLLM's Qwen2/Qwen3 models read (``getattr(config,
#: "dual_chunk_attention_config", None)``).
CONFIG_KEY = "dual_chunk_attention_config"

#: The file beside the weights that vLLM (``get_sparse_attention_config``) and SGLang read and
#: merge into :data:`CONFIG_KEY` as its ``sparse_attention_config`` (Qwen2.5-7B/14B-Instruct-1M
#: ship one): MInference vertical-slash sparse prefill for prompts over
#: ``sparse_attention_threshold`` tokens, which dash-trt does not implement.
SPARSE_CONFIG_FILE = "sparse_attention_config.json"

#: Upstream's default ``sparse_attention_threshold``: prompts longer than this run sparse prefill.
SPARSE_THRESHOLD_DEFAULT = 32768

#: Bytes of float32 logits one block of query rows may hold (three rotations).
_BLOCK_BUDGET_BYTES = 128 << 20

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class DcaConfigError(ModelConfigError):
    """A Dual Chunk Attention configuration (or call) that cannot be run (a
    :class:`~dash_trt.attention.errors.ModelConfigError`, so the tools that catch a model's config
    errors catch it; a ``ValueError`` as before)."""


def _positive_int(name: str, value: Any, *, allow_zero: bool = False) -> int:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        want = "a non-negative int" if allow_zero else "a positive int"
        raise DcaConfigError(f"{name} must be {want}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class DcaConfig:
    """``dual_chunk_attention_config``: validated once, on construction.

    ``original_max_position_embeddings`` 0 (vLLM's default when the key is absent) turns the
    length scaling off.
    """

    chunk_size: int
    local_size: int
    original_max_position_embeddings: int = 0

    def __post_init__(self) -> None:
        _positive_int("dual_chunk_attention_config.chunk_size", self.chunk_size)
        _positive_int("dual_chunk_attention_config.local_size", self.local_size)
        if self.original_max_position_embeddings is None:
            object.__setattr__(self, "original_max_position_embeddings", 0)
        _positive_int(
            "dual_chunk_attention_config.original_max_position_embeddings",
            self.original_max_position_embeddings,
            allow_zero=True,
        )
        if self.local_size >= self.chunk_size:
            raise DcaConfigError(
                f"dual_chunk_attention_config.local_size ({self.local_size}) must be smaller than chunk_size "
                f"({self.chunk_size}): the chunk length chunk_size - local_size must be positive"
            )

    # ------------------------------------------------------------------ derived values
    @property
    def chunk_len(self) -> int:
        """``c = chunk_size - local_size``: the stride of the chunking."""
        return self.chunk_size - self.local_size

    @property
    def inter_position(self) -> int:
        """The constant rotation position of a query against keys two or more chunks back."""
        return min(2 * self.chunk_len - 1, self.chunk_size)

    @property
    def scaled(self) -> bool:
        """Whether the length scaling ``s(L)`` is on."""
        return self.original_max_position_embeddings > 0

    def length_scale(self, length: int) -> float:
        """``s(length)``; exactly 1.0 when scaling is off or ``length <= original_max_position_embeddings``."""
        return length_scale(length, self.original_max_position_embeddings)

    def positions(self, positions: torch.Tensor) -> DcaPositions:
        """The rotation positions of tokens at absolute ``positions`` (see :func:`dca_positions`)."""
        return dca_positions(positions, chunk_size=self.chunk_size, local_size=self.local_size)

    def check_kv_block_size(self, block_size: int) -> None:
        """Refuse a paged-KV block size that does not divide the chunk length ``c``.

        With ``c`` a multiple of the block size every KV block lies in exactly one chunk, so a
        paged kernel picks the query rotation per block, not per key (vLLM refuses the same
        configurations: "chunk_len must be divisible by block_size.").
        """
        _positive_int("KV block size", block_size)
        if self.chunk_len % block_size:
            raise DcaConfigError(
                f"the DCA chunk length chunk_size - local_size = {self.chunk_size} - {self.local_size} = "
                f"{self.chunk_len} must be a multiple of the KV block size {block_size}"
            )

    def to_dict(self) -> dict[str, int]:
        """The ``dual_chunk_attention_config`` dict (JSON-serialisable)."""
        return {
            "chunk_size": self.chunk_size,
            "local_size": self.local_size,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, section: Mapping[str, Any], *, folder: str | os.PathLike | None = None) -> DcaConfig:
        """Build from the ``dual_chunk_attention_config`` section itself (``folder``: the model
        folder, where a :data:`SPARSE_CONFIG_FILE` is looked for).

        ``chunk_size`` and ``local_size`` are required (vLLM's ``get_rope`` hands them to
        ``DualChunkRotaryEmbedding``, which has no defaults); ``original_max_position_embeddings``
        defaults to 0 (off), as in vLLM's backend. The sparse (MInference) mode of vLLM #11844
        is not implemented: a section and folder that upstream would run sparse are refused rather
        than silently run dense (:func:`check_dense`). Other keys are ignored.
        """
        if not isinstance(section, Mapping):
            raise DcaConfigError(f"{CONFIG_KEY} must be a JSON object, got {type(section).__name__}")
        missing = [k for k in ("chunk_size", "local_size") if k not in section]
        if missing:
            raise DcaConfigError(f"{CONFIG_KEY} is missing required key(s): {', '.join(missing)}")
        cfg = cls(
            chunk_size=section["chunk_size"],
            local_size=section["local_size"],
            original_max_position_embeddings=section.get("original_max_position_embeddings", 0),
        )
        check_dense(section, folder=folder)
        return cfg

    @classmethod
    def from_model_config(
        cls, config: Mapping[str, Any] | str | os.PathLike, *, folder: str | os.PathLike | None = None
    ) -> DcaConfig:
        """Build from a Hugging Face model config: the parsed ``config.json`` dict, the path of
        that file, or the model folder holding it; section ``dual_chunk_attention_config``. The
        folder (the file's, or ``folder`` beside a dict) is where a :data:`SPARSE_CONFIG_FILE` is
        looked for."""
        if isinstance(config, Mapping):
            source = "model config"
        else:
            config, source = read_model_config(config)
            folder = os.path.dirname(source)
        section = config.get(CONFIG_KEY)
        if section is None:
            raise DcaConfigError(f"{source} has no {CONFIG_KEY!r}: not a Dual Chunk Attention model")
        return cls.from_dict(section, folder=folder)


def read_model_config(path: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """``(the parsed config.json, its path)`` of a model folder or of the file itself;
    :class:`DcaConfigError` when it is missing, not JSON or not a JSON object."""
    source = os.fspath(path)
    if os.path.isdir(source):
        source = os.path.join(source, "config.json")
    try:
        with open(source, encoding="utf-8") as fh:
            config = json.load(fh)
    except FileNotFoundError:
        raise DcaConfigError(f"model config not found: {source}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DcaConfigError(f"model config {source} is not valid JSON: {exc}") from None
    if not isinstance(config, Mapping):
        raise DcaConfigError(f"{source} must hold a JSON object")
    return config, source


def _sparse_file(folder: str | os.PathLike | None) -> str | None:
    """The path of the folder's :data:`SPARSE_CONFIG_FILE` when upstream would merge it into the
    section (it exists and holds a non-empty value: vLLM's and SGLang's ``if sparse_attn_config:``),
    else None. A file that cannot be read as JSON is refused (upstream's ``json.load`` fails too)."""
    if folder is None:
        return None
    path = os.path.join(os.fspath(folder), SPARSE_CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            content = json.load(fh)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DcaConfigError(
            f"{path} cannot be read as JSON ({exc}); vLLM and SGLang read this file to switch Dual Chunk Attention to "
            "sparse prefill, and dash-trt runs it dense only: remove the file, or set "
            f'"sparse_attention_enabled": false in {CONFIG_KEY} of config.json'
        ) from None
    return path if content else None


def sparse_attention_enabled(section: Mapping[str, Any], *, folder: str | os.PathLike | None = None) -> bool:
    """Whether vLLM and SGLang would run the sparse (MInference vertical-slash) prefill for this
    section and folder: ``section.get("sparse_attention_enabled", <a sparse config exists>)``, a
    sparse config existing when the section has a ``sparse_attention_config`` (not null) or the
    folder a non-empty :data:`SPARSE_CONFIG_FILE` (upstream merges the file into the section and
    then enables it unless the key is set). ``sparse_attention_enabled`` must be a JSON boolean."""
    if "sparse_attention_enabled" in section:
        flag = section["sparse_attention_enabled"]
        if not isinstance(flag, bool):
            raise DcaConfigError(f"{CONFIG_KEY}.sparse_attention_enabled must be true or false, got {flag!r}")
        return flag
    return section.get("sparse_attention_config") is not None or _sparse_file(folder) is not None


def check_dense(section: Mapping[str, Any], *, folder: str | os.PathLike | None = None) -> None:
    """Refuse (:class:`DcaConfigError`, one line) a section and folder that upstream would run with
    sparse prefill (:func:`sparse_attention_enabled`): dash-trt runs DCA dense only, and running
    such a config dense would silently give other results than vLLM and SGLang on long prompts.
    With ``sparse_attention_enabled: false`` it runs dense, as upstream does; a
    :data:`SPARSE_CONFIG_FILE` in the folder is then ignored, and a warning says so."""
    explicit = "sparse_attention_enabled" in section
    if not sparse_attention_enabled(section, folder=folder):
        path = _sparse_file(folder) if explicit else None
        if path is not None:
            warnings.warn(
                f"{path} is ignored: {CONFIG_KEY}.sparse_attention_enabled is false, so Dual Chunk Attention runs "
                "dense (as vLLM and SGLang run it with that key)",
                UserWarning,
                stacklevel=2,
            )
        return
    threshold = section.get("sparse_attention_threshold", SPARSE_THRESHOLD_DEFAULT)
    how = (
        f'to run it dense deliberately, set "sparse_attention_enabled": false in {CONFIG_KEY} of config.json '
        "(which is how vLLM and SGLang turn it off)"
    )
    mode = f"the sparse (MInference vertical-slash) mode for prompts over {threshold} tokens"
    if explicit:
        raise DcaConfigError(
            f"{CONFIG_KEY}.sparse_attention_enabled is true: {mode}, which dash-trt does not implement (it runs Dual "
            f"Chunk Attention dense only); {how}"
        )
    if section.get("sparse_attention_config") is not None:
        raise DcaConfigError(
            f"{CONFIG_KEY} has a sparse_attention_config and no sparse_attention_enabled, so vLLM and SGLang run "
            f"{mode}; dash-trt runs Dual Chunk Attention dense only: {how}"
        )
    raise DcaConfigError(
        f"{_sparse_file(folder)}: vLLM and SGLang merge this file into {CONFIG_KEY} and run {mode}; dash-trt runs "
        f"Dual Chunk Attention dense only: {how}"
    )


def length_scale(length: int, original_max_position_embeddings: int | None) -> float:
    """``s(L) = max(1, 0.1 ln(L / L_orig) + 1)``; 1.0 when ``L_orig`` is None or 0.

    The factor multiplies queries and keys (so logits by about ``s**2``): YaRN's attention
    temperature with the dynamic scale ``L / L_orig``, as vLLM's DCA backend applies it.
    """
    if not original_max_position_embeddings:
        return 1.0
    _positive_int("length", length)
    return max(1.0, 0.1 * math.log(length / original_max_position_embeddings) + 1.0)


class DcaPositions(NamedTuple):
    """Rotation positions of tokens (int64 tensors of the positions' shape)."""

    intra: torch.Tensor  #: query against its own chunk: ``p mod c``
    successive: torch.Tensor  #: query against the previous chunk: ``min(p mod c + c, C)``
    inter: torch.Tensor  #: query against every earlier chunk: ``min(2c - 1, C)``
    key: torch.Tensor  #: the key (as cached): ``p mod c``


def dca_positions(positions: torch.Tensor, *, chunk_size: int, local_size: int) -> DcaPositions:
    """The three query rotation positions and the key rotation position of tokens at absolute
    (0-based) ``positions``."""
    cfg = DcaConfig(chunk_size, local_size)
    p = torch.as_tensor(positions)
    if p.dtype.is_floating_point or p.dtype == torch.bool or p.is_complex():
        raise DcaConfigError(f"positions must be an integer tensor, got dtype {p.dtype}")
    p = p.to(torch.int64)
    if p.numel() and int(p.min()) < 0:
        raise DcaConfigError("positions must be >= 0")
    c = cfg.chunk_len
    local = p % c
    return DcaPositions(
        intra=local,
        successive=torch.clamp(local + c, max=cfg.chunk_size),
        inter=torch.full_like(p, cfg.inter_position),
        key=local.clone(),
    )


# --------------------------------------------------------------------- the function
def _rope_tables(pos: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [N, rotary_dim/2] of positions ``pos`` [N] (angles in float64, tables float32)."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=pos.device) / rotary_dim
    inv_freq = 1.0 / (float(theta) ** exponent)
    angles = pos.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Neox-style RoPE of float32 ``x`` [N, heads, D] over its first ``rotary_dim`` dims."""
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)


def _check_inputs(q, k, v, rotary_dim, theta, softmax_scale) -> int:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise DcaConfigError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.ndim != 3:
            raise DcaConfigError(f"{name} must have 3 dims ([tokens, heads, head_dim]), got shape {list(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise DcaConfigError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    nq, nh, hd = q.shape
    length, hkv, _ = k.shape
    if k.shape[2] != hd:
        raise DcaConfigError(f"k's head_dim ({k.shape[2]}) must equal q's ({hd})")
    if v.shape[:2] != k.shape[:2]:
        raise DcaConfigError(f"v must have k's tokens and heads {list(k.shape[:2])}, got {list(v.shape[:2])}")
    if length == 0:
        raise DcaConfigError("k and v must hold at least one token")
    if nq > length:
        raise DcaConfigError(f"q holds the last positions of the sequence: queries ({nq}) <= keys ({length})")
    if hkv == 0 or nh % hkv:
        raise DcaConfigError(f"query heads ({nh}) must be a multiple of KV heads ({hkv}) for grouped-query attention")
    rd = hd if rotary_dim is None else rotary_dim
    if isinstance(rd, bool) or not isinstance(rd, int) or rd <= 0 or rd > hd or rd % 2:
        raise DcaConfigError(f"rotary_dim must be an even int in [2, head_dim={hd}], got {rotary_dim!r}")
    if not (isinstance(theta, (int, float)) and not isinstance(theta, bool) and theta > 0 and math.isfinite(theta)):
        raise DcaConfigError(f"rope_theta must be a positive number, got {theta!r}")
    if softmax_scale is not None and not (
        isinstance(softmax_scale, (int, float))
        and not isinstance(softmax_scale, bool)
        and softmax_scale > 0
        and math.isfinite(softmax_scale)
    ):
        raise DcaConfigError(f"softmax_scale must be None or a positive number, got {softmax_scale!r}")
    return rd


def _key_scales(cfg: DcaConfig, length: int, scale_length: int, key_scale_lengths, device) -> torch.Tensor | None:
    """Per-key factors [S] (float32), or None when every key's factor is exactly 1."""
    if key_scale_lengths is None:
        s = cfg.length_scale(scale_length)
        return None if s == 1.0 else torch.full((length,), s, dtype=torch.float32, device=device)
    kl = torch.as_tensor(key_scale_lengths)
    if kl.dtype.is_floating_point or kl.dtype == torch.bool or kl.shape != (length,):
        raise DcaConfigError(f"key_scale_lengths must be an integer tensor of shape [{length}]")
    kl = kl.to(device=device, dtype=torch.int64)
    # key j was written when the sequence held at least j + 1 tokens, and no later than now
    low = torch.arange(1, length + 1, device=device)
    if bool((kl < low).any()) or bool((kl > scale_length).any()):
        raise DcaConfigError(
            f"key_scale_lengths[j] (the length the key at position j was written with) must lie in "
            f"[j + 1, scale_length={scale_length}]"
        )
    if not cfg.scaled:
        return None
    scales = (0.1 * torch.log(kl.to(torch.float64) / cfg.original_max_position_embeddings) + 1.0).clamp(min=1.0)
    return scales.float()


def dual_chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    chunk_size: int,
    local_size: int,
    rope_theta: float = 10000.0,
    rotary_dim: int | None = None,
    original_max_position_embeddings: int | None = None,
    softmax_scale: float | None = None,
    scale_length: int | None = None,
    key_scale_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dual Chunk Attention, exactly: q [Q, H, D] are the last Q positions of a sequence whose
    keys and values k, v [S, Hkv, D] cover positions 0..S-1, all unrotated. Returns [Q, H, D]
    in q's dtype, computed in float32.

    RoPE is neox-style (rotate-half) over the first ``rotary_dim`` dims (default D) with base
    ``rope_theta``; H must be a multiple of Hkv (grouped-query heads); ``softmax_scale``
    defaults to ``D ** -0.5``.

    Length scaling, when ``original_max_position_embeddings`` is a positive int (None or 0:
    off). As vLLM's backend does, the queries are multiplied by ``s(scale_length)`` and each
    key j by ``s(key_scale_lengths[j])``:

    * ``scale_length`` (default S) is the sequence length the step is scaled with: the full
      prompt length for a prefill, in every chunk of a chunked prefill (so it may exceed S),
      and the current length S in a decode step;
    * ``key_scale_lengths`` [S] (default: ``scale_length`` for every key) is the length each
      key was scaled with when it was written to the KV cache: the prompt length for the
      prompt's keys, ``t + 1`` for a key generated at position t. Each must lie in
      ``[j + 1, scale_length]``.

    The defaults are a one-shot prefill of S tokens: queries and keys all scaled by ``s(S)``.
    """
    cfg = DcaConfig(chunk_size, local_size, original_max_position_embeddings or 0)
    rd = _check_inputs(q, k, v, rotary_dim, rope_theta, softmax_scale)
    nq, nh, hd = q.shape
    length, hkv, dv = v.shape
    if scale_length is None:
        scale_length = length
    _positive_int("scale_length", scale_length)
    if scale_length < length:
        raise DcaConfigError(f"scale_length ({scale_length}) must be >= the number of keys ({length})")
    if nq == 0:
        return q.new_zeros((0, nh, dv))
    device = q.device
    scale = hd**-0.5 if softmax_scale is None else float(softmax_scale)

    # keys rotated at p mod c, scaled by the factor they were written with
    pos_k = torch.arange(length, device=device)
    kpos = cfg.positions(pos_k)
    kc, ks = _rope_tables(kpos.key, rd, rope_theta)
    kr = _rotate(k.float(), kc, ks, rd)
    k_scales = _key_scales(cfg, length, scale_length, key_scale_lengths, device)
    if k_scales is not None:
        kr = kr * k_scales[:, None, None]
    vf = v.float()

    # queries: three rotations each, and s(scale_length) (folded into the softmax scale)
    pos_q = torch.arange(length - nq, length, device=device)
    qpos = cfg.positions(pos_q)
    qf = q.float()
    q_rot = []
    for table in (qpos.intra, qpos.successive, qpos.inter):
        cos, sin = _rope_tables(table, rd, rope_theta)
        q_rot.append(_rotate(qf, cos, sin, rd))
    logit_scale = scale * cfg.length_scale(scale_length)

    group = nh // hkv
    kh = kr.permute(1, 2, 0)  # [Hkv, D, S]
    vh = vf.permute(1, 0, 2)  # [Hkv, S, Dv]
    chunk_k = pos_k // cfg.chunk_len
    out = torch.empty((nq, nh, dv), dtype=torch.float32, device=device)
    rows = max(1, _BLOCK_BUDGET_BYTES // max(1, 4 * 4 * nh * length))
    for r0 in range(0, nq, rows):
        r1 = min(nq, r0 + rows)
        pq = pos_q[r0:r1]
        back = (pq // cfg.chunk_len)[:, None] - chunk_k[None, :]  # chunks between query and key [R, S]
        visible = pos_k[None, :] <= pq[:, None]
        parts = []
        for qr in q_rot:
            # [Hkv, G*R, D] @ [Hkv, D, S] -> [Hkv, G, R, S]
            qh = qr[r0:r1].reshape(r1 - r0, hkv, group, hd).permute(1, 2, 0, 3).reshape(hkv, group * (r1 - r0), hd)
            parts.append(torch.bmm(qh, kh).reshape(hkv, group, r1 - r0, length))
        intra, successive, inter = parts
        # same chunk: intra; previous chunk: successive; earlier: inter (later keys are masked below)
        logits = torch.where(back >= 2, inter, torch.where(back == 1, successive, intra))
        logits = (logits * logit_scale).masked_fill(~visible, float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # one softmax over the union of the regions
        o = torch.bmm(probs.reshape(hkv, group * (r1 - r0), length), vh)  # [Hkv, G*R, Dv]
        out[r0:r1] = o.reshape(hkv, group, r1 - r0, dv).permute(2, 0, 1, 3).reshape(r1 - r0, nh, dv)
    return out.to(q.dtype)
