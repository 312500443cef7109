"""The tuner: every plan it returns fits; it tries interleaving; it keeps the fastest."""

from __future__ import annotations

import pandas as pd
import pytest

from pipesim.cluster import Cluster, Device
from pipesim.errors import PlanError
from pipesim.plan import Plan
from pipesim.profile import Profile
from pipesim.schedule import program
from pipesim.simulator import simulate
from pipesim.trace import metrics
from pipesim.tune import tune
from tests.helpers import uniform_profile


def _uneven(costs: list[float]) -> Profile:
    rows = [dict(layer=i, name="L", micro_batch=b, fwd_s=c * b, bwd_s=2 * c * b, input_bytes=100 * b,
                 output_bytes=100 * b, saved_bytes=300 * b, saved_input_bytes=100 * b,
                 saved_output_bytes=0, param_bytes=1000)
            for i, c in enumerate(costs) for b in (1, 16)]
    return Profile(pd.DataFrame(rows))


@pytest.mark.parametrize("budget", [2.0e4, 3.0e4, 5.0e4, 1e9])
def test_no_returned_plan_exceeds_the_budget_or_a_devices_memory(budget):
    prof = uniform_profile(6, sizes=(1, 16))
    small = Cluster([Device("a", memory_bytes=4.0e4), Device("b")])
    try:
        result = tune(prof, 2, 16, budget, cluster=small)
    except PlanError as exc:
        assert "no plan fits" in str(exc)
        return
    for plan in result.plans:
        peaks = metrics(simulate(prof, plan, small)).peak_memory_bytes
        assert peaks["a"] <= min(budget, 4.0e4) and peaks["b"] <= budget


def test_plans_that_run_the_same_program_are_one_candidate():
    # at one micro-batch GPipe and 1F1B, except_last and never, are one plan: simulated
    # once, listed once, under the name met first
    prof = uniform_profile(4, sizes=(1, 16))
    result = tune(prof, 2, 16, 1e12, chunks=[1, 4], refine=False)
    one = result.table[result.table.chunks == 1]
    assert sorted(zip(one.schedule, one.checkpoint)) == [("gpipe", "always"),
                                                        ("gpipe", "except_last")]
    assert len(result.table[result.table.chunks == 4]) == 6  # 3 modes x 2 schedules
    assert len(set(map(program, result.table.plan))) == len(result.table)


def test_interleaving_is_tried_and_its_balance_refined():
    prof = _uneven([1, 1, 1, 1, 3, 1, 1, 3])
    result = tune(prof, 2, 16, 1e12, schedules=("interleaved",), chunks=[4, 8],
                  checkpoints=("never",))
    table = result.table
    assert set(table.virtual_stages) == {2, 3}
    best = result.best
    assert best.virtual_stages in (2, 3) and best.schedule == "interleaved"
    # nothing simulated beats it, neighbours of the exact partition included
    fastest = table.loc[table.throughput.idxmax()]
    assert metrics(simulate(prof, best)).throughput == pytest.approx(fastest.throughput)
    assert not table.from_partition.all()  # refinement looked beyond the partition


def test_impossible_budget_names_the_smallest_peak():
    prof = uniform_profile(4, sizes=(1, 16))
    with pytest.raises(PlanError, match="smallest peak any plan needs"):
        tune(prof, 2, 16, 10.0)
    assert Plan([1, 1], 2, 2).optimizer == "sgd"  # the default both sides share


def test_every_schedule_is_tuned_and_zero_bubble_wins_when_it_fits():
    prof = uniform_profile(8, sizes=(1, 16))
    result = tune(prof, 2, 16, 1e12, schedules=("gpipe", "1f1b", "zb-h1", "zb-h2", "zbv"),
                  chunks=[4, 8], checkpoints=("never",), refine=False)
    assert set(result.table.schedule) == {"gpipe", "1f1b", "zb-h1", "zb-h2", "zbv"}
    assert result.table.loc[result.table.schedule == "zbv", "virtual_stages"].eq(2).all()
    assert result.best.schedule in ("zb-h2", "zbv")  # the smallest bubble on equal F, I, W
    with pytest.raises(PlanError, match=r"unknown schedule\(s\) \['zb'\]"):
        tune(prof, 2, 16, 1e12, schedules=("zb",))


def test_a_budget_near_1f1b_memory_rules_out_zb_h2():
    """ZB-H1 holds 1F1B's activations plus the output gradients kept from I to W."""
    prof = uniform_profile(8, sizes=(1, 16))
    kinds = ("1f1b", "zb-h1", "zb-h2")
    table = tune(prof, 2, 16, 1e12, schedules=kinds, chunks=[8], checkpoints=("never",),
                 refine=False).table
    peak = table.set_index("schedule").peak_bytes
    assert peak["1f1b"] <= peak["zb-h1"] < 1.1 * peak["1f1b"] < peak["zb-h2"]
    budget = peak["zb-h1"] * 1.1 + 1  # fits ZB-H1 with the margin, not ZB-H2
    best = tune(prof, 2, 16, budget, schedules=kinds, chunks=[8], checkpoints=("never",),
                refine=False).best
    assert best.schedule == "zb-h1"


def _tuned_2x2(cluster: Cluster):
    """Four uniform layers on two devices at 2 micro-batches: the partition [2,2] and its
    neighbours [1,3] and [3,1] are the candidates."""
    return tune(uniform_profile(4), 2, 8, memory_budget=1e12, cluster=cluster, chunks=[2],
                checkpoints=["never"], schedules=["gpipe"], progress=False)


