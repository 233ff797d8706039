"""Random DASH problems and the the comparison rule of docs/spec.md, shared by the tests, the
demo and the kernel checks.

Inputs are random and never zeros. Outputs are compared the way docs/spec.md asks:
routing is a top-k, so (a) each token's selected set must match the reference
except where the blocks that differ score within a small tolerance of each other,
and (b) attention outputs are compared on the tokens whose selection matched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .attention.dash.config import ROUTE_TOP_M, DashConfig
from .attention.dash.reference import NOT_CANDIDATE, ROLE_IMAGE, ROLE_PAGE, ROLE_TEXT, Routing

__all__ = [
    "TOLERANCES",
    "MAX_NEAR_TIE_SHARE",
    "random_roles",
    "random_config",
    "DashInputs",
    "random_inputs",
    "compare_outputs",
    "ComparisonReport",
]

#: Output tolerances (atol, rtol) against the float32 reference, by dtype.
#: fp32: the implementations sum in different orders. fp16/bf16: q/k are rotated
#: in the low precision dtype (as the reference does) and the output is rounded
#: once to it; one bf16 ulp at |x| ~ 1 is 2**-7.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

#: Routing values closer than this (relative) may order differently between implementations.
SCORE_TIE_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}

#: The routing's bias of a token's blocks, compared as the weights it gives them,
#: ``exp(bias - max bias)``: an error in a block's bias matters in proportion to its weight (a
#: block at the prior's floor may differ much in bias and not at all in the output). The weights
#: are as well conditioned as entmax over the routing values allows: in bfloat16, one-ulp changes
#: to 0.05-0.2% of the index queries' elements (as RoPE's cos/sin rounding may make) move some
#: token's weights by 3.4e-2 to 4.7e-2 on a 1,000-block decode case.
BIAS_WEIGHT_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def _bias_weight_error(routing: Routing, ref_routing: Routing, i: int) -> float:
    """The largest difference of token ``i``'s block weights ``exp(bias - max bias)`` between two
    routings that selected the same blocks."""

    def weights(r: Routing) -> dict[int, float]:
        pairs = [(int(b), float(x)) for b, x in zip(r.selected[i].tolist(), r.bias[i].tolist()) if b >= 0]
        top = max(x for _, x in pairs)
        return {b: math.exp(x - top) for b, x in pairs}

    got, want = weights(routing), weights(ref_routing)
    return max(abs(got[b] - want[b]) for b in want)


def random_roles(
    gen: torch.Generator,
    num_pages: int,
    *,
    max_images: int = 24,
    max_text: int = 6,
    prefix_text: int | None = None,
    response: int = 0,
    response_markers: int = 0,
) -> torch.Tensor:
    """Roles of a random document prompt followed by ``response`` response tokens.

    The prompt: optional leading text, then ``num_pages`` pages of ``<PAGE>``, 1 to
    ``max_images`` image tokens and 0 to ``max_text`` text tokens. The response is
    text with ``response_markers`` ``<PAGE>`` markers at random places.
    """
    if num_pages < 1:
        raise ValueError("a DASH prompt needs at least one page")

    def rint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    roles: list[int] = [ROLE_TEXT] * (rint(0, max_text) if prefix_text is None else prefix_text)
    for _ in range(num_pages):
        roles.append(ROLE_PAGE)
        roles += [ROLE_IMAGE] * rint(1, max_images)
        roles += [ROLE_TEXT] * rint(0, max_text)
    tail = [ROLE_TEXT] * response
    for _ in range(min(response_markers, response)):
        tail[rint(0, response - 1)] = ROLE_PAGE
    return torch.tensor(roles + tail, dtype=torch.long)


def random_config(gen: torch.Generator, *, index_dim: int = 16, **overrides) -> DashConfig:
    """A small random configuration that exercises every key (``sparse_index_dim`` =
    ``index_dim``, the width :func:`random_inputs` gives ``iq``/``ik``). Routing scales are kept
    small enough that random scores spread the prior over several blocks."""

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    sp = {
        "sparse_block_size": pick([4, 8, 16]),
        "sparse_local_block": pick([1, 2]),
        "sparse_index_dim": index_dim,
        "dash_topk_blocks": pick([1, 2, 3, 5, 12]),
        "dash_sigma": pick([1.0, 0.5, 2.0]),
        "dash_scaling_factor": pick([128.0, 16.0, 4.0]),
        "dash_prior_floor": pick([1e-4, 1e-2]),
        "sparse_rope_page_pairs": pick([1, 2]),
        "sparse_rope_tok_theta": pick([10000.0, 500.0]),
        "sparse_rope_page_theta": pick([256.0, 16.0]),
        "sparse_main_rope_tok_freq_mode": pick([None, "truncate"]),
        "sparse_rope_tok_freq_mode": pick([None, "truncate"]),
        "sparse_rope_page_mod": pick([0, 0, 3]),
        "dash_query_chunk": pick([1, 5, 2048]),
    }
    if pick([False, True]):  # per-layer lists (layers 0 and 1, both DASH layers)
        sp.update(
            sparse_attention_freq=[1, 1],
            dash_scale_per_layer=[pick([8.0, 64.0]), pick([2.0, 128.0])],
            dash_floor_per_layer=[pick([1e-4, 1e-3]), pick([1e-2, 1e-5])],
        )
    sp.update(overrides)
    return DashConfig.from_dict(sp)


@dataclass
class DashInputs:
    """One sequence's full DASH inputs (every position, unrotated)."""

    q: torch.Tensor  # [S, H, D]
    k: torch.Tensor  # [S, Hkv, D]
    v: torch.Tensor  # [S, Hkv, D]
    iq: torch.Tensor  # [S, Di]
    ik: torch.Tensor  # [S, Di]
    roles: torch.Tensor  # [S]
    head_cls: torch.Tensor  # [Di]
    prompt_length: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.roles.numel()


