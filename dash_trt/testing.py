"""Random DASH problems and the the comparison rule of docs/spec.md, shared by the tests, the
demo and the kernel checks.

Inputs are random and never zeros. Outputs are compared the way docs/spec.md asks:
routing is a top-k, so (a) each token's selected set must match the reference
except where the blocks that differ score within a small tolerance of each other,
and (b) attention outputs are compared on the tokens whose selection matched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import DashConfig
from .reference import ROLE_IMAGE, ROLE_PAGE, ROLE_TEXT, Routing

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

#: Scores closer than this may order differently between implementations.
SCORE_TIE_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


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


def random_config(gen: torch.Generator, **overrides) -> DashConfig:
    """A small random configuration that exercises every key."""

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    sp = {
        "sparse_block_size": pick([4, 8, 16]),
        "sparse_local_block": pick([1, 2]),
        "sparse_topk_blocks": pick([1, 2, 3, 5]),
        "sparse_dense_layers": pick([[], [1]]),
        "sparse_page_bias": pick([0.0, 0.5, -0.75, 2.0]),
        "sparse_rope_page_pairs": pick([1, 2]),
        "sparse_rope_tok_theta": pick([10000.0, 500.0]),
        "sparse_rope_page_theta": pick([256.0, 16.0]),
        "sparse_main_rope_tok_freq_mode": pick([None, "truncate"]),
        "sparse_rope_tok_freq_mode": pick([None, "truncate"]),
        "sparse_rope_page_mod": pick([0, 0, 3]),
        "dash_query_chunk": pick([1, 5, 2048]),
    }
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

#: Scores at or below this mark blocks that are not remote candidates (``Routing.scores``).
_NOT_A_CANDIDATE = -1e8


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

    With both routings, each token's selected blocks must equal the reference's, except for a
    near tie: the same number of blocks, every block that differs a remote candidate of that
    token in the reference (a score above -1e8) whose score is within ``tie_tol`` of the
    reference's K-th slot. A selected id out of the reference's range (< 0 other than the -1
    padding, >= N, or not a candidate), a block selected twice, or a block more or less is a
    routing mismatch. Near ties are bounded: more than ``max_tie_share`` of the tokens (at
    least 1) fails the comparison. Every token that is not a near tie has its output compared.
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

    if routing is not None and ref_routing is not None:
        scores_all = ref_routing.scores
        n = scores_all.shape[-1] if scores_all.numel() else 0
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
            if a == b:
                continue
            scores = scores_all[i]
            not_candidates = sorted(x for x in a - b if float(scores[x]) <= _NOT_A_CANDIDATE)
            if not_candidates:
                problem(i, f"selected blocks {not_candidates} that are not candidates of the token")
                continue
            if len(a) != len(b):
                problem(i, f"{len(a)} blocks selected, the reference {len(b)}: {sorted(a)} vs {sorted(b)}")
                continue
            chosen_free = [
                x for x, f in zip(ref_routing.selected[i].tolist(), ref_routing.forced[i].tolist())
                if x >= 0 and not f
            ]
            # The K-th slot's class: the lowest free block chosen, or, when every chosen block
            # is forced (forced blocks come first), the lowest forced one: forced blocks with
            # near-equal scores may swap as free ones do.
            pool = chosen_free or want_ids
            boundary = float(scores[pool].min()) if pool else float("inf")
            diff = a ^ b
            if all(abs(float(scores[x]) - boundary) <= tie_tol for x in diff):
                ties += 1
                compared[i] = False
            else:
                problem(i, f"selected {sorted(a - b)} instead of {sorted(b - a)} (scores "
                           f"{[round(float(scores[x]), 5) for x in sorted(diff)]}, K-th slot {boundary:.5f})")
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
    from .paged import sequence_coords

    head_cls = torch.randn(index_dim, generator=gen).to(dtype)
    seqs = []
    for _ in range(n):
        npages = int(torch.randint(pages[0], pages[1] + 1, (1,), generator=gen))
        roles = random_roles(gen, npages, max_images=max_images, response=response, response_markers=2)
        x = random_inputs(gen, roles, heads=heads, kv_heads=kv_heads, head_dim=head_dim, index_dim=index_dim,
                          dtype=dtype, device=device, head_cls=head_cls.to(device))
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
#: name -> (dash_attention_config overrides, layer index).
CONFIG_VARIANTS: dict[str, tuple[dict, int]] = {
    "dense_layer": ({"sparse_dense_layers": [1], "sparse_page_bias": 0.0}, 1),
    "topk_list": ({"sparse_topk_blocks": [2, 5]}, 1),
    "truncate_mod": ({"sparse_main_rope_tok_freq_mode": "truncate", "sparse_rope_tok_freq_mode": "truncate",
                      "sparse_rope_page_mod": 3, "sparse_rope_page_pairs": 1}, 0),
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
