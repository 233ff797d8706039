"""Unlimited-OCR-2's vision tower (DeepSeek-OCR's DeepEncoder): SAM-ViT-B, then CLIP-L on SAM's
features, a linear projector, and the newline and view-separator embeddings, named as the
checkpoint names them (``model.sam_model.``, ``model.vision_model.``, ``model.projector.``,
``model.image_newline``, ``model.view_seperator``). Written from vLLM 0.34.0's
``models/deepencoder.py`` and ``models/deepseek_ocr.py``.

A view [3, S, S] (S = 1024 for a page's global view, 640 for a tile) goes through:

- SAM: 16 x 16 patches (S/16 a side) plus absolute position embeddings (bicubic-resized from
  the 64 x 64 they were trained at when S differs), 12 blocks (LayerNorm, attention with
  decomposed relative positions, in 14 x 14 windows except the global blocks 2, 5, 8 and 11;
  LayerNorm, GELU MLP), a neck (1 x 1 and 3 x 3 convolutions, each followed by a channel
  LayerNorm) and two stride-2 3 x 3 convolutions: [1024, S/64, S/64];
- CLIP-L: those S/64 x S/64 vectors as its patch embeddings, a class token and position
  embeddings (resized likewise), a pre-LayerNorm and 24 pre-norm layers (quick-GELU MLP);
- the CLIP output without its class token, concatenated with SAM's ([S/64)^2, 2048]), through the
  projector: the view's ``(S/64)^2`` features of the decoder's hidden size.

:func:`assemble_page` lays a page's views out as its image tokens expect them
(:mod:`dash_trt.documents.views`): tiles row by row with ``image_newline`` after each row of the
grid, then the global view likewise, then ``view_seperator``.

Resizing the position tables depends only on S, so :class:`ViewEncoder` does it once for a view
size; the forward pass is then plain tensor algebra, the same in eager PyTorch and in the
exported ONNX graph (:func:`dash_trt.export.export_vision`). :meth:`VisionTower.encode_pages`
runs the views of many pages through it in batches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DeepEncoderConfig",
    "VisionTower",
    "ViewEncoder",
    "assemble_page",
    "tiny_deepencoder",
]


@dataclass(frozen=True)
class DeepEncoderConfig:
    """The tower's sizes: DeepSeek-OCR's (fixed in vLLM's code) unless the checkpoint's
    ``vision_config.deepencoder`` overrides them (the tiny test checkpoints do)."""

    sam_width: int = 768
    sam_layers: int = 12
    sam_heads: int = 12
    sam_global_layers: tuple[int, ...] = (2, 5, 8, 11)
    sam_window: int = 14
    sam_image_size: int = 1024  #: the size SAM's position tables were trained at
    patch_size: int = 16
    sam_neck: int = 256
    sam_mid: int = 512
    clip_width: int = 1024
    clip_layers: int = 24
    clip_heads: int = 16
    clip_intermediate: int = 4096
    clip_grid: int = 16  #: CLIP's position grid (224 / 14)
    n_embed: int = 1280  #: the projector's output: the decoder's hidden size

    @classmethod
    def from_config(cls, config: Any) -> DeepEncoderConfig:
        get = config.get if hasattr(config, "get") else (lambda k, d=None: d)
        vision = get("vision_config", None)
        section = vision.get("deepencoder", {}) if isinstance(vision, Mapping) else {}
        projector = get("projector_config", None) or {}
        keys = {f.name: section[f.name] for f in fields(cls) if f.name in section}
        if "sam_global_layers" in keys:
            keys["sam_global_layers"] = tuple(keys["sam_global_layers"])
        if "n_embed" not in keys:
            keys["n_embed"] = int(projector.get("n_embed", get("hidden_size", cls.n_embed)))
        ptype = projector.get("projector_type", "linear")
        if ptype != "linear":
            raise ValueError(f"projector_config.projector_type is {ptype!r}; Unlimited-OCR-2's projector is 'linear'")
        want_in = keys.get("clip_width", cls.clip_width) * 2
        if projector.get("input_dim", want_in) != want_in:
            raise ValueError(
                f"projector_config.input_dim is {projector['input_dim']}; the tower gives {want_in} values "
                f"(CLIP's width plus SAM's last convolution's)"
            )
        return cls(**keys)


# ------------------------------------------------------------------------------ SAM
class LayerNorm2d(nn.Module):
    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).permute(0, 2, 3, 1)  # B, H, W, C


class SamAttention(nn.Module):
    def __init__(self, dim: int, heads: int, size: int):
        super().__init__()
        self.heads = heads
        head_dim = dim // heads
        self.scale = head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.rel_pos_h = nn.Parameter(torch.zeros(2 * size - 1, head_dim))
        self.rel_pos_w = nn.Parameter(torch.zeros(2 * size - 1, head_dim))

    def forward(self, x: torch.Tensor, rel_h_table: torch.Tensor, rel_w_table: torch.Tensor) -> torch.Tensor:
        """``x`` [B, H, W, C]; ``rel_*_table`` [H, H, head_dim] / [W, W, head_dim]: the relative
        position embedding of each (query row, key row) pair (:func:`rel_table`).

        SAM's ``softmax(q k^T * scale + rel_h + rel_w) v`` with the relative-position terms as
        SDPA's additive mask, so that a GPU runs a fused attention kernel (the scores never
        stored) instead of three passes over [B, heads, HW, HW]; the mask itself is that size."""
        b, h, w, _ = x.shape
        qkv = self.qkv(x).reshape(b, h * w, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # B, heads, HW, d
        rq = q.reshape(b, self.heads, h, w, -1)
        rel_h = torch.einsum("bnhwc,hkc->bnhwk", rq, rel_h_table)  # B, heads, H, W, H
        rel_w = torch.einsum("bnhwc,wkc->bnhwk", rq, rel_w_table)  # B, heads, H, W, W
        bias = (rel_h[..., :, None] + rel_w[..., None, :]).reshape(b, self.heads, h * w, h * w)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scale)
        out = out.view(b, self.heads, h, w, -1).permute(0, 2, 3, 1, 4).reshape(b, h, w, -1)
        return self.proj(out)


class SamMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.lin1 = nn.Linear(dim, hidden)
        self.lin2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(F.gelu(self.lin1(x)))


class SamBlock(nn.Module):
    def __init__(self, dim: int, heads: int, window: int, size: int):
        super().__init__()
        self.window = window  # 0: global attention
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = SamAttention(dim, heads, size if window == 0 else window)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = SamMLP(dim, dim * 4)

    def forward(self, x: torch.Tensor, rel_h: torch.Tensor, rel_w: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.norm1(x)
        if self.window:
            b, h, w, c = x.shape
            s = self.window
            ph, pw = (s - h % s) % s, (s - w % s) % s
            x = F.pad(x, (0, 0, 0, pw, 0, ph))
            hp, wp = h + ph, w + pw
            x = x.view(b, hp // s, s, wp // s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, s, s, c)
            x = self.attn(x, rel_h, rel_w)
            x = x.view(b, hp // s, wp // s, s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, c)
            x = x[:, :h, :w, :]
        else:
            x = self.attn(x, rel_h, rel_w)
        x = shortcut + x
        return x + self.mlp(self.norm2(x))


class SamEncoder(nn.Module):
    """``sam_model``: SAM-ViT-B's image encoder with DeepEncoder's two extra convolutions."""

    def __init__(self, c: DeepEncoderConfig):
        super().__init__()
        grid = c.sam_image_size // c.patch_size
        self.patch_embed = PatchEmbed(c.patch_size, c.sam_width)
        self.pos_embed = nn.Parameter(torch.zeros(1, grid, grid, c.sam_width))
        self.blocks = nn.ModuleList(
            SamBlock(c.sam_width, c.sam_heads, 0 if i in c.sam_global_layers else c.sam_window, grid)
            for i in range(c.sam_layers)
        )
        self.neck = nn.Sequential(
            nn.Conv2d(c.sam_width, c.sam_neck, kernel_size=1, bias=False),
            LayerNorm2d(c.sam_neck),
            nn.Conv2d(c.sam_neck, c.sam_neck, kernel_size=3, padding=1, bias=False),
            LayerNorm2d(c.sam_neck),
        )
        self.net_2 = nn.Conv2d(c.sam_neck, c.sam_mid, kernel_size=3, stride=2, padding=1, bias=False)
        self.net_3 = nn.Conv2d(c.sam_mid, c.clip_width, kernel_size=3, stride=2, padding=1, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rel: list[tuple[torch.Tensor, torch.Tensor]]):
        x = self.patch_embed(x) + pos
        for blk, (rh, rw) in zip(self.blocks, rel):
            x = blk(x, rh, rw)
        x = self.neck(x.permute(0, 3, 1, 2))
        return self.net_3(self.net_2(x))


# ------------------------------------------------------------------------------ CLIP
class ClipAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv_proj = nn.Linear(dim, dim * 3)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=(c // self.heads) ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, c))


class ClipMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        return self.fc2(x * torch.sigmoid(1.702 * x))  # quick GELU


class ClipLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.self_attn = ClipAttention(dim, heads)
        self.layer_norm1 = nn.LayerNorm(dim, eps=1e-5)
        self.mlp = ClipMLP(dim, hidden)
        self.layer_norm2 = nn.LayerNorm(dim, eps=1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEmbeddings(nn.Module):
    def __init__(self, c: DeepEncoderConfig):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.zeros(c.clip_width))
        # CLIP's own patch embedding: in the checkpoint, unused (SAM's features are the patches)
        self.patch_embedding = nn.Conv2d(3, c.clip_width, kernel_size=14, stride=14, bias=False)
        self.position_embedding = nn.Embedding(c.clip_grid * c.clip_grid + 1, c.clip_width)


class ClipTransformer(nn.Module):
    def __init__(self, c: DeepEncoderConfig):
        super().__init__()
        self.layers = nn.ModuleList(
            ClipLayer(c.clip_width, c.clip_heads, c.clip_intermediate) for _ in range(c.clip_layers)
        )


class ClipEncoder(nn.Module):
    """``vision_model``: CLIP-L's vision transformer taking SAM's features as its patches."""

    def __init__(self, c: DeepEncoderConfig):
        super().__init__()
        self.embeddings = ClipEmbeddings(c)
        self.pre_layrnorm = nn.LayerNorm(c.clip_width, eps=1e-5)  # the checkpoint's spelling
        self.transformer = ClipTransformer(c)

    def forward(self, patches: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = patches.flatten(2).transpose(1, 2)  # B, N, C
        cls = self.embeddings.class_embedding.expand(x.shape[0], 1, -1)
        x = self.pre_layrnorm(torch.cat([cls, x], dim=1) + pos)
        for layer in self.transformer.layers:
            x = layer(x)
        return x


class Projector(nn.Module):
    def __init__(self, c: DeepEncoderConfig):
        super().__init__()
        self.layers = nn.Linear(2 * c.clip_width, c.n_embed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


# ------------------------------------------------------------------------------ tables
def _resize_grid(table: torch.Tensor, size: int) -> torch.Tensor:
    """A [1, G, G, C] position table bicubic-resized (antialiased) to [1, size, size, C]."""
    if table.shape[1] == size:
        return table
    x = F.interpolate(
        table.permute(0, 3, 1, 2).float(), size=(size, size), mode="bicubic", antialias=True, align_corners=False
    )
    return x.permute(0, 2, 3, 1).to(table.dtype)


def rel_table(rel_pos: torch.Tensor, size: int) -> torch.Tensor:
    """[size, size, C]: the relative-position embedding of each (query, key) index pair along one
    axis (SAM's ``get_rel_pos`` for equal query and key sizes; a table trained for another size
    is linearly resized to ``2 * size - 1`` entries first)."""
    n = 2 * size - 1
    if rel_pos.shape[0] != n:
        x = F.interpolate(rel_pos.float().t().unsqueeze(0), size=n, mode="linear")
        rel_pos = x.squeeze(0).t().to(rel_pos.dtype)
    idx = torch.arange(size)[:, None] - torch.arange(size)[None, :] + (size - 1)
    return rel_pos[idx]


class VisionTower(nn.Module):
    """The tower's modules under the checkpoint's names (module docstring)."""

    checkpoint_prefix = "model."

    def __init__(self, config: DeepEncoderConfig):
        super().__init__()
        self.config = config
        self.sam_model = SamEncoder(config)
        self.vision_model = ClipEncoder(config)
        self.projector = Projector(config)
        self.image_newline = nn.Parameter(torch.zeros(config.n_embed))
        self.view_seperator = nn.Parameter(torch.zeros(config.n_embed))  # the checkpoint's spelling
        self._encoders: dict[int, ViewEncoder] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.image_newline.dtype

    @property
    def device(self) -> torch.device:
        return self.image_newline.device

    def views(self, size: int) -> ViewEncoder:
        """The encoder of ``size`` x ``size`` views (its resized tables made once, then kept)."""
        enc = self._encoders.get(size)
        if enc is None or enc.stale():
            enc = self._encoders[size] = ViewEncoder(self, size)
        return enc

    def encode(self, views: torch.Tensor) -> torch.Tensor:
        """Features [B, (S/64)^2, n_embed] of views [B, 3, S, S]."""
        # moved first, then cast: a bf16 tower's cast runs on its device, not on the host's CPU
        return self.views(views.shape[-1])(views.to(self.device).to(self.dtype))

    @torch.no_grad()
    def encode_pages(self, pages: Sequence[Any], max_batch: int = 8) -> list[torch.Tensor]:
        """Each page's image-token features [N, n_embed] (:func:`assemble_page`'s layout; the
        tower's dtype and device) from its views: objects with a
        :class:`~dash_trt.documents.views.PageViews`' ``global_view`` [3, S, S], ``crops`` [C, 3,
        s, s] and ``grid`` (columns, rows).

        The views of all the pages go through the tower together, at most ``max_batch`` of one
        size a pass (the global views, then the tiles): one page's views alone are a batch of one
        global view and a few tiles, too little work to keep a GPU busy. ``max_batch`` bounds the
        memory: a global SAM block's attention mask is heads x (S/16)^4 values a view, 200M for
        S = 1024. A view's features do not depend on the other views in its batch."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        pages = list(pages)
        views = [torch.as_tensor(p.global_view) for p in pages]
        tiles: list[tuple[int, int]] = []  # each page's tiles in ``views``: (first, count)
        for p in pages:
            cols, rows = p.grid
            crops = torch.as_tensor(p.crops) if cols * rows > 1 else None
            if crops is not None and crops.shape[0] != cols * rows:
                raise ValueError(f"a page of {cols} x {rows} tiles has {crops.shape[0]} crops")
            tiles.append((len(views), 0 if crops is None else cols * rows))
            if crops is not None:
                views.extend(crops.unbind(0))
        feats = self._encode_views(views, max_batch)
        out = []
        for i, (p, (first, n)) in enumerate(zip(pages, tiles)):
            t = torch.stack(feats[first : first + n]) if n else None
            out.append(assemble_page(feats[i], t, p.grid, self.image_newline, self.view_seperator))
        return out

    def _encode_views(self, views: Sequence[torch.Tensor], max_batch: int) -> list[torch.Tensor]:
        """Each view's features [(S/64)^2, n_embed], in order: the views grouped by size (a batch
        is one size), each group in batches of at most ``max_batch``."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, v in enumerate(views):
            groups.setdefault(tuple(v.shape), []).append(i)
        out: list[torch.Tensor] = [None] * len(views)  # type: ignore[list-item]
        for idx in groups.values():
            for start in range(0, len(idx), max_batch):
                batch = idx[start : start + max_batch]
                for i, f in zip(batch, self.encode(torch.stack([views[i] for i in batch])).unbind(0)):
                    out[i] = f
        return out

    def page_features(self, global_view, crops, grid: tuple[int, int]) -> torch.Tensor:
        """One page's image-token features [N, n_embed] from its views (a
        :class:`~dash_trt.documents.views.PageViews`' arrays: [3, S, S] and [C, 3, s, s]):
        :meth:`encode_pages` of that one page."""
        return self.encode_pages([SimpleNamespace(global_view=global_view, crops=crops, grid=grid)])[0]


class ViewEncoder(nn.Module):
    """The tower for views of one size: the position and relative-position tables resized once,
    the forward pass plain tensor algebra (what the ONNX export traces)."""

    def __init__(self, tower: VisionTower, size: int):
        super().__init__()
        c = tower.config
        if size % c.patch_size:
            raise ValueError(f"a view must be a multiple of {c.patch_size} pixels a side, got {size}")
        self.tower = tower  # a submodule here; the tower keeps its encoders in a plain dict
        self.size = size
        grid = size // c.patch_size
        out = math.ceil(math.ceil(grid / 2) / 2)  # after the two stride-2 convolutions
        with torch.no_grad():
            sam = tower.sam_model
            self.register_buffer("sam_pos", _resize_grid(sam.pos_embed.detach(), grid), persistent=False)
            self._rel_h, self._rel_w = [], []
            for i, blk in enumerate(sam.blocks):
                s = grid if blk.window == 0 else blk.window
                self.register_buffer(f"rel_h{i}", rel_table(blk.attn.rel_pos_h.detach(), s), persistent=False)
                self.register_buffer(f"rel_w{i}", rel_table(blk.attn.rel_pos_w.detach(), s), persistent=False)
            pos = tower.vision_model.embeddings.position_embedding.weight.detach()
            cls, patch = pos[:1], pos[1:].view(1, c.clip_grid, c.clip_grid, -1)
            patch = _resize_grid(patch, out).reshape(out * out, -1)
            self.register_buffer("clip_pos", torch.cat([cls, patch]).unsqueeze(0), persistent=False)
        self._versions = self._weight_versions()
        self.tokens = out * out

    def _weight_versions(self) -> tuple[int, ...]:
        t = self.tower
        params = [t.sam_model.pos_embed, t.vision_model.embeddings.position_embedding.weight]
        params += [p for b in t.sam_model.blocks for p in (b.attn.rel_pos_h, b.attn.rel_pos_w)]
        return tuple(p._version for p in params) + tuple(p.data_ptr() for p in params)

    def stale(self) -> bool:
        """The tower's tables changed (new weights loaded) since these were made."""
        return self._weight_versions() != self._versions

    def forward(self, views: torch.Tensor) -> torch.Tensor:
        t = self.tower
        rel = [(getattr(self, f"rel_h{i}"), getattr(self, f"rel_w{i}")) for i in range(len(t.sam_model.blocks))]
        sam = t.sam_model(views, self.sam_pos, rel)  # B, C, h, w
        clip = t.vision_model(sam, self.clip_pos)
        features = torch.cat([clip[:, 1:], sam.flatten(2).transpose(1, 2)], dim=-1)
        return t.projector(features)