def random_inputs(
    gen: torch.Generator,
    roles: torch.Tensor,
    *,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    index_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    head_cls: torch.Tensor | None = None,
) -> DashInputs:
    """Random normal q/k/v/iq/ik for ``roles`` (shared ``head_cls`` if given)."""
    s = roles.numel()

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    hc = rnd(index_dim) if head_cls is None else head_cls
    return DashInputs(
        q=rnd(s, heads, head_dim),
        k=rnd(s, kv_heads, head_dim),
        v=rnd(s, kv_heads, head_dim),
        iq=rnd(s, index_dim),
        ik=rnd(s, index_dim),
        roles=roles.to(device),
        head_cls=hc,
    )


#: Near ties may excuse at most this share of a comparison's tokens (and always one): a result
#: whose selections differ from the reference on more tokens than that is wrong, however close
#: each swap's scores are.
MAX_NEAR_TIE_SHARE = 0.05


@dataclass
class ComparisonReport:
    tokens: int
    routing_mismatch: int  # tokens whose selection differs beyond a near-tie (or is malformed)
    near_ties: int  # tokens skipped for the output check because of a near-tie swap
    max_abs_err: float
    bad_tokens: list[int]
    max_near_ties: int = 0  # the bound on near_ties (MAX_NEAR_TIE_SHARE of the tokens, at least 1)
    problems: list[str] = field(default_factory=list)  # the first few tokens' routing mismatches, described

    @property
    def too_many_ties(self) -> bool:
        return self.near_ties > self.max_near_ties

    @property
    def ok(self) -> bool:
        return self.routing_mismatch == 0 and not self.bad_tokens and not self.too_many_ties

    def __str__(self) -> str:
        text = (
            f"{self.tokens} tokens, max |err| {self.max_abs_err:.3e}, "
            f"{self.near_ties} near-tie swaps (at most {self.max_near_ties}), {self.routing_mismatch} routing "
            f"mismatches, {len(self.bad_tokens)} tokens out of tolerance"
        )
        return text + "".join(f"; {p}" for p in self.problems)


