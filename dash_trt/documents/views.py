"""A page's views and image-token count, as DeepSeek-OCR's processor makes them for
Unlimited-OCR-2 (vLLM 0.34.0 ``transformers_utils/processors/deepseek_ocr.py`` with
``UnlimitedOCR2Processor``; strategy v1):

- the **global view**: the page scaled to fit ``base_size`` x ``base_size`` (aspect ratio kept)
  and padded with the normalisation mean's grey (``PIL.ImageOps.pad``, centred);
- in **crop mode**, a page larger than ``image_size`` on either side is also cut into tiles
  ("gundam"): the tile grid (w x h, from ``min_crops`` to ``max_crops`` tiles) whose aspect ratio
  is closest to the page's (on a tie, the larger grid when the page has more than half its
  pixels), the page resized to ``w * image_size`` x ``h * image_size`` and cut row by row;
- pixels as float32 ``(x / 255 - mean) / std`` in CHW order;
- **image tokens**: ``q_base * (q_base + 1) + 1`` for the global view (``q_base = ceil(base_size /
  patch / downsample)`` rows of ``q_base`` features and a newline each, then a view separator),
  plus ``(q * w + 1) * (q * h)`` for the tiles (``q = ceil(image_size / patch / downsample)``).

The features the vision tower produces for a page come in the same order and number
(:func:`dash_trt.models.deepencoder.assemble_page`): tiles row by row with a newline after each row
of the grid, the global view likewise, then the separator.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .pages import DocumentError

__all__ = ["ViewSpec", "PageViews", "page_views", "image_token_count", "tile_grid", "normalize"]


@dataclass(frozen=True)
class ViewSpec:
    """The processor's sizes. Defaults are Unlimited-OCR-2's (vLLM's ``BASE_SIZE``,
    ``IMAGE_SIZE``, 16 crops at most); a checkpoint may override them in
    ``vision_config.deepencoder`` (the tiny test checkpoints do)."""

    base_size: int = 1024
    image_size: int = 640
    patch_size: int = 16
    downsample_ratio: int = 4
    min_crops: int = 2
    max_crops: int = 16
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    #: image tokens a page may take (``None``: no limit but the model's context)
    max_page_tokens: int | None = field(default=None)

    def __post_init__(self) -> None:
        for name in ("base_size", "image_size", "patch_size", "downsample_ratio", "min_crops", "max_crops"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"view spec: {name} must be a positive integer, got {v!r}")
        if self.min_crops > self.max_crops:
            raise ValueError(f"view spec: min_crops {self.min_crops} > max_crops {self.max_crops}")

    @classmethod
    def from_config(cls, config: Any) -> ViewSpec:
        """From a model config (:class:`~dash_trt.models.config.DashModelConfig` or its dict):
        ``vision_config.deepencoder``'s keys of this class, else the defaults."""
        get = config.get if hasattr(config, "get") else (lambda k, d=None: d)
        vision = get("vision_config", None)
        section = vision.get("deepencoder", {}) if isinstance(vision, Mapping) else {}
        keys = {k: section[k] for k in cls.__dataclass_fields__ if k in section}
        for k in ("mean", "std"):
            if k in keys:
                keys[k] = tuple(float(x) for x in keys[k])
        return cls(**keys)

    @property
    def queries(self) -> int:
        """Feature rows (and columns) of a tile: ``ceil(image_size / patch / downsample)``."""
        return math.ceil(self.image_size / self.patch_size / self.downsample_ratio)

    @property
    def base_queries(self) -> int:
        return math.ceil(self.base_size / self.patch_size / self.downsample_ratio)

    @property
    def pad_color(self) -> tuple[int, int, int]:
        return tuple(int(x * 255) for x in self.mean)


def _target_ratios(spec: ViewSpec) -> list[tuple[int, int]]:
    ratios = {
        (i, j)
        for n in range(spec.min_crops, spec.max_crops + 1)
        for i in range(1, n + 1)
        for j in range(1, n + 1)
        if spec.min_crops <= i * j <= spec.max_crops
    }
    return sorted(ratios, key=lambda r: r[0] * r[1])  # stable: a set's order, as the processor's


