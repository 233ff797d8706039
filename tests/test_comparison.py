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