def compare_outputs(
    out: torch.Tensor,
    ref: torch.Tensor,
    routing: Routing | None = None,
    ref_routing: Routing | None = None,
    *,
    dtype: torch.dtype | None = None,
    tie_tol: float | None = None,
    max_tie_share: float = MAX_NEAR_TIE_SHARE,
) -> ComparisonReport:
    """the comparison rule of docs/spec.md for ``out`` [T, H, D] against ``ref`` [T, H, D].

    With both routings (the reference's with its routing values), each token's selected blocks
    must equal the reference's, except for a near tie at rank K: the same number of blocks,
    every block that differs one the token may select (a routing value above -1e4) whose value
    is within ``tie_tol`` (relative) of the reference's K-th. A selected id out of the
    reference's range (< 0 other than the -1 padding, >= N), one the token may not select, a
    block selected twice, or a block more or less is a routing mismatch. A token whose
    selection agrees but whose 16th and 17th routing values are that close, and within reach of
    the prior (within 2 of the largest value), is a near tie at rank M: which 16 values the
    entmax prior sees may differ, and so may the bias. Near ties
    are bounded: more than ``max_tie_share`` of the tokens (at least 1) fails the comparison.
    Every token that is not a near tie has its output compared, and, where both routings carry
    their bias, the weights ``exp(bias - max bias)`` of its blocks (within
    :data:`BIAS_WEIGHT_TOL`).
    """
    dtype = dtype or out.dtype
    atol, rtol = TOLERANCES[dtype]
    tie_tol = SCORE_TIE_TOL[dtype] if tie_tol is None else tie_tol
    t = out.shape[0]
    compared = torch.ones(t, dtype=torch.bool)
    mismatch = ties = 0
    problems: list[str] = []

    def problem(i: int, what: str) -> None:
        nonlocal mismatch
        mismatch += 1
        if len(problems) < 5:
            problems.append(f"token {i}: {what}")

    def close(x: float, y: float) -> bool:
        return abs(x - y) <= tie_tol * (1.0 + abs(y))

    if routing is not None and ref_routing is not None:
        if ref_routing.values is None:
            raise ValueError("the reference's routing must carry its routing values (Routing.values)")
        values_all = ref_routing.values
        n = values_all.shape[-1] if values_all.numel() else 0
        for i in range(t):
            got_ids = routing.selected[i].tolist()
            want_ids = [x for x in ref_routing.selected[i].tolist() if x >= 0]
            valid = [x for x in got_ids if x != -1]
            bad = [x for x in valid if x < 0 or x >= n]
            if bad:
                problem(i, f"selected block ids {bad} outside the reference's 0..{n - 1}")
                continue
            if len(set(valid)) != len(valid):
                problem(i, f"a block selected twice: {sorted(valid)}")
                continue
            a, b = set(valid), set(want_ids)
            values = values_all[i]
            if a == b:
                if n > ROUTE_TOP_M:
                    top = values.topk(ROUTE_TOP_M + 1).values.tolist()
                    m_th, next_ = top[ROUTE_TOP_M - 1], top[ROUTE_TOP_M]
                    # Only values within 2 of the largest can have entmax mass (tau >= x_max / 2 - 1):
                    # below that the swap changes no prior.
                    in_reach = next_ > top[0] - 2.0 - tie_tol * (1.0 + abs(top[0]))
                    if next_ > NOT_CANDIDATE and in_reach and close(next_, m_th):
                        ties += 1
                        compared[i] = False
                if compared[i] and valid and routing.bias is not None and ref_routing.bias is not None:
                    worst = _bias_weight_error(routing, ref_routing, i)
                    if worst > BIAS_WEIGHT_TOL.get(dtype, BIAS_WEIGHT_TOL[torch.float32]):
                        problem(i, f"routing bias: block weights differ by {worst:.3e}")
                continue
            not_candidates = sorted(x for x in a - b if float(values[x]) <= NOT_CANDIDATE)
            if not_candidates:
                problem(i, f"selected blocks {not_candidates} that the token may not select")
                continue
            if len(a) != len(b):
                problem(i, f"{len(a)} blocks selected, the reference {len(b)}: {sorted(a)} vs {sorted(b)}")
                continue
            boundary = float(values[want_ids].min()) if want_ids else float("inf")
            diff = a ^ b
            if all(close(float(values[x]), boundary) for x in diff):
                ties += 1
                compared[i] = False
            else:
                problem(
                    i,
                    f"selected {sorted(a - b)} instead of {sorted(b - a)} (routing values "
                    f"{[round(float(values[x]), 5) for x in sorted(diff)]}, K-th {boundary:.5f})",
                )
    err = (out.float().cpu() - ref.float().cpu()).abs()
    limit = atol + rtol * ref.float().cpu().abs()
    bad_rows = ((err > limit).flatten(1).any(1) & compared).nonzero().flatten().tolist()
    max_err = float(err[compared].max()) if bool(compared.any()) else 0.0
    return ComparisonReport(t, mismatch, ties, max_err, bad_rows, max(1, int(max_tie_share * t)), problems)


