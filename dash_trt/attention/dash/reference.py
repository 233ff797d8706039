"""The PyTorch reference of DASH attention: the function every backend computes.

The function is the DASH attention of Baidu's Unlimited-OCR-2, as vLLM 0.34.0 ships it
(``vllm/model_executor/layers/dash_attention.py``, its ``backend="TRITON_ATTN"`` path; not
part of this repository, and never imported): page coordinates, page RoPE, block summaries,
Unlimited-OCR-2's routing (own-page candidates, top 16, entmax-1.5 prior, keep K, a
centred log-prior bias) and one float32 softmax, result for result (docs/spec.md). It is
vectorised over a chunk of queries and grouped by KV head (GQA) instead of repeating keys
per query head, and the chunk is bounded by a memory budget so long prefills stay within a
fixed temporary size. Chunking never changes the output (docs/spec.md, property 1).

The building blocks (:func:`block_summaries`, :func:`routing_scores`,
:func:`route_blocks`, :func:`sparse_attend`) are shared with the paged operator in
:mod:`dash_trt.attention.dash.paged`, so the two differ only in where keys come from.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .config import ROUTE_TOP_M, DashConfig, as_config

__all__ = [
    "page_coordinates",
    "page_rope",
    "prompt_page_positions",
    "route_blocks",
    "entmax15",
    "dash_attention",
    "block_summaries",
    "routing_scores",
    "sparse_attend",
    "query_chunk_size",
    "Routing",
    "ROLE_TEXT",
    "ROLE_IMAGE",
    "ROLE_PAGE",
    "SCORE_CLAMP",
    "NOT_REMOTE",
    "NOT_CANDIDATE",
]

#: Token roles (docs/spec.md, "Words").
ROLE_TEXT, ROLE_IMAGE, ROLE_PAGE = 0, 1, 2

# NOTE: numerics shared by every backend. Indexer logits and block scores are
# clamped to +-1e4 so that exp() and top-k stay finite; blocks a query may not read
# get exactly -1e9, which route_blocks recognises as "not remote" (< -1e8); routing
# values of blocks a query may not select are -1e4 (they still fill the top 16 when
# fewer blocks can be selected, with no prior mass).
SCORE_CLAMP = 1e4
NOT_REMOTE = -1e9
REMOTE_THRESHOLD = -1e8
#: Routing value of a block a query may not select (not a candidate, or not remote).
NOT_CANDIDATE = -1e4

#: Bytes of gathered keys/values/logits one query chunk may hold (float32).
_CHUNK_BUDGET_BYTES = 256 << 20

SpLike = DashConfig | Mapping[str, Any]


# --------------------------------------------------------------------- coordinates
def page_coordinates(
    roles: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token/page RoPE coordinates and image/query page ids of a whole sequence.

    ``roles`` [S] (text=0, image=1, ``<PAGE>``=2) must cover the entire prompt:
    tokens after the prompt's last image token are the response, whose ``<PAGE>``
    markers restart the page numbering. Returns four int64 tensors of shape [S]:
    ``tok`` (token coordinate), ``page`` (page coordinate, 0..num_pages),
    ``image_page`` (0-based page of an image token, -1 otherwise) and
    ``query_page`` (0-based page whose image blocks a query prefers; -1 for none).
    """
    if not isinstance(roles, torch.Tensor) or roles.ndim != 1:
        raise ValueError(f"roles must be a 1-D tensor [S], got {_describe(roles)}")
    if roles.dtype.is_floating_point or roles.dtype == torch.bool:
        raise ValueError(f"roles must be an integer tensor, got dtype {roles.dtype}")
    if roles.numel() and bool(((roles < 0) | (roles > 2)).any()):
        bad = roles[(roles < 0) | (roles > 2)][:5].tolist()
        raise ValueError(f"roles must be 0 (text), 1 (image) or 2 (<PAGE>), found {bad}")
    roles = roles.long()
    image = roles == ROLE_IMAGE
    marker = roles == ROLE_PAGE
    ar = torch.arange(roles.numel(), device=roles.device)
    last_image = int(torch.where(image, ar, -1).max().item()) if roles.numel() else -1
    cum = marker.long().cumsum(0)
    if last_image < 0 or int(cum[last_image]) == 0:
        raise ValueError(
            "DASH attention needs every document page as a <PAGE> marker followed by its "
            "image tokens; this sequence has "
            + ("no image token" if last_image < 0 else "no <PAGE> marker before its image tokens")
        )
    early = image & (cum == 0)
    if bool(early.any()):
        first = int(torch.nonzero(early)[0])
        raise ValueError(
            f"image token at position {first} comes before the first <PAGE> marker: every image token "
            f"must belong to a document page (<PAGE> followed by its image tokens)"
        )
    num_pages = cum[last_image]
    prefill = ar <= last_image
    raw_page = torch.where(prefill, cum, cum - num_pages).clamp(min=0)
    # Response tokens after the final page keep the final page coordinate.
    page = raw_page.clamp(max=num_pages)
    prompt_counts = torch.zeros(int(num_pages) + 1, device=roles.device, dtype=torch.long)
    prompt_counts.scatter_add_(0, page, prefill.long())
    starts = torch.cat((torch.ones_like(page[:1], dtype=torch.bool), page[1:] != page[:-1]))
    run_start = torch.where(starts, ar, 0).cummax(0).values
    tok = ar - run_start + torch.where(prefill, 0, prompt_counts[page])
    # A response marker past the final page restarts that page at its prompt offset.
    last_marker = torch.where(marker & ~prefill, ar, 0).cummax(0).values
    tok = torch.where(raw_page > num_pages, prompt_counts[page] + ar - last_marker, tok)
    image_page = torch.where(image, cum - 1, -1)
    query_page = torch.where(prefill, cum - 1, cum - num_pages - 1)
    return tok, page, image_page, query_page


