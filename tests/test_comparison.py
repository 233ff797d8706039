"""The comparison rule of docs/spec.md (dash_trt.testing.compare_outputs) on hand-made routings."""

import torch

from dash_trt.attention.dash.reference import NOT_CANDIDATE, Routing
from dash_trt.testing import compare_outputs

NC = NOT_CANDIDATE


def _ref(sel, values):
    return Routing(torch.tensor([sel]), torch.zeros(1, len(sel)), torch.tensor([values]))


def _case(ref_sel, got_sel, values):
    out = torch.zeros(1, 1, 4)
    return compare_outputs(
        out, out.clone(), Routing(torch.tensor([got_sel])), _ref(ref_sel, values), dtype=torch.float32
    )


def test_swap_at_the_kth_rank_is_a_near_tie_only_when_values_are_close():
    values = [9.0, 5.0, 5.00001, 1.0]
    report = _case([0, 1], [0, 2], values)  # 2 for 1: 1e-5 apart
    assert (report.near_ties, report.routing_mismatch, report.ok) == (1, 0, True)
    report = _case([0, 1], [0, 3], values)  # 3 for 1: 4 apart
    assert (report.near_ties, report.routing_mismatch, report.ok) == (0, 1, False)


def test_a_near_tie_at_the_16th_rank_excuses_the_output_only():
    """Same selection, but the 16th and 17th routing values are 1e-6 apart and within 2 of the
    largest: the entmax prior may have seen either, so the bias (and the output) may differ; the
    token is a near tie. Apart by 1, or equal but more than 2 below the largest (no prior mass
    either way), its output is compared (and off by 1 here, so the comparison fails)."""
    out, ref = torch.zeros(1, 1, 4) + 1.0, torch.zeros(1, 1, 4)
    top = [20.0 - 0.1 * i for i in range(15)]
    near = [*top, 18.4, 18.400001, 1.0]
    far = [*top, 18.4, 17.4, 1.0]
    out_of_reach = [20.0 - i for i in range(15)] + [3.0, 3.000001, 1.0]
    for values, tie in ((near, True), (far, False), (out_of_reach, False)):
        report = compare_outputs(out, ref, Routing(torch.tensor([[0, 1]])), _ref([0, 1], values), dtype=torch.float32)
        assert (report.near_ties, report.ok) == ((1, True) if tie else (0, False)), str(report)
    # a 17th value of a block the token may not select is no tie
    report = compare_outputs(
        out,
        ref,
        Routing(torch.tensor([[0, 1]])),
        _ref([0, 1], [20.0 - i for i in range(15)] + [NC, NC, NC]),
        dtype=torch.float32,
    )
    assert report.near_ties == 0 and not report.ok


def test_an_out_of_range_block_id_is_a_mismatch_and_its_output_is_compared():
    """The audit's case: block N (out of range) selected instead of block 1, output off by 5.0.
    It used to count as "1 near-tie swap" with the token's output never compared."""
    values = [9.0, 5.0, 5.00001, 1.0]
    out, ref = torch.zeros(1, 1, 4) + 5.0, torch.zeros(1, 1, 4)
    for bad in (4, 7, -3):
        report = compare_outputs(out, ref, Routing(torch.tensor([[0, bad]])), _ref([0, 1], values), dtype=torch.float32)
        assert (report.near_ties, report.routing_mismatch, report.ok) == (0, 1, False), str(report)
        assert report.bad_tokens == [0] and "outside the reference's 0..3" in str(report)


def test_blocks_the_token_may_not_select_twice_selected_or_missing_are_mismatches():
    values = [9.0, 5.0, NC, 5.00001]  # block 2 may not be selected (not remote, or not the page's)
    assert _case([0, 1], [0, 2], values).routing_mismatch == 1
    report = _case([0, 1], [3, 3], values)
    assert report.routing_mismatch == 1 and "a block selected twice" in str(report)
    report = _case([0, 1], [0, -1], values)
    assert report.routing_mismatch == 1 and "1 blocks selected, the reference 2" in str(report)
    assert _case([0, 1], [0, 3], values).ok  # the genuine near tie still passes


def test_near_ties_are_bounded_to_a_share_of_the_tokens():
    """Every swap within the tolerance, but on every token: that is a wrong top-k, not
    rounding. 5% of the tokens (at least one) may be near ties."""
    from dash_trt.testing import MAX_NEAR_TIE_SHARE

    t = 100
    values = torch.tensor([[9.0, 5.0, 5.00001, 1.0]] * t)
    out = torch.zeros(t, 1, 4)
    want = Routing(torch.tensor([[0, 1]] * t), torch.zeros(t, 2), values)
    allowed = int(MAX_NEAR_TIE_SHARE * t)
    for swapped, ok in ((allowed, True), (allowed + 1, False), (t, False)):
        sel = torch.tensor([[0, 2]] * swapped + [[0, 1]] * (t - swapped))
        report = compare_outputs(out, out.clone(), Routing(sel), want, dtype=torch.float32)
        assert (report.near_ties, report.routing_mismatch, report.ok) == (swapped, 0, ok), str(report)
    one = compare_outputs(
        out[:1], out[:1].clone(), Routing(torch.tensor([[0, 2]])), Routing(want.selected[:1], want.bias[:1], values[:1])
    )
    assert one.ok and one.near_ties == 1  # a single token may always be one near tie


def test_a_mismatched_token_is_still_compared_and_listed():
    values = [9.0, 5.0, 5.00001, 1.0]
    out, ref = torch.zeros(1, 1, 4) + 1.0, torch.zeros(1, 1, 4)
    report = compare_outputs(out, ref, Routing(torch.tensor([[0, 3]])), _ref([0, 1], values), dtype=torch.float32)
    assert not report.ok and report.bad_tokens == [0] and report.max_abs_err == 1.0
    assert "selected [3] instead of [1]" in str(report)


def test_the_reference_must_carry_its_routing_values():
    import pytest

    out = torch.zeros(1, 1, 4)
    with pytest.raises(ValueError, match="routing values"):
        compare_outputs(out, out, Routing(torch.tensor([[0]])), Routing(torch.tensor([[0]])))
