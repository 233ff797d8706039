"""The comparison rule of docs/spec.md (dash_trt.testing.compare_outputs) on hand-made routings."""
import torch

from dash_trt.reference import Routing
from dash_trt.testing import compare_outputs


def _case(ref_sel, ref_forced, got_sel, scores):
    out = torch.zeros(1, 1, 4)
    ref = Routing(torch.tensor([ref_sel]), torch.tensor([ref_forced]), torch.tensor([scores]))
    got = Routing(torch.tensor([got_sel]), torch.tensor([got_sel]) >= 0, torch.empty(0))
    return compare_outputs(out, out.clone(), got, ref, dtype=torch.float32)


def test_swap_at_the_free_boundary_is_a_near_tie_only_when_scores_are_close():
    scores = [0.9, 0.5, 0.50001, 0.1]
    report = _case([0, 1], [True, False], [0, 2], scores)  # 2 for 1: 1e-5 apart
    assert (report.near_ties, report.routing_mismatch, report.ok) == (1, 0, True)
    report = _case([0, 1], [True, False], [0, 3], scores)  # 3 for 1: 0.4 apart
    assert (report.near_ties, report.routing_mismatch, report.ok) == (0, 1, False)


def test_swap_among_forced_blocks_when_every_chosen_block_is_forced():
    # top-2 filled by forced blocks alone: the K-th slot is a forced one, and a forced block
    # with a near-equal score may take it.
    scores = [0.7, 0.6335, 0.63351, 0.2]
    report = _case([0, 1], [True, True], [0, 2], scores)
    assert (report.near_ties, report.routing_mismatch, report.ok) == (1, 0, True)
    report = _case([0, 1], [True, True], [0, 3], scores)
    assert (report.near_ties, report.routing_mismatch, report.ok) == (0, 1, False)


def test_an_out_of_range_block_id_is_a_mismatch_and_its_output_is_compared():
    """The audit's case: block N (out of range) selected instead of block 1, output off by 5.0.
    It used to count as "1 near-tie swap" with the token's output never compared."""
    scores = [0.9, 0.5, 0.50001, 0.1]
    out, ref = torch.zeros(1, 1, 4) + 5.0, torch.zeros(1, 1, 4)
    want = Routing(torch.tensor([[0, 1]]), torch.tensor([[True, False]]), torch.tensor([scores]))
    for bad in (4, 7, -3):
        got = Routing(torch.tensor([[0, bad]]), torch.tensor([[True, True]]), torch.empty(0))
        report = compare_outputs(out, ref, got, want, dtype=torch.float32)
        assert (report.near_ties, report.routing_mismatch, report.ok) == (0, 1, False), str(report)
        assert report.bad_tokens == [0] and "outside the reference's 0..3" in str(report)


def test_blocks_that_are_not_candidates_twice_selected_or_missing_are_mismatches():
    scores = [0.9, 0.5, -1e9, 0.50001]  # block 2 is not remote for this token (e.g. its own local block)
    assert _case([0, 1], [True, False], [0, 2], scores).routing_mismatch == 1
    report = _case([0, 1], [True, False], [3, 3], scores)
    assert report.routing_mismatch == 1 and "a block selected twice" in str(report)
    report = _case([0, 1], [True, False], [0, -1], scores)
    assert report.routing_mismatch == 1 and "1 blocks selected, the reference 2" in str(report)
    assert _case([0, 1], [True, False], [0, 3], scores).ok  # the genuine near tie still passes


def test_near_ties_are_bounded_to_a_share_of_the_tokens():
    """Every swap within the score tolerance, but on every token: that is a wrong top-k, not
    rounding. 5% of the tokens (at least one) may be near ties."""
    from dash_trt.testing import MAX_NEAR_TIE_SHARE

    t = 100
    scores = torch.tensor([[0.9, 0.5, 0.50001, 0.1]] * t)
    out = torch.zeros(t, 1, 4)
    want = Routing(torch.tensor([[0, 1]] * t), torch.tensor([[True, False]] * t), scores)
    allowed = int(MAX_NEAR_TIE_SHARE * t)
    for swapped, ok in ((allowed, True), (allowed + 1, False), (t, False)):
        sel = torch.tensor([[0, 2]] * swapped + [[0, 1]] * (t - swapped))
        report = compare_outputs(out, out.clone(), Routing(sel, sel >= 0, torch.empty(0)), want, dtype=torch.float32)
        assert (report.near_ties, report.routing_mismatch, report.ok) == (swapped, 0, ok), str(report)
    one = compare_outputs(out[:1], out[:1].clone(), Routing(torch.tensor([[0, 2]]), torch.tensor([[True, True]]),
                                                             torch.empty(0)), Routing(want.selected[:1],
                                                                                      want.forced[:1], scores[:1]))
    assert one.ok and one.near_ties == 1  # a single token may always be one near tie


def test_a_mismatched_token_is_still_compared_and_listed():
    scores = [0.9, 0.5, 0.50001, 0.1]
    out, ref = torch.zeros(1, 1, 4) + 1.0, torch.zeros(1, 1, 4)
    want = Routing(torch.tensor([[0, 1]]), torch.tensor([[True, False]]), torch.tensor([scores]))
    got = Routing(torch.tensor([[0, 3]]), torch.tensor([[True, True]]), torch.empty(0))
    report = compare_outputs(out, ref, got, want, dtype=torch.float32)
    assert not report.ok and report.bad_tokens == [0] and report.max_abs_err == 1.0
    assert "selected [3] instead of [1]" in str(report)