def random_sequences(
    gen: torch.Generator,
    n: int,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    index_dim: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    pages: tuple[int, int] = (2, 6),
    response: int = 12,
    max_images: int = 40,
) -> list[tuple[DashInputs, torch.Tensor]]:
    """``n`` random document sequences sharing one ``head_cls`` (it is a layer weight), each
    with its ``coords`` [S, 4] from the whole sequence: ``[(inputs, coords), ...]``."""
    from .attention.dash.paged import sequence_coords

    head_cls = torch.randn(index_dim, generator=gen).to(dtype)
    seqs = []
    for _ in range(n):
        npages = int(torch.randint(pages[0], pages[1] + 1, (1,), generator=gen))
        roles = random_roles(gen, npages, max_images=max_images, response=response, response_markers=2)
        x = random_inputs(
            gen,
            roles,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            index_dim=index_dim,
            dtype=dtype,
            device=device,
            head_cls=head_cls.to(device),
        )
        seqs.append((x, sequence_coords(roles).to(device)))
    return seqs


def prefill_then_decode(gen: torch.Generator, seqs, response: int) -> list[list[int]]:
    """Per sequence: its prompt in 1-3 random chunks, then the ``response`` tokens one at a time."""
    plans = []
    for x, _ in seqs:
        prompt = x.length - response
        cuts = sorted(set(torch.randint(1, prompt, (2,), generator=gen).tolist()))
        bounds = [0, *[c for c in cuts if 0 < c < prompt], prompt]
        plans.append([b - a for a, b in zip(bounds, bounds[1:])] + [1] * response)
    return plans


#: Configuration variants the kernel and plugin tests share:
#: name -> (sparse_attention_config overrides, layer index).
CONFIG_VARIANTS: dict[str, tuple[dict, int]] = {
    "per_layer_lists": (
        {
            "sparse_attention_freq": [0, 1, 1],
            "dash_scale_per_layer": [16.0, 64.0],
            "dash_floor_per_layer": [1e-3, 1e-2],
            "dash_topk_blocks": 5,
            "dash_sigma": 0.5,
        },
        2,
    ),
    "keep_all_16": ({"dash_topk_blocks": 20, "dash_scaling_factor": 8.0}, 1),
    "truncate_mod": (
        {
            "sparse_main_rope_tok_freq_mode": "truncate",
            "sparse_rope_tok_freq_mode": "truncate",
            "sparse_rope_page_mod": 3,
            "sparse_rope_page_pairs": 1,
        },
        0,
    ),
}


def fill_garbage(cache, gen: torch.Generator, scale: float = 10.0) -> None:
    """Every floating tensor of a ``DashKVCache`` to random values times ``scale``: nothing may
    depend on slots that were never written."""
    for t in cache.tensors().values():
        if t.dtype.is_floating_point:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype) * scale)


def assert_caches_match(got, ref, dtype: torch.dtype) -> None:
    """A kernel-written paged cache against the reference's (both ``DashKVCache``): written in
    place, bit-for-bit where nothing is computed (values, image pages, page ranges), within the
    dtype's tolerance where RoPE or the summary's softmax is computed."""
    atol, rtol = TOLERANCES[dtype]
    assert torch.equal(got.value, ref.value)
    assert torch.equal(got.image_page, ref.image_page)
    assert torch.equal(got.summary_pages, ref.summary_pages)
    torch.testing.assert_close(got.key, ref.key, atol=atol, rtol=rtol)
    torch.testing.assert_close(got.index_key, ref.index_key, atol=atol, rtol=rtol)
    # A summary is a weighted mean of index keys that are only within the dtype's tolerance;
    # with small sparse blocks one key can carry nearly all the weight.
    torch.testing.assert_close(got.summary, ref.summary, atol=max(atol, 2e-3), rtol=max(rtol, 2e-3))