def page_rope(x: torch.Tensor, tok: torch.Tensor, page: torch.Tensor, sp: SpLike, *, main: bool) -> torch.Tensor:
    """Non-interleaved RoPE whose last ``sparse_rope_page_pairs`` frequency pairs
    rotate by the page coordinate and the others by the token coordinate.

    ``x`` [S, ..., dim]; ``tok``/``page`` [S]. ``main`` selects the q/k frequency
    mode (``sparse_main_rope_tok_freq_mode``) rather than the indexer's. The rotation
    is computed in ``x.dtype`` (cos/sin rounded to it), as the reference does.
    """
    cfg = as_config(sp)
    dim = x.shape[-1]
    cfg.check_head_dim(dim, "RoPE dim")
    pairs = cfg.sparse_rope_page_pairs
    ntok = dim // 2 - pairs
    mode = cfg.sparse_main_rope_tok_freq_mode if main else cfg.sparse_rope_tok_freq_mode
    exponent = torch.arange(ntok, device=x.device).float()
    exponent = exponent / (dim / 2 if mode == "truncate" else ntok)
    inv_tok = 1.0 / (float(cfg.sparse_rope_tok_theta) ** exponent)
    inv_page = 1.0 / (float(cfg.sparse_rope_page_theta) ** (torch.arange(pairs, device=x.device).float() / pairs))
    if cfg.sparse_rope_page_mod > 0:
        page = page % cfg.sparse_rope_page_mod
    angles = torch.cat((tok.float()[:, None] * inv_tok, page.float()[:, None] * inv_page), -1)
    phase = torch.cat((angles, angles), -1)
    cos, sin = phase.cos().to(x.dtype), phase.sin().to(x.dtype)
    while cos.ndim < x.ndim:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    a, b = x.chunk(2, -1)
    return x * cos + torch.cat((-b, a), -1) * sin


def prompt_page_positions(input_tokens: list[int], sp: SpLike) -> torch.Tensor:
    """[4, S] int64 rows: token offsets, one-based routing pages, page count and
    negative prompt lengths (vLLM's packed positions for a prompt).

    Routing pages are one-based and unbounded; attention clamps them for RoPE.
    Negative lengths tell recomputed positions from ordinary decode positions.
    """
    cfg = as_config(sp)
    if cfg.image_token_id is None or cfg.page_token_id is None:
        raise ValueError("prompt_page_positions needs image_token_id and page_token_id in the config")
    ids = torch.as_tensor(list(input_tokens), dtype=torch.long)
    roles = (ids == cfg.image_token_id).long()
    roles += 2 * (ids == cfg.page_token_id).long()
    tok, page, _, query_page = page_coordinates(roles)
    last_image = torch.where(roles == ROLE_IMAGE)[0][-1]
    prefill = torch.arange(len(ids)) <= last_image
    pages = int(page.max())
    counts = torch.zeros(pages + 1, dtype=torch.long)
    counts.scatter_add_(0, page, prefill.long())
    return torch.stack((tok, query_page + 1, torch.full_like(tok, pages), -counts[page] - 1))