def tile_grid(width: int, height: int, spec: ViewSpec) -> tuple[int, int]:
    """The (columns, rows) of tiles a page of ``width`` x ``height`` is cut into in crop mode:
    (1, 1) when it fits in one ``image_size`` tile."""
    if width <= spec.image_size and height <= spec.image_size:
        return (1, 1)
    aspect = width / height
    best, best_diff = (1, 1), float("inf")
    for ratio in _target_ratios(spec):
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best, best_diff = ratio, diff
        elif diff == best_diff and width * height > 0.5 * spec.image_size * spec.image_size * ratio[0] * ratio[1]:
            best = ratio
    return best


def image_token_count(width: int, height: int, spec: ViewSpec, crop: bool) -> int:
    """Image tokens of a page of ``width`` x ``height`` pixels (module docstring)."""
    qb = spec.base_queries
    n = qb * (qb + 1) + 1
    if crop:
        w, h = tile_grid(width, height, spec)
        if w > 1 or h > 1:
            q = spec.queries
            n += (q * w + 1) * (q * h)
    return n


@dataclass
class PageViews:
    """One page's views: ``global_view`` [3, base_size, base_size] and ``crops`` [C, 3,
    image_size, image_size] (float32, normalised), the tile ``grid`` (columns, rows; (1, 1)
    without tiles) and the page's ``num_tokens`` image tokens."""

    global_view: np.ndarray
    crops: np.ndarray
    grid: tuple[int, int]
    num_tokens: int


def normalize(image, spec: ViewSpec) -> np.ndarray:
    """A PIL RGB image as float32 CHW ``(x / 255 - mean) / std``."""
    x = np.asarray(image, dtype=np.float32) / 255.0
    x = (x - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def check_page_tokens(width: int, height: int, spec: ViewSpec, crop: bool, source: str = "page") -> int:
    """The image tokens of a ``width`` x ``height`` page; :class:`DocumentError` naming ``source``
    and the arithmetic when that is more than ``spec.max_page_tokens``."""
    n = image_token_count(width, height, spec, crop)
    if spec.max_page_tokens is not None and n > spec.max_page_tokens:
        w, h = tile_grid(width, height, spec) if crop else (1, 1)
        qb, q = spec.base_queries, spec.queries
        base = qb * (qb + 1) + 1
        # tiles can be avoided (crop mode off, a smaller page); the global view cannot: every page,
        # whatever its size, takes its tokens, so a limit below them refuses every page
        advice = (
            f"; every page takes at least the global view's {base}: allow at least that many"
            if base > spec.max_page_tokens
            else "; send the page without crop mode or smaller"
        )
        raise DocumentError(
            f"{source}: {width}x{height} pixels take {n} image tokens ({qb} x {qb + 1} + 1 for the global view"
            + (f" + ({q} x {w} + 1) x ({q} x {h}) for {w} x {h} tiles" if w * h > 1 else "")
            + f"), more than the {spec.max_page_tokens} a page may take"
            + advice
        )
    return n


def page_views(image, spec: ViewSpec, crop: bool, source: str = "page") -> PageViews:
    """The views of one RGB page image (module docstring). Raises :class:`DocumentError` naming
    ``source`` and the arithmetic when the page takes more than ``spec.max_page_tokens``."""
    from PIL import ImageOps

    width, height = image.size
    n = check_page_tokens(width, height, spec, crop, source)
    grid = (1, 1)
    crops = np.zeros((0, 3, spec.image_size, spec.image_size), dtype=np.float32)
    if crop:
        grid = tile_grid(width, height, spec)
        if grid != (1, 1):
            cols, rows = grid
            s = spec.image_size
            resized = image.resize((cols * s, rows * s))
            tiles = [resized.crop((c * s, r * s, (c + 1) * s, (r + 1) * s)) for r in range(rows) for c in range(cols)]
            crops = np.stack([normalize(t, spec) for t in tiles])
    view = ImageOps.pad(image, (spec.base_size, spec.base_size), color=spec.pad_color)
    return PageViews(normalize(view, spec), crops, grid, n)