def assemble_page(
    global_features: torch.Tensor,
    tile_features: torch.Tensor | None,
    grid: tuple[int, int],
    newline: torch.Tensor,
    separator: torch.Tensor,
) -> torch.Tensor:
    """One page's image-token features [N, D]: the tiles ([columns x rows, q^2, D], row by row) as
    one grid with ``newline`` after each feature row, the global view ([qb^2, D]) likewise, then
    ``separator`` (vLLM's ``_pixel_values_to_embedding``)."""
    d = global_features.shape[-1]
    qb = math.isqrt(global_features.shape[0])
    g = torch.cat([global_features.view(qb, qb, d), newline.view(1, 1, d).expand(qb, 1, d)], dim=1).reshape(-1, d)
    parts = []
    cols, rows = grid
    if tile_features is not None and cols * rows > 1:
        q = math.isqrt(tile_features.shape[1])
        t = tile_features.view(rows, cols, q, q, d).permute(0, 2, 1, 3, 4).reshape(rows * q, cols * q, d)
        t = torch.cat([t, newline.view(1, 1, d).expand(rows * q, 1, d)], dim=1).reshape(-1, d)
        parts.append(t)
    parts += [g, separator.view(1, d)]
    return torch.cat(parts)


#: The vision tower's parts in a checkpoint (names after the ``model.`` prefix).
TOWER_PREFIXES = ("sam_model.", "vision_model.", "projector.", "image_newline", "view_seperator")


