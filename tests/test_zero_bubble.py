"""Split backward (I and W) and the zero-bubble schedules: structure, times and memory."""

from __future__ import annotations

import pytest

from pipesim import metrics, simulate
from pipesim.errors import PlanError, ScheduleError
from pipesim.plan import Plan, v_placement
from pipesim.schedule import Action, Schedule, build_schedule, dependencies, zero_bubble_order
from tests.helpers import uniform_profile

ZB = [("zb-h1", 1), ("zb-h2", 1), ("zbv", 2)]


def _plan(schedule: str, n: int, m: int, v: int = 1, checkpoint: str = "never") -> Plan:
    return Plan([1] * (n * v), m, m, checkpoint=checkpoint, schedule=schedule, virtual_stages=v)


@pytest.mark.parametrize(("schedule", "v"), ZB)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 17])
def test_zero_bubble_schedules_are_complete_and_ordered(schedule, v, n, m):
    s = build_schedule(_plan(schedule, n, m, v))  # checked: complete, no deadlock
    assert s.splits_backward
    position = {a: i for device in s.order for i, a in enumerate(device)}
    for device in s.order:
        for a in device:
            for dep in dependencies(a, s.n_stages, split=True):
                if s.placement[dep.stage] == s.placement[a.stage]:
                    assert position[dep] < position[a], f"{dep} must precede {a}"
    for st in range(s.n_stages):  # each stage's work in micro-batch order
        for kind in "FIW":
            mbs = [a.microbatch for a in s.order[s.placement[st]] if a[:2] == (st, kind)]
            assert mbs == sorted(mbs)


def test_zbv_places_stages_in_a_v():
    assert v_placement(3) == (0, 1, 2, 2, 1, 0)
    assert _plan("zbv", 3, 4, 2).stage_devices == (0, 1, 2, 2, 1, 0)
    with pytest.raises(PlanError, match="zbv needs 2 stages a device in a V"):
        build_schedule(Plan([1] * 4, 4, 4, schedule="zbv", virtual_stages=2,
                            placement=[0, 1, 0, 1]))
    with pytest.raises(PlanError, match="zb-h1 runs one stage per device"):
        build_schedule(Plan([1] * 4, 4, 4, schedule="zb-h1", virtual_stages=2))


def test_split_times_add_up_and_default_to_halves():
    """Without I/W columns a layer with parameters splits its backward in halves."""
    prof = uniform_profile(4, fwd_s=1.0, bwd_s=2.0)
    first = prof.span_cost(0, 2, 1)  # the input is data: the whole backward is W
    assert (first.bwd_input_s, first.bwd_weight_s, first.w_pending_bytes) == (0.0, 4.0, 0.0)
    span = prof.span_cost(1, 3, 1)
    assert span.bwd_input_s == pytest.approx(2.0)
    assert span.bwd_weight_s == pytest.approx(2.0)
    assert span.bwd_input_s + span.bwd_weight_s == pytest.approx(span.bwd_s)
    # output gradients of the span's inner layers stay from I to W (the last one's is
    # the received gradient)
    assert span.w_pending_bytes == pytest.approx(100)
    table = prof.table.copy()
    table["bwd_input_s"] = table["bwd_s"] * 0.25
    table["bwd_weight_s"] = table["bwd_s"] * 0.85  # a split that costs more than the whole
    measured = type(prof)(table, meta=prof.meta).span_cost(1, 3, 1)
    assert measured.bwd_input_s == pytest.approx(1.0)
    assert measured.bwd_weight_s == pytest.approx(3.4)


@pytest.mark.parametrize(("n", "m"), [(2, 4), (4, 6), (4, 16), (8, 32)])
def test_zb_h2_has_no_bubble_on_uniform_stages(n, m):
    """F = I = W = 1: every device works 3m units; the last starts n - 1 units late."""
    trace = simulate(uniform_profile(n), _plan("zb-h2", n, m))
    assert metrics(trace).iteration_time_s == pytest.approx(3 * m + n - 1)


@pytest.mark.parametrize(("n", "m"), [(2, 4), (4, 6), (4, 16), (8, 32)])
def test_zb_h1_beats_1f1b_within_its_memory(n, m):
    prof = uniform_profile(n)
    one = metrics(simulate(prof, _plan("1f1b", n, m)))
    zb = metrics(simulate(prof, _plan("zb-h1", n, m)))
    assert zb.iteration_time_s < one.iteration_time_s
    # 1F1B's closed form: (m + n - 1) (F + B)
    assert one.iteration_time_s == pytest.approx((m + n - 1) * 3)
    for device, peak in zb.peak_memory_bytes.items():
        assert peak <= one.peak_memory_bytes[device]


def test_zbv_nearly_removes_the_bubble():
    n, m = 4, 16
    prof = uniform_profile(2 * n, fwd_s=0.5, bwd_s=1.0)  # half-size stages
    zbv = metrics(simulate(prof, _plan("zbv", n, m, 2)))
    assert zbv.mean_bubble < 0.05
    assert zbv.iteration_time_s < 3 * m * 1.05


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize(("schedule", "v"), ZB)
def test_split_backward_memory_balances(schedule, v, checkpoint):
    """Every byte allocated is freed by the step's end, levels never negative."""
    n, m = 3, 5
    plan = _plan(schedule, n, m, v, checkpoint)
    trace = simulate(uniform_profile(n * v), plan)
    mem = trace.memory
    static = {d: g.bytes.iloc[0] for d, g in mem.groupby("device")}
    assert (mem.bytes >= -1e-6).all()
    for d, g in mem.groupby("device"):
        # what stays: parameters and their gradients
        assert g.bytes.iloc[-1] == pytest.approx(2 * static[d])


def test_w_keeps_activations_alive_longer():
    """Deferring W holds a micro-batch's activations past its I: a stage whose W waits
    holds more than the same order with each W right after its I."""
    n, m = 4, 8
    prof = uniform_profile(n)
    deferred = Schedule.from_order(zero_bubble_order(n, m, tuple(range(n)),
                                                     [2 * n - 1 - s for s in range(n)]))
    def w_after_i(a: Action) -> tuple[Action, ...]:
        return (a, Action(a.stage, "W", a.microbatch)) if a.kind == "I" else (a,)

    eager = Schedule.from_order([[x for a in device if a.kind != "W" for x in w_after_i(a)]
                                 for device in deferred.order])
    plan = _plan("1f1b", n, m)
    late = metrics(simulate(prof, plan, schedule=deferred)).peak_memory_bytes
    early = metrics(simulate(prof, plan, schedule=eager)).peak_memory_bytes
    assert late["dev1"] > early["dev1"]


def test_csv_round_trip_keeps_the_split(tmp_path):
    s = build_schedule(_plan("zbv", 2, 4, 2))
    back = Schedule.from_csv(s.to_csv(tmp_path / "zbv.csv"))
    assert back.order == s.order and back.placement == s.placement
    assert "0I0" in (tmp_path / "zbv.csv").read_text()


def test_a_cap_too_small_is_an_error():
    with pytest.raises(ScheduleError, match="too small"):
        zero_bubble_order(2, 4, (0, 1), [0, 1])