# ------------------------------------------------------------------------ routing
def block_summaries(index_keys: torch.Tensor, real: torch.Tensor, head_cls: torch.Tensor) -> torch.Tensor:
    """Summaries of sparse blocks: the ``head_cls``-softmax-weighted mean of their
    (RoPE'd, float32, finite) index keys.

    ``index_keys`` [n, bs, Di] float32, ``real`` [n, bs] bool (tokens that count),
    ``head_cls`` [Di]. Returns [n, Di] float32.

    NOTE: this is the reference's formula to the letter, including its edge case:
    tokens that do not count still enter ``exp(logit - max)`` before being zeroed, so
    if such a token's logit exceeds the counted maximum by more than ~88 the product
    is ``inf * 0 = nan`` and the whole summary becomes 0.
    """
    inv_sqrt = 1.0 / math.sqrt(index_keys.shape[-1])
    logits = ((index_keys * head_cls.float()).sum(-1) * inv_sqrt).clamp(-SCORE_CLAMP, SCORE_CLAMP)
    row_max = logits.masked_fill(~real, torch.finfo(logits.dtype).min).amax(-1, keepdim=True)
    exp = (logits - row_max).exp() * real
    weights = exp / exp.sum(-1, keepdim=True).clamp(min=1e-6)
    return torch.nan_to_num((weights[:, :, None] * index_keys).sum(1), nan=0.0, posinf=0.0, neginf=0.0)


def routing_scores(
    iq: torch.Tensor,
    summary: torch.Tensor,
    pos: torch.Tensor,
    cfg: DashConfig,
    prompt_length: int | None,
) -> torch.Tensor:
    """Block scores [c, N] float32 for queries at positions ``pos`` [c].

    ``iq`` [c, Di] float32 (RoPE'd, finite), ``summary`` [N, Di] float32. Blocks a
    query may not read remotely (inside or after its local window, or past the
    prompt) get exactly :data:`NOT_REMOTE`.
    """
    inv_sqrt = 1.0 / math.sqrt(iq.shape[-1])
    scores = (iq @ summary.T * inv_sqrt).clamp(-SCORE_CLAMP, SCORE_CLAMP)
    block_ids = torch.arange(summary.shape[0], device=iq.device)
    bs = cfg.sparse_block_size
    remote = block_ids[None] <= pos[:, None] // bs - cfg.sparse_local_block
    if prompt_length is not None:
        remote &= block_ids[None] * bs < prompt_length
    return scores.masked_fill(~remote, NOT_REMOTE)


def entmax15(x: torch.Tensor) -> torch.Tensor:
    """entmax with alpha = 1.5 over the last dim: ``p_i = max(x_i / 2 - tau, 0) ** 2`` with
    ``tau`` such that the ``p`` sum to 1 (float32 in, float32 out).

    ``tau`` in closed form over the values sorted descending: for each support size ``r``,
    ``tau_r = mean_r - sqrt(max((1 - r * var_r) / r, 0))`` (mean and variance of the ``r``
    largest halved values); the support is the number of ``r`` with ``tau_r <= x_(r) / 2``.
    The values are first shifted by their maximum, so a row of -1e4 entries is as good as
    any other (equal values share the mass equally).
    """
    z = (x - x.amax(-1, keepdim=True)) / 2
    ordered = z.sort(-1, descending=True).values
    rank = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=z.dtype)
    mean = ordered.cumsum(-1) / rank
    mean_sq = ordered.square().cumsum(-1) / rank
    gap = ((1 - rank * (mean_sq - mean.square())) / rank).clamp(min=0)
    tau = mean - gap.sqrt()
    support = (tau <= ordered).sum(-1, keepdim=True).clamp(min=1)
    return (z - tau.gather(-1, support - 1)).clamp(min=0).square()