def tower_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tower's tensors of a checkpoint's state dict, under the tower's names: ``model.`` taken
    off; CLIP's attention as one ``qkv_proj`` (a checkpoint that stores ``q_proj``, ``k_proj`` and
    ``v_proj`` apart has them concatenated, as vLLM's loader stacks them); ``position_ids`` (a
    constant) dropped."""
    out: dict[str, torch.Tensor] = {}
    split: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        local = name[len("model.") :] if name.startswith("model.") else name
        if not local.startswith(TOWER_PREFIXES) or local.endswith("embeddings.position_ids"):
            continue
        for part in ("q_proj", "k_proj", "v_proj"):
            if f".self_attn.{part}." in local:
                key = local.replace(f".{part}.", ".qkv_proj.")
                split.setdefault(key, {})[part] = t
                break
        else:
            out[local] = t
    for key, parts in split.items():
        if set(parts) != {"q_proj", "k_proj", "v_proj"}:
            raise ValueError(f"{key}: the checkpoint stores {sorted(parts)} of q_proj, k_proj, v_proj")
        out[key] = torch.cat([parts["q_proj"], parts["k_proj"], parts["v_proj"]])
    return out


def tiny_deepencoder(n_embed: int) -> dict[str, Any]:
    """``vision_config.deepencoder`` of the tiny test checkpoints: a small tower and small views
    (global 256, tiles 160: 4 x 5 + 1 and 3 x 3 features), every mechanism of the real one."""
    return {
        "sam_width": 32,
        "sam_layers": 3,
        "sam_heads": 2,
        "sam_global_layers": [1],
        "sam_window": 7,
        "sam_image_size": 256,
        "sam_neck": 16,
        "sam_mid": 24,
        "clip_width": 32,
        "clip_layers": 2,
        "clip_heads": 2,
        "clip_intermediate": 64,
        "clip_grid": 4,
        "n_embed": n_embed,
        "base_size": 256,
        "image_size": 160,
        "max_crops": 6,
    }