def test_tuning_with_some_balances_measured_in_place_warns_of_two_rulers():
    import warnings

    from pipesim.readings import InPlaceCost

    two = [Device("a"), Device("b")]

    # the partition [2,2] measured in place, its neighbours [1,3] and [3,1] not
    measured = tuple(InPlaceCost(first, stop, 4, False, 1.0, 2.0)
                     for first, stop in ((0, 2), (2, 4)))
    with pytest.warns(UserWarning, match=r"tune: 1 of 3 candidates have every stage measured "
                                         r"in place .* two rulers"):
        result = _tuned_2x2(Cluster(two, in_place_costs=measured))
    assert result.table.set_index("balance")["in_place"].to_dict() == {
        "2,2": True, "1,3": False, "3,1": False}
    # every candidate measured, or none: one ruler, no warning
    every = tuple(InPlaceCost(first, stop, 4, False, 1.0, 2.0)
                  for first, stop in ((0, 1), (1, 4), (0, 2), (2, 4), (0, 3), (3, 4)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _tuned_2x2(Cluster(two, in_place_costs=every)).table["in_place"].all()
        assert "in_place" not in _tuned_2x2(Cluster(two)).table


def _idle_costs(spans):  # what a 1 ms wait costs each span's forward and backward
    from pipesim.readings import IdleCost

    return {"idle_costs": tuple(IdleCost(first, stop, 4, False, 0.001, 1e-4, kind)
                                for first, stop in spans for kind in "FB")}


def _run_on_costs(spans):  # a run of forwards at 0.8x, of backwards at 0.9x, per span
    from pipesim.readings import RunOnCost

    return {"run_on_costs": tuple(RunOnCost(first, stop, 4, False, kind, scale)
                                  for first, stop in spans
                                  for kind, scale in (("F", 0.8), ("B", 0.9)))}


def _host_slowdowns(spans):  # each span 1.2x slower beside the other rank computing
    from pipesim.readings import SpanSlowdown

    return {"host_slowdowns": tuple(SpanSlowdown(first, stop, 4, 1.2) for first, stop in spans)}


@pytest.mark.parametrize("measured, what", [(_idle_costs, "idle costs"),
                                            (_run_on_costs, "run-on costs"),
                                            (_host_slowdowns, "slowdown beside the others")])
def test_tuning_with_some_balances_measured_so_warns_of_two_rulers(measured, what):
    # the readings of [2,2] measured (calibrate one balance), not the neighbours': they
    # re-price [2,2] alone
    import warnings

    two = [Device("a"), Device("b")]
    column = next(iter(measured(())))
    with pytest.warns(UserWarning, match=rf"tune: 1 of 3 candidates have every stage's "
                                         rf"{what} measured .* two rulers"):
        result = _tuned_2x2(Cluster(two, **measured(((0, 2), (2, 4)))))
    assert result.table.set_index("balance")[column].to_dict() == {
        "2,2": True, "1,3": False, "3,1": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        every = measured(((0, 1), (1, 4), (0, 2), (2, 4), (0, 3), (3, 4)))
        assert _tuned_2x2(Cluster(two, **every)).table[column].all()
        assert column not in _tuned_2x2(Cluster(two)).table


def test_tuned_balances_are_every_balance_the_tuner_tries_one_stage_a_device():
    from pipesim.tune import tuned_balances

    prof = _uneven([1.0, 3.0, 1.0, 2.0, 1.0, 1.0])
    for stages in (2, 3):
        balances = tuned_balances(prof, stages, 16)
        tried = tune(prof, stages, 16, 1e12, schedules=("gpipe", "1f1b", "zb-h1")).table
        assert sorted(map(tuple, balances)) == sorted(
            {tuple(map(int, b.split(","))) for b in tried.balance})
        assert len(balances) == len({tuple(b) for b in balances})  # each once
        assert all(len(b) == stages and sum(b) == prof.n_layers for b in balances)


def test_among_plans_the_model_cannot_tell_apart_the_smallest_peak_wins():
    # two stages of CPU processes, 4 micro-batches: 1F1B ends 59 us later than GPipe in
    # 120 s (its messages take other turns) and holds 10.4 kB against GPipe's 15 kB --
    # within the tie (0.5%) the smaller peak comes first; with no tie the faster one
    prof = uniform_profile(4, sizes=(1, 16))
    cpu = Cluster.cpu_processes(2)

    def ranked(tie: float) -> list[tuple[str, float]]:
        result = tune(prof, 2, 16, 1e9, cluster=cpu, chunks=[4], checkpoints=["never"],
                      refine=False, tie=tie)
        assert [p.label() for p in result.plans] == [
            f"{r.schedule} [{r.balance}] m={r.chunks} ckpt={r.checkpoint}"
            for r in result.table.itertuples()]  # the table in the ranking's order
        return [(r.schedule, r.peak_bytes) for r in result.table.itertuples()]

    assert ranked(0.005) == [("1f1b", 10400.0), ("gpipe", 15000.0)]
    assert ranked(0.0) == [("gpipe", 15000.0), ("1f1b", 10400.0)]
    with pytest.raises(PlanError, match="tie"):
        tune(prof, 2, 16, 1e9, cluster=cpu, tie=1.0)