def route_blocks(
    scores: torch.Tensor, candidate: torch.Tensor, sp: SpLike, layer_idx: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unlimited-OCR-2's block routing (docs/spec.md step 4).

    ``scores`` [Q, N] float32 (clamped, non-remote blocks at -1e9), ``candidate``
    [Q, N] bool (block holds an image token of the query's page). Returns ``selected``
    [Q, K] int64, ``bias`` [Q, K] float32 and ``valid`` [Q, K] bool, with ``M = min(16, N)``
    and ``K = min(dash_topk_blocks, M)``: the K best of the top M by routing value, their
    centred log entmax prior over sigma as the bias of their keys. Ties go to the lower
    block index.
    """
    selected, bias, valid, _ = _route(scores, candidate, as_config(sp), layer_idx)
    return selected, bias, valid


def _route(scores: torch.Tensor, candidate: torch.Tensor, cfg: DashConfig, layer_idx: int):
    """:func:`route_blocks`, also returning the routing values x [Q, N]."""
    if scores.ndim != 2 or candidate.shape != scores.shape:
        raise ValueError(
            f"scores and candidate must both be [Q, N], got {tuple(scores.shape)} and {tuple(candidate.shape)}"
        )
    r = cfg.routing(layer_idx)
    remote = scores > REMOTE_THRESHOLD
    own_page = candidate & remote
    # Candidates restrict: a query whose page has a remote image block reads only those;
    # one whose page has none (response text, a page still local) competes over all.
    cand = torch.where(own_page.any(-1, keepdim=True), own_page, remote)
    x = torch.where(cand, scores * (r.scale / math.sqrt(cfg.sparse_index_dim)), NOT_CANDIDATE)
    x = torch.nan_to_num(x, nan=NOT_CANDIDATE, posinf=NOT_CANDIDATE, neginf=NOT_CANDIDATE)
    m = min(ROUTE_TOP_M, x.shape[-1])
    values, order = torch.sort(x, dim=-1, descending=True, stable=True)
    prior = entmax15(values[:, :m])
    k = min(r.topk, m)
    selected, prior = order[:, :k], prior[:, :k]
    valid = cand.gather(-1, selected)
    # NOTE: the floor keeps log() finite for blocks of the top K that entmax gave no mass;
    # centred over the valid blocks, so one valid block gets bias 0.
    logp = prior.clamp(min=r.floor).log()
    mean = torch.where(valid, logp, 0).sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)
    bias = torch.where(valid, (logp - mean) / r.sigma, 0)
    return selected, bias, valid, x


# ---------------------------------------------------------------------- attention
def sparse_attend(
    q: torch.Tensor,
    pos: torch.Tensor,
    selected: torch.Tensor,
    bias: torch.Tensor,
    valid: torch.Tensor,
    gather_kv: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    length: int,
    prompt_length: int | None,
    cfg: DashConfig,
) -> torch.Tensor:
    """Attention of a query chunk over its selected blocks plus its local window.

    ``q`` [c, H, D] (RoPE'd), ``pos`` [c] positions, ``selected``/``bias``/``valid``
    [c, K] from :func:`route_blocks`; ``gather_kv(indices [c, M])`` returns keys and
    values [c, M, Hkv, D] at those sequence positions. Returns [c, H, D] float32.
    Local tokens win where a selected block overlaps the window (no double count).
    """
    bs, local = cfg.sparse_block_size, cfg.local_window
    device = q.device
    c, nh, hd = q.shape
    offsets = torch.arange(bs, device=device)
    remote_pos = (selected[:, :, None] * bs + offsets).flatten(1)
    rbias = bias.repeat_interleave(bs, -1)
    rvalid = valid.repeat_interleave(bs, -1)
    rvalid &= (remote_pos <= pos[:, None] - local) & (remote_pos < length)
    if prompt_length is not None:
        rvalid &= remote_pos < prompt_length
    lpos = pos[:, None] - local + 1 + torch.arange(local, device=device)
    indices = torch.cat((remote_pos, lpos), -1).clamp(0, length - 1)
    keep = torch.cat((rvalid, lpos >= 0), -1)
    additive = torch.cat((rbias, torch.zeros_like(lpos, dtype=torch.float32)), -1)
    keys, values = gather_kv(indices)
    hkv = keys.shape[2]
    group = nh // hkv
    # GQA: query head h reads KV head h // group; group the query heads instead of
    # repeating the keys.
    qg = q.float().view(c, hkv, group, hd)
    logits = torch.einsum("ckgd,cmkd->ckgm", qg, keys.float())
    logits = logits * (1.0 / math.sqrt(hd)) + additive[:, None, None]
    # NOTE: fp32 softmax; masked keys are -inf, the local window always holds the
    # query itself so no row is empty.
    probs = logits.masked_fill(~keep[:, None, None], -torch.inf).softmax(-1)
    out = torch.einsum("ckgm,cmkd->ckgd", probs, values.float())
    return out.reshape(c, nh, hd)


def query_chunk_size(cfg: DashConfig, keys_per_query: int, num_heads: int, kv_heads: int, dim: int) -> int:
    """Queries per chunk: ``dash_query_chunk``, lowered so the gathered float32
    keys, values and logits of one chunk fit a fixed budget."""
    per_query = 4 * keys_per_query * (2 * kv_heads * dim + 2 * num_heads)
    return max(1, min(cfg.dash_query_chunk, _CHUNK_BUDGET_BYTES // max(per_query, 1)))


def routed_width(cfg: DashConfig, layer_idx: int, num_blocks: int) -> int:
    """K of a sequence of ``num_blocks`` sparse blocks: ``min(dash_topk_blocks, 16, N)``."""
    return min(cfg.routing(layer_idx).topk, ROUTE_TOP_M, num_blocks)


@dataclass
class Routing:
    """What routing chose, for comparing implementations (docs/spec.md, "Comparing").

    ``selected`` [T, K] int64: the valid selected blocks, -1 padded (K the widest row);
    ``bias`` [T, K] float32: their bias (0 at the padding); ``values`` [T, N] float32: every
    block's routing value x (-1e4 where the token may not select it); ``scores`` [T, N]
    float32: every block's score (-1e9 if not remote); N the largest block count in the
    batch. An implementation that reports only its selection leaves the others None.
    """

    selected: torch.Tensor
    bias: torch.Tensor | None = None
    values: torch.Tensor | None = None
    scores: torch.Tensor | None = None


def route_chunk(
    iq: torch.Tensor,
    summary: torch.Tensor,
    pos: torch.Tensor,
    candidate: torch.Tensor,
    cfg: DashConfig,
    layer_idx: int,
    prompt_length: int | None,
):
    """One chunk of queries routed (shared by the reference and the paged operator): scores
    [c, N], then ``(scores, selected, bias, valid, values)``."""
    scores = routing_scores(iq, summary, pos, cfg, prompt_length)
    selected, bias, valid, values = _route(scores, candidate, cfg, layer_idx)
    return scores, selected, bias, valid, values


def routing_rows(scores, selected, bias, valid, values, width: int):
    """One chunk's routing rows, padded to ``width`` blocks (for :class:`Routing`)."""
    c = scores.shape[0]
    sel = torch.where(valid, selected, torch.full_like(selected, -1))
    bias = torch.where(valid, bias, 0.0)
    padded_scores = torch.full((c, width), NOT_REMOTE, dtype=torch.float32, device=scores.device)
    padded_scores[:, : scores.shape[1]] = scores
    padded_values = torch.full((c, width), NOT_CANDIDATE, dtype=torch.float32, device=scores.device)
    padded_values[:, : values.shape[1]] = values
    return sel, bias, padded_values, padded_scores


def stack_routing(parts, k_width: int) -> Routing:
    """The chunks' :func:`routing_rows` as one :class:`Routing`, padded to ``k_width``."""
    sel = torch.cat([F.pad(p[0], (0, k_width - p[0].shape[1]), value=-1) for p in parts])
    bias = torch.cat([F.pad(p[1], (0, k_width - p[1].shape[1]), value=0.0) for p in parts])
    return Routing(sel, bias, torch.cat([p[2] for p in parts]), torch.cat([p[3] for p in parts]))


def dash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    iq: torch.Tensor,
    ik: torch.Tensor,
    roles: torch.Tensor,
    head_cls: torch.Tensor,
    sp: SpLike,
    layer_idx: int,
    prompt_length: int | None = None,
    backend: str = "TRITON_ATTN",
    *,
    return_routing: bool = False,
):
    """Attend the query suffix ``q`` [Q, H, D] against keys/values [S, Hkv, D].

    ``iq`` [Q, Di] and ``ik`` [S, Di] are the indexer's query and keys, ``roles``
    [S] the token roles of the whole sequence, ``head_cls`` [Di] the indexer's
    class vector. The queries are the last Q positions. ``prompt_length`` limits
    remote reads (and block summaries) to the first ``prompt_length`` tokens.
    Returns [Q, H, D] in ``q.dtype`` (and a :class:`Routing` if asked).
    """
    if backend != "TRITON_ATTN":
        raise ValueError(
            f"backend {backend!r}: the reference computes the TRITON_ATTN definition only; "
            "use the paged operator or the CUDA kernels for speed"
        )
    cfg = as_config(sp)
    _check_dense_inputs(q, k, v, iq, ik, roles, head_cls, cfg, prompt_length)
    length, dim = ik.shape
    nq = q.shape[0]
    bs = cfg.sparse_block_size
    nblk = (length + bs - 1) // bs
    tok, page, image_page, query_page = page_coordinates(roles)
    q = page_rope(q, tok[-nq:], page[-nq:], cfg, main=True)
    k = page_rope(k, tok, page, cfg, main=True)
    iq = torch.nan_to_num(
        page_rope(iq, tok[-nq:], page[-nq:], cfg, main=False).float(), nan=0.0, posinf=0.0, neginf=0.0
    )
    ik = torch.nan_to_num(page_rope(ik, tok, page, cfg, main=False).float(), nan=0.0, posinf=0.0, neginf=0.0)
    padded = nblk * bs
    kk = F.pad(ik, (0, 0, 0, padded - length)).view(nblk, bs, dim)
    token_ids = torch.arange(padded, device=q.device).view(nblk, bs)
    real = token_ids < length
    if prompt_length is not None:
        real &= token_ids < prompt_length
    summary = block_summaries(kk, real, head_cls)
    image_blocks = F.pad(image_page, (0, padded - length), value=-1).view(nblk, bs)
    num_pages = int(image_page.max()) + 1
    membership = torch.zeros((nblk, num_pages + 1), dtype=torch.bool, device=q.device)
    membership.scatter_(1, image_blocks + 1, True)

    output = torch.empty_like(q)
    k_width = routed_width(cfg, layer_idx, nblk)
    chunk = query_chunk_size(cfg, k_width * bs + cfg.local_window, q.shape[1], k.shape[1], q.shape[2])
    parts = []
    for start in range(0, nq, chunk):
        end = min(start + chunk, nq)
        pos = torch.arange(length - nq + start, length - nq + end, device=q.device)
        qp = query_page[-nq:][start:end]
        candidate = membership.T[(qp + 1).clamp(0, num_pages)]
        candidate &= (qp[:, None] >= 0) & (qp[:, None] < num_pages)
        scores, selected, bias, valid, values = route_chunk(
            iq[start:end], summary, pos, candidate, cfg, layer_idx, prompt_length
        )
        out = sparse_attend(
            q[start:end],
            pos,
            selected,
            bias,
            valid,
            lambda idx: (k[idx], v[idx]),
            length,
            prompt_length,
            cfg,
        )
        output[start:end] = out.to(q.dtype)
        if return_routing:
            parts.append(routing_rows(scores, selected, bias, valid, values, nblk))
    if return_routing:
        return output, stack_routing(parts, k_width)
    return output


# --------------------------------------------------------------------- validation
def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"tensor of shape {list(t.shape)} and dtype {t.dtype}"
    return type(t).__name__


def check_shape(name: str, t: Any, shape: tuple, dtypes: tuple | None = None) -> None:
    """Raise ``ValueError`` unless ``t`` is a tensor of ``shape`` (``None`` = any size)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    ok = t.ndim == len(shape) and all(e is None or e == a for e, a in zip(shape, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_heads(cfg: DashConfig, q: torch.Tensor, k: torch.Tensor, iq: torch.Tensor) -> None:
    """Head counts and head dims shared by the reference and the paged operator."""
    nh, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or nh % hkv:
        raise ValueError(f"query heads ({nh}) must be a multiple of KV heads ({hkv}) for grouped-query attention")
    cfg.check_head_dim(q.shape[-1], "head dim D")
    cfg.check_index_dim(iq.shape[-1], "indexer dim Di")


def _check_dense_inputs(q, k, v, iq, ik, roles, head_cls, cfg, prompt_length) -> None:
    check_shape("q", q, (None, None, None), FLOAT_DTYPES)
    nq, nh, hd = q.shape
    check_shape("k", k, (None, None, hd), (q.dtype,))
    length, hkv = k.shape[0], k.shape[1]
    check_shape("v", v, (length, hkv, hd), (q.dtype,))
    check_shape("ik", ik, (length, None), FLOAT_DTYPES)
    check_shape("iq", iq, (nq, ik.shape[1]), FLOAT_DTYPES)
    check_shape("roles", roles, (length,))
    check_shape("head_cls", head_cls, (ik.shape[1],), FLOAT_DTYPES)
    if nq == 0 or nq > length:
        raise ValueError(f"need 1 <= queries ({nq}) <= keys ({length})")
    check_heads(cfg, q, k, iq)
    if prompt_length is not None and (isinstance(prompt_length, bool) or int(prompt_length) < 0):
        raise ValueError(f"prompt_length must be None or >= 0, got {prompt_length!r}")
