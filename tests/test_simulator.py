"""The simulator against closed forms, memory rules and properties over random inputs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipesim.cluster import Cluster, Device, Link
from pipesim.costs import PlanCosts
from pipesim.plan import Plan
from pipesim.profile import Profile
from pipesim.simulator import Jitter, simulate
from pipesim.trace import Trace, metrics
from tests.helpers import uniform_profile

F, B = 1.0, 2.0  # per sample and layer, in the uniform profile


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("n", "m"), [(2, 1), (2, 4), (4, 4), (4, 8), (8, 3)])
def test_uniform_iteration_time_and_bubble(schedule, n, m):
    prof = uniform_profile(n, fwd_s=F, bwd_s=B)
    trace = simulate(prof, Plan([1] * n, m, m, checkpoint="never", schedule=schedule))
    got = metrics(trace)
    assert got.iteration_time_s == pytest.approx((m + n - 1) * (F + B), abs=1e-9)
    for d in range(n):
        assert got.bubble[d] == pytest.approx((n - 1) / (m + n - 1), abs=1e-9)
    assert got.throughput == pytest.approx(m / ((m + n - 1) * (F + B)))


@pytest.mark.parametrize(("n", "v", "m"), [(2, 2, 4), (4, 2, 8), (4, 3, 8), (2, 4, 6)])
def test_interleaved_shrinks_the_bubble_by_v(n, v, m):
    prof = uniform_profile(n * v)
    plan = Plan([1] * (n * v), m, m, checkpoint="never", schedule="interleaved", virtual_stages=v)
    got = metrics(simulate(prof, plan))
    for d in range(n):
        idle = got.iteration_time_s - got.busy_s[d]
        assert idle / got.busy_s[d] == pytest.approx((n - 1) / (v * m), abs=1e-9)


def test_always_checkpoint_recomputes_every_forward():
    n, m = 3, 4
    got = metrics(simulate(uniform_profile(n), Plan([1] * n, m, m, checkpoint="always")))
    assert got.iteration_time_s == pytest.approx((m + n - 1) * (2 * F + B))


def test_last_micro_batch_may_be_smaller():
    prof = uniform_profile(2, sizes=(1, 8))
    trace = simulate(prof, Plan([1, 1], 4, 10, checkpoint="never"))  # sizes 3, 3, 3, 1
    f = trace.actions.query("kind == 'F' and stage == 0").sort_values("microbatch")
    assert list((f.end - f.start).round(9)) == [3.0, 3.0, 3.0, 1.0]


def _level_after_forwards(trace, device="dev0"):
    """Memory on ``device`` when stage 0 has run all forwards (before any backward)."""
    first_b = trace.actions.query("kind == 'B' and stage == 0")["start"].min()
    mem = trace.memory[(trace.memory.device == device) & (trace.memory.time < first_b)]
    return mem["bytes"].iloc[-1]


def _stash_per_microbatch(prof, checkpoint):
    plan = Plan([1] * prof.n_layers, 1, 1, checkpoint=checkpoint)
    from pipesim.costs import PlanCosts

    return PlanCosts(prof, plan).cost(0, 0).keep_bytes


@pytest.mark.parametrize(("schedule", "n", "m", "held"), [
    ("gpipe", 4, 8, 8), ("1f1b", 4, 8, 4), ("1f1b", 4, 2, 2), ("gpipe", 2, 5, 5)])
def test_stage0_holds_m_micro_batches_under_gpipe_and_n_under_1f1b(schedule, n, m, held):
    prof = uniform_profile(n, sizes=(1, 2))
    trace = simulate(prof, Plan([1] * n, m, m, checkpoint="never", schedule=schedule,
                                optimizer="adam"))
    got = metrics(trace)
    static = 1000 * 3  # params + Adam state
    grads = 1000
    per_mb = _stash_per_microbatch(prof, "never")
    grad_in = 100  # the output gradient received from stage 1, held during the backward
    assert got.peak_memory_bytes["dev0"] == pytest.approx(static + grads + held * per_mb + grad_in)


def test_always_keeps_only_stage_boundaries():
    small = uniform_profile(2, saved_bytes=300)
    big = uniform_profile(2, saved_bytes=3000)  # layers keep 10x more internals
    plan = Plan([1, 1], 4, 4, checkpoint="always", optimizer="adam")
    levels = [_level_after_forwards(simulate(p, plan)) for p in (small, big)]
    assert levels[0] == levels[1] == 3000 + 4 * 100  # static + 4 stage outputs


def test_except_last_differs_from_always_by_exactly_the_last_micro_batch():
    prof = uniform_profile(2)
    always = _level_after_forwards(simulate(prof, Plan([1, 1], 4, 4, checkpoint="always")))
    except_last = _level_after_forwards(simulate(prof, Plan([1, 1], 4, 4, checkpoint="except_last")))
    full, ckpt = _stash_per_microbatch(prof, "never"), _stash_per_microbatch(prof, "always")
    assert except_last - always == pytest.approx(full - ckpt)


def test_links_delay_arrivals_and_occupy_by_bandwidth():
    prof = uniform_profile(2, act_bytes=1000, saved_bytes=3000)
    cluster = Cluster([Device("a"), Device("b")], link=Link(latency_s=0.5, bandwidth_Bps=1000.0))
    trace = simulate(prof, Plan([1, 1], 2, 2, checkpoint="never"), cluster)
    sends = trace.actions.query("kind == 'SEND_F'").sort_values("start")
    assert list(sends.end - sends.start) == pytest.approx([1.5, 1.5])  # 1 s of bytes + latency
    f1 = trace.actions.query("kind == 'F' and stage == 1").sort_values("microbatch")
    assert list(f1.start) == pytest.approx(list(sends.end))


def test_shared_gpu_serialises_compute():
    prof = uniform_profile(2)
    plan = Plan([1, 1], 4, 4, checkpoint="never")
    shared = metrics(simulate(prof, plan, Cluster.shared_gpu(2)))
    # two workers on one device: no overlap, so the time is the sum of all work (+ overheads)
    assert shared.iteration_time_s == pytest.approx(2 * 4 * (F + B) + 16 * 20e-6)
    assert list(shared.peak_memory_bytes) == ["cuda:0"]


def test_jitter_is_seeded_and_absent_by_default():
    prof = uniform_profile(2)
    plan = Plan([1, 1], 4, 4)
    a = metrics(simulate(prof, plan, jitter=Jitter(sigma=0.2, seed=1), iterations=3))
    b = metrics(simulate(prof, plan, jitter=Jitter(sigma=0.2, seed=1), iterations=3))
    c = metrics(simulate(prof, plan, iterations=3))
    assert a.iteration_times_s == b.iteration_times_s
    assert len(set(a.iteration_times_s)) == 3
    assert len(set(c.iteration_times_s)) == 1
    slow = metrics(simulate(prof, plan, jitter=Jitter(stragglers={1: 2.0})))
    assert slow.busy_s[1] == pytest.approx(2 * c.busy_s[1])


def test_jitter_scale_changes_an_actions_cost_not_its_sharing():
    prof = uniform_profile(2, fwd_s=F, bwd_s=B)
    plan = Plan([1, 1], 4, 4, checkpoint="never")
    base = simulate(prof, plan)
    scaled = simulate(prof, plan, jitter=Jitter(scale={(0, "F", 2): 3.0}))
    dur = {(r.stage, r.kind, r.microbatch): r.end - r.start for r in scaled.actions.itertuples()}
    assert dur[(0, "F", 2)] == pytest.approx(3 * F)
    assert dur[(0, "F", 1)] == pytest.approx(F) and dur[(1, "F", 2)] == pytest.approx(F)
    assert metrics(scaled).iteration_time_s > metrics(base).iteration_time_s
    # every action on a shared device 1.5x dearer (its overhead too): the device's work
    # is 1.5x, and so is the time of two workers taking it in turns
    gpu = Cluster.shared_gpu(2)
    both = simulate(prof, plan, gpu, jitter=Jitter(scale={(s, k, m): 1.5 for s in (0, 1)
                                                          for k in "FB" for m in range(4)}))
    assert metrics(both).iteration_time_s == pytest.approx(
        1.5 * (2 * 4 * (F + B) + 16 * 20e-6))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"sigma": -0.1}, "sigma"), ({"stragglers": {0: 0.0}}, "straggler"),
    ({"scale": {(0, "F", 0): float("nan")}}, "scale")])
def test_jitter_names_a_bad_factor(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Jitter(**kwargs)


def test_alone_actions_tells_overlap_between_workers_only():
    from pipesim.compare import alone_actions

    actions = pd.DataFrame([
        # iteration, device, stage, microbatch, kind, start, end, nbytes, resource
        (0, 0, 0, 0, "F", 0.0, 1.0, 0, "dev0"),   # alone
        (0, 0, 0, 1, "F", 1.0, 2.0, 0, "dev0"),   # half beside worker 1's F
        (0, 1, 1, 0, "F", 1.5, 3.5, 0, "dev1"),   # a quarter beside worker 0
        (0, 1, 1, 0, "B", 3.5, 4.0, 0, "dev1"),   # after both: alone
        (0, 0, 0, 0, "SEND_F", 1.0, 3.0, 8, "link"),  # a transfer is not compute
    ], columns=["iteration", "device", "stage", "microbatch", "kind", "start", "end", "nbytes",
                "resource"])
    got = alone_actions(Trace(actions)).set_index(["stage", "kind", "microbatch"])
    assert got.loc[(0, "F", 0), "alone"] and got.loc[(1, "B", 0), "alone"]
    assert got.loc[(0, "F", 1), "overlap"] == pytest.approx(0.5)
    assert got.loc[(1, "F", 0), "overlap"] == pytest.approx(0.25)
    assert not got.loc[(0, "F", 1), "alone"] and len(got) == 4


def test_alone_scale_recovers_the_costs_a_run_had_alone():
    """A 'measured' run whose stage-0 actions cost 1.3x the profile: the factors read off
    its lone actions give them back, and the prediction with them is the run."""
    from pipesim.compare import alone_scale

    prof = uniform_profile(2, fwd_s=F, bwd_s=B)
    plan = Plan([1, 1], 4, 4, checkpoint="never", schedule="gpipe")
    truth = {(0, k, m): 1.3 for k in "FB" for m in range(4)}
    measured = simulate(prof, plan, iterations=2, jitter=Jitter(scale=truth))
    predicted = simulate(prof, plan)
    scale, table = alone_scale(predicted, measured, plan)
    # GPipe on two stages: each stage's first forward and last backward run alone
    rows = table.set_index(["stage", "kind"])
    assert rows.loc[(0, "F"), "scale"] == pytest.approx(1.3)
    assert rows.loc[(0, "B"), "scale"] == pytest.approx(1.3)
    assert rows.loc[(1, "F"), "scale"] == pytest.approx(1.0)
    assert scale[(0, "B", 2)] == pytest.approx(1.3)
    again = metrics(simulate(prof, plan, jitter=Jitter(scale=scale))).iteration_time_s
    assert again == pytest.approx(metrics(measured).iteration_time_s)
    # traces of another schedule are refused, named
    from pipesim.errors import PlanError
    other = Plan([1, 1], 4, 4, checkpoint="never", schedule="1f1b")
    with pytest.raises(PlanError, match="different plans"):
        alone_scale(simulate(prof, other), measured, plan)
    with pytest.raises(PlanError, match="1f1b"):
        alone_scale(predicted, measured, other)


def test_cost_biases_pool_each_stages_alone_ratio_over_runs():
    from experiments.error_decomposition import cost_biases

    rows = [{"source": "cpu", "model": "mlp/float32", "first": 0, "stop": 2, "kind": "F",
             "micro_batch": 4, "checkpointed": False, "scale": s} for s in (1.2, 1.25, 1.3)]
    rows.append({**rows[0], "kind": "B", "scale": float("nan")})  # never alone: left out
    got = cost_biases(pd.DataFrame(rows))
    assert len(got) == 1 and got.groups.iloc[0] == 3
    assert got.bias_pct.iloc[0] == pytest.approx(25.0)
    assert 0 < got.scatter_pct.iloc[0] < 5


def test_phase_errors_read_an_iterations_phases_and_what_its_inputs_waited_for():
    from experiments.phase_errors import (
        iteration_figures,
        message_transits,
        summarise,
        trace_figures,
        transit_summary,
    )

    ms = 1e-3
    rows = [  # (device, microbatch, kind, start, end, resource): GPipe, 2 stages, 2 micro-batches
        (0, 0, "F", 0.0, 1.0, "dev0"), (0, 1, "F", 1.2, 2.2, "dev0"),
        (0, 1, "B", 5.0, 6.0, "dev0"), (0, 0, "B", 6.5, 7.5, "dev0"),
        (1, 0, "F", 1.5, 2.5, "dev1"), (1, 1, "F", 3.0, 4.0, "dev1"),
        (1, 1, "B", 4.1, 4.6, "dev1"), (1, 0, "B", 4.7, 5.2, "dev1"),
        # transfers: from the post to the receipt; F(1) on dev1 waits for its output and
        # a skip, the later of the two
        (0, 0, "SEND_F", 1.0, 1.3, "dev0->dev1"), (0, 1, "SEND_F", 2.2, 2.8, "dev0->dev1"),
        (0, 1, "SEND_S", 2.3, 2.9, "dev0->dev1"),
        (1, 1, "SEND_B", 4.6, 4.9, "dev1->dev0"), (1, 0, "SEND_B", 5.2, 6.3, "dev1->dev0")]
    one = pd.DataFrame([(d, d, mb, k, t0 * ms, t1 * ms, res) for d, mb, k, t0, t1, res in rows],
                       columns=["device", "stage", "microbatch", "kind", "start", "end",
                                "resource"])
    figures = iteration_figures(one)
    expected = {"first_forwards": 2.2, "last_forwards": 4.0, "last_backwards": 5.2, "end": 7.5,
                "busy_F_first": 2.0, "busy_F_last": 2.0, "busy_B_first": 2.0,
                "busy_B_last": 1.0,
                # dev0's B(1): ready at 2.2, posted 4.6, in at 4.9, started 5.0; B(0): ready
                # 6.0, posted 5.2, in at 6.3, started 6.5
                "unsent_first": 2.4, "transit_first": 0.6, "after_first": 0.3,
                # dev1's F(1): ready at 2.5, the skip posted 2.3, in at 2.9, started 3.0 (its
                # first forward, ready at its start, adds nothing)
                "unsent_last": 0.0, "transit_last": 0.4, "after_last": 0.1}
    assert figures == pytest.approx(expected)
    # the inputs that came after their receiver was ready, and whether their sender was
    # computing by then (dev1 had begun B(0) at 4.7 when B(1)'s gradient came at 4.9)
    transits = message_transits(one)
    assert list(zip(transits.device, transits.kind, transits.microbatch,
                    transits.sender_computing)) == [(0, "B", 1, True), (0, "B", 0, False),
                                                    (1, "F", 1, False)]
    assert 1e3 * transits.transit_s.to_numpy() == pytest.approx([0.3, 0.3, 0.4])
    by = transit_summary(transits.assign(model="unet", plan="p")).set_index(
        ["device", "sender_computing"])
    assert by.loc[(0, False), "inputs"] == 1 and by.loc[(0, True), "median"] == pytest.approx(0.3)
    # a trace of two iterations: a measured one leaves its first (warm-up) out
    second = one.assign(start=one.start + 0.01, end=one.end + 0.01)
    slower = second.assign(end=second.end + (second.kind == "B") * 0.2 * ms)
    trace = Trace(pd.concat([one.assign(iteration=0), slower.assign(iteration=1)],
                            ignore_index=True))
    assert trace_figures(trace, skip_first=True)["busy_B_last"] == pytest.approx(1.4)
    assert trace_figures(trace, skip_first=False)["busy_B_last"] == pytest.approx(1.2)
    # over runs: medians of the measured, the predicted and of their differences
    table = pd.DataFrame({"run": ["a", "b", "c"], "model": "unet", "plan": "p", "figure": "end",
                          "measured_ms": [10.0, 12.0, 20.0], "predicted_ms": [9.0, 13.0, 15.0]})
    got = summarise(table).iloc[0]
    assert (got.measured_ms, got.predicted_ms, got.difference_ms, got.runs) == (12.0, 13.0, -1.0, 3)


def test_a_grid_reports_its_error_with_the_runs_own_costs_alone():
    """validate.py's table: beside the prediction, the same model with each action at the
    cost it had alone in the run -- here the whole of the error, which is stage 0's."""
    from experiments.validation import predicted_against, summarise

    prof = uniform_profile(2, fwd_s=F, bwd_s=B)
    plans = [Plan([1, 1], m, 4, checkpoint="never", schedule="gpipe") for m in (2, 4)]
    truth = {(0, k, mb): 1.3 for k in "FB" for mb in range(4)}
    measured = [simulate(prof, p, iterations=2, jitter=Jitter(scale=truth)) for p in plans]
    table = predicted_against(prof, plans, Cluster.free(2), measured, "uniform")
    assert (table.predicted_ms < table.measured_ms).all()
    assert table.alone_costs_ms.to_numpy() == pytest.approx(table.measured_ms.to_numpy())
    figures = summarise(table)
    assert figures["alone_costs_median_abs_error_pct"] == pytest.approx(0.0, abs=1e-6)
    assert figures["median_abs_error_pct"] > 5


def test_replay_on_a_shared_gpu_does_not_share_the_device_again():
    """A run's durations already hold what sharing the GPU did to them: replaying a
    trace of that very cluster gives it back, not a second slowdown."""
    from experiments.validation import replay_error

    prof = uniform_profile(2, fwd_s=F, bwd_s=B)
    plan = Plan([1, 1], 4, 4, checkpoint="never", schedule="gpipe")
    gpu = dataclasses.replace(Cluster.shared_gpu(2), device_speedup=[1.0, 1.5])
    measured = simulate(prof, plan, gpu)
    assert replay_error(prof, plan, measured, gpu) == pytest.approx(0.0, abs=1e-9)


# ------------------------------------------------------------------ properties
@st.composite
def scenarios(draw):
    n_layers = draw(st.integers(2, 8))
    sizes = (1, 4)
    rows = []
    for layer in range(n_layers):
        f = draw(st.floats(0.01, 2.0))
        b = draw(st.floats(0.01, 4.0))
        out = draw(st.integers(0, 500))
        for s in sizes:
            rows.append(dict(layer=layer, name="X", micro_batch=s, fwd_s=f * s, bwd_s=b * s,
                             input_bytes=out * s, output_bytes=out * s, saved_bytes=2 * out * s,
                             saved_input_bytes=out * s, saved_output_bytes=0, param_bytes=100))
    prof = Profile(pd.DataFrame(rows))
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved"]))
    v = 2 if schedule == "interleaved" else 1
    n_dev = draw(st.integers(1, max(1, n_layers // v)))
    n_stages = n_dev * v
    cuts = sorted(draw(st.lists(st.integers(1, n_layers - 1), min_size=n_stages - 1,
                                max_size=n_stages - 1, unique=True)))
    bounds = [0, *cuts, n_layers]
    balance = [bounds[i + 1] - bounds[i] for i in range(n_stages)]
    m = draw(st.integers(1, 6)) * (n_dev if schedule == "interleaved" else 1)
    batch = m * draw(st.integers(1, 4))
    checkpoint = draw(st.sampled_from(["always", "except_last", "never"]))
    plan = Plan(balance, m, batch, checkpoint=checkpoint, schedule=schedule, virtual_stages=v)
    cluster = Cluster([Device(f"d{i}") for i in range(n_dev)],
                      link=Link(draw(st.floats(0, 0.5)), draw(st.floats(100.0, 1e5))))
    return prof, plan, cluster


def _no_overlap(frame):
    for _, part in frame.groupby("resource"):
        part = part.sort_values("start")
        assert (part["start"].to_numpy()[1:] >= part["end"].to_numpy()[:-1] - 1e-9).all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_property_resources_never_overlap_and_dependencies_hold(case):
    prof, plan, cluster = case
    a = simulate(prof, plan, cluster).actions
    compute = a[a.kind.isin(["F", "B"])]
    _no_overlap(compute)
    sends = a[a.kind.str.startswith("SEND")].copy()
    sends["end"] -= cluster.link.latency_s  # latency delays arrival, it does not hold the link
    _no_overlap(sends)
    done = {(r.stage, r.kind, r.microbatch): r.end for r in compute.itertuples()}
    arrive = {(r.stage, r.kind, r.microbatch): r.end for r in a[a.kind.str.startswith("SEND")].itertuples()}
    n = plan.n_stages
    for r in compute.itertuples():
        s, mb = r.stage, r.microbatch
        if r.kind == "F" and s > 0:
            ready = arrive.get((s - 1, "SEND_F", mb), done[(s - 1, "F", mb)])
            assert r.start >= ready - 1e-9
        if r.kind == "B":
            assert r.start >= done[(s, "F", mb)] - 1e-9
            if s < n - 1:
                ready = arrive.get((s + 1, "SEND_B", mb), done[(s + 1, "B", mb)])
                assert r.start >= ready - 1e-9


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_property_iteration_time_is_at_least_the_critical_path(case):
    prof, plan, cluster = case
    trace = simulate(prof, plan, cluster)
    got = metrics(trace)
    a = trace.actions
    dur = (a.end - a.start).where(a.kind.isin(["F", "B"]), 0.0)
    # every device's own work, and every micro-batch's chain through all stages
    assert got.iteration_time_s >= max(got.busy_s.values()) - 1e-9
    chain = dur.groupby(a.microbatch).sum().max()
    assert got.iteration_time_s >= chain - 1e-9


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.floats(0.0, 3.0), st.integers(0, 10_000))
def test_property_longer_tasks_never_shorten_the_iteration(case, extra, pick):
    prof, plan, _ = case
    cluster = Cluster.free(plan.n_devices)  # max-plus system: monotone by construction
    base_trace = simulate(prof, plan, cluster)
    base = metrics(base_trace).iteration_time_s
    rows = base_trace.actions[base_trace.actions.kind.isin(["F", "B"])]
    durations = {(r.stage, r.kind, r.microbatch): r.end - r.start for r in rows.itertuples()}
    key = sorted(durations)[pick % len(durations)]
    durations[key] += extra
    slower = metrics(simulate(prof, plan, cluster, durations=durations)).iteration_time_s
    assert slower >= base - 1e-9


def test_replaying_own_durations_reproduces_the_trace():
    prof = uniform_profile(4)
    plan = Plan([1] * 4, 4, 8, checkpoint="except_last", schedule="1f1b")
    first = simulate(prof, plan, Cluster.cpu_processes(4))
    rows = first.actions[first.actions.kind.isin(["F", "B"])]
    durations = {(r.stage, r.kind, r.microbatch): r.end - r.start for r in rows.itertuples()}
    again = simulate(prof, plan, Cluster.cpu_processes(4), durations=durations)
    assert np.allclose(first.actions.end, again.actions.end)


def test_action_gap_delays_starts_without_counting_as_busy():
    prof = uniform_profile(2)
    plan = Plan([1, 1], 4, 4, checkpoint="never")
    plain = metrics(simulate(prof, plan))
    gap = metrics(simulate(prof, plan, Cluster([Device("a"), Device("b")], action_gap_s=0.5)))
    assert gap.busy_s == plain.busy_s
    # the critical path holds 2 (m + n - 1) actions; the iteration is measured from the
    # first action's start, so all but the first gap lengthen it
    assert gap.iteration_time_s == pytest.approx(plain.iteration_time_s + 0.5 * (2 * (4 + 2 - 1) - 1))


def test_a_worker_blocked_on_its_input_starts_the_wakeup_gap_after_it_arrives():
    prof = uniform_profile(2)  # F = 1 s, B = 2 s a sample and layer
    plan = Plan([1, 1], 1, 1, checkpoint="never")
    gap, wakeup = 0.1, 0.3
    trace = simulate(prof, plan, Cluster([Device("a"), Device("b")], action_gap_s=gap,
                                         wakeup_gap_s=wakeup))
    a = trace.actions.set_index(["stage", "kind"])
    # worker 0 reaches F(0) with its input there; worker 1 waits for F(0)'s output and is
    # woken; B(1) follows F(1) on its worker; worker 0 waits for B(1)'s gradient
    assert a.loc[(0, "F"), "start"] == pytest.approx(a.start.min())
    assert a.loc[(1, "F"), "start"] == pytest.approx(a.loc[(0, "F"), "end"] + wakeup)
    assert a.loc[(1, "B"), "start"] == pytest.approx(a.loc[(1, "F"), "end"] + gap)
    assert a.loc[(0, "B"), "start"] == pytest.approx(a.loc[(1, "B"), "end"] + wakeup)
    # no wake-up gap given: the gap between actions for both (clusters saved before it)
    one = simulate(prof, plan, Cluster([Device("a"), Device("b")], action_gap_s=gap))
    same = simulate(prof, plan, Cluster([Device("a"), Device("b")], action_gap_s=gap,
                                        wakeup_gap_s=gap))
    assert np.allclose(one.actions.end, same.actions.end)


def test_wakeup_gap_is_validated_and_round_trips(tmp_path):
    from pipesim.errors import ClusterError

    with pytest.raises(ClusterError, match="wakeup_gap_s"):
        Cluster([Device("a")], wakeup_gap_s=-1e-3)
    c = Cluster([Device("a"), Device("b")], action_gap_s=1e-4, wakeup_gap_s=6e-4)
    assert Cluster.load(c.save(tmp_path / "c.json")).wakeup_gap_s == 6e-4
    old = c.to_dict()
    del old["wakeup_gap_s"]  # a file written before the wake-up gap existed
    assert Cluster.from_dict(old).wakeup_gap_s is None


def test_host_contention_shares_the_processor_only_while_actions_overlap():
    prof = uniform_profile(2)  # F = 1 s per sample and layer
    plan = Plan([1, 1], 2, 2, checkpoint="never")
    alone = [Device("a", host="h"), Device("b", host="h")]
    trace = simulate(prof, plan, Cluster(alone, host_contention=0.5))
    f = trace.actions.query("kind == 'F'").set_index(["stage", "microbatch"])
    assert f.loc[(0, 0), "end"] == pytest.approx(1.0)  # runs alone: full speed
    # stage 0's F1 and stage 1's F0 run together from t=1 at 1/(1+0.5) speed: 1.5 s each
    assert f.loc[(0, 1), "end"] == pytest.approx(2.5)
    assert f.loc[(1, 0), "end"] == pytest.approx(2.5)
    apart = [Device("a", host="h1"), Device("b", host="h2")]
    assert metrics(simulate(prof, plan, Cluster(apart, host_contention=0.5))).iteration_time_s == (
        pytest.approx(metrics(simulate(prof, plan)).iteration_time_s))


def test_a_span_slowed_beside_the_others_pays_the_larger_of_its_reading_and_the_host_law():
    from pipesim.readings import SpanSlowdown

    prof = uniform_profile(2)  # F = 1 s per sample and layer
    plan = Plan([1, 1], 2, 2, checkpoint="never")
    host = [Device("a", host="h"), Device("b", host="h")]
    # stage 0 (layer [0, 1)) measured 2x slower beside the other rank, stage 1 1.25x,
    # where the host law (0.5) gives 1.5x: stage 0 pays its reading, stage 1 the law's
    measured = (SpanSlowdown(0, 1, 1, 2.0), SpanSlowdown(1, 2, 1, 1.25))
    trace = simulate(prof, plan, Cluster(host, host_contention=0.5, host_slowdowns=measured))
    f = trace.actions.query("kind == 'F'").set_index(["stage", "microbatch"])
    assert f.loc[(0, 0), "end"] == pytest.approx(1.0)  # alone: full speed
    # from t=1 stage 0's F1 runs at 1/2 and stage 1's F0 at 1/1.5: F0 of stage 1 ends at
    # 1 + 1.5; F1 of stage 0 has done 0.75 s of work by then, the remaining 0.25 s alone
    assert f.loc[(1, 0), "end"] == pytest.approx(2.5)
    assert f.loc[(0, 1), "end"] == pytest.approx(2.5 + 0.25)
    # (measured slowdowns alone, no host_contention, share the host just the same)
    alone = simulate(prof, plan, Cluster(host, host_slowdowns=measured)).actions
    assert alone.query("kind == 'F' and stage == 1").end.min() == pytest.approx(2.25)
    # a span not measured has the host law alone
    partly = Cluster(host, host_contention=0.5, host_slowdowns=measured[:1])
    f = simulate(prof, plan, partly).actions.query("kind == 'F'").set_index(["stage", "microbatch"])
    assert f.loc[(1, 0), "end"] == pytest.approx(1.0 + 1.5)
    # a replay's measured durations have their contention in them already
    durations = {(s, k, mb): 1.0 for s in (0, 1) for k in ("F", "B") for mb in (0, 1)}
    replay = simulate(prof, plan, Cluster(host, host_slowdowns=measured), durations=durations)
    assert (replay.actions.end - replay.actions.start).max() == pytest.approx(1.0)


def test_a_reading_is_read_linear_in_log2_size_between_its_sizes_and_flat_beyond():
    from pipesim.readings import InPlaceCost, in_log2_size, read_curve, span_at

    points = [(2, 1.0), (8, 3.0)]
    assert in_log2_size(points, 4) == pytest.approx(2.0)  # log2: 1 -> 2 -> 3
    assert in_log2_size(points, 2 * 2 ** 0.5) == pytest.approx(1.5)
    assert in_log2_size(points, 1) == in_log2_size(points, 2) == 1.0  # the nearest beyond
    assert in_log2_size(points, 64) == 3.0
    assert in_log2_size([(4, 5.0)], 1) == in_log2_size([(4, 5.0)], 16) == 5.0  # one size
    # a span's rows only, in any order; None where the span has none
    rows = [InPlaceCost(0, 3, 8, False, 3.0, 0.0), InPlaceCost(3, 6, 4, False, 9.0, 0.0),
            InPlaceCost(0, 3, 2, False, 1.0, 0.0)]
    assert span_at(rows, 0, 3, 4, lambda x: x.fwd_s) == pytest.approx(2.0)
    assert span_at(rows, 3, 6, 1, lambda x: x.fwd_s) == 9.0
    assert span_at(rows, 0, 6, 4, lambda x: x.fwd_s) is None
    # a curve (a wake-up after a wait, seconds) is linear in its own x, flat beyond
    curve = ((0.0, 0.0), (1e-3, 2e-4), (1e-2, 5e-4))
    assert read_curve(curve, 5e-4) == pytest.approx(1e-4)
    assert read_curve(curve, 5.5e-3) == pytest.approx(3.5e-4)
    assert read_curve(curve, 1.0) == pytest.approx(5e-4)


def test_host_slowdowns_interpolate_in_log_size_are_validated_and_round_trip(tmp_path):
    from pipesim.errors import ClusterError
    from pipesim.readings import SpanSlowdown

    c = Cluster([Device("a"), Device("b")], host_slowdowns=(
        SpanSlowdown(0, 3, 2, 1.1), SpanSlowdown(0, 3, 8, 1.3), SpanSlowdown(3, 6, 2, 1.0)))
    assert c.host_slowdown(0, 3, 4) == pytest.approx(1.2)  # halfway in log2(size)
    assert c.host_slowdown(0, 3, 1) == pytest.approx(1.1)  # the nearest beyond the sizes
    assert c.host_slowdown(0, 3, 32) == pytest.approx(1.3)
    assert c.host_slowdown(0, 2, 4) is None  # another span: not measured
    assert Cluster.load(c.save(tmp_path / "c.json")).host_slowdowns == c.host_slowdowns
    with pytest.raises(ClusterError, match=r"layers \[0, 3\) at 2 samples must be >= 1"):
        Cluster([Device("a")], host_slowdowns=(SpanSlowdown(0, 3, 2, 0.9),))


def test_repeated_in_place_readings_keep_each_spans_median_and_refuse_mixed_layouts():
    from pipesim.errors import ClusterError
    from pipesim.readings import SpanSlowdown, median_slowdowns

    def reading(a: float, b: float) -> list[SpanSlowdown]:
        return [SpanSlowdown(0, 4, 2, a), SpanSlowdown(4, 8, 2, b)]

    # one reading in a slow spell reads the whole layout high: the median drops it
    spell = [reading(1.1, 1.2), reading(1.6, 1.7), reading(1.15, 1.1)]
    assert median_slowdowns(spell) == reading(1.15, 1.2)
    assert median_slowdowns(spell[:1]) == spell[0]  # one reading: itself
    # rows in another order are the same spans
    two = median_slowdowns([reading(1.0, 1.3), reading(1.2, 1.1)[::-1]])
    assert [(s.first, s.stop, s.micro_batch) for s in two] == [(0, 4, 2), (4, 8, 2)]
    assert [s.slowdown for s in two] == pytest.approx([1.1, 1.2])  # two: their mean
    with pytest.raises(ClusterError, match="at least one reading"):
        median_slowdowns([])
    other = [SpanSlowdown(0, 3, 2, 1.0), SpanSlowdown(3, 8, 2, 1.0)]
    with pytest.raises(ClusterError, match=r"reading 1 covers spans and sizes \[\(0, 3, 2\)"):
        median_slowdowns([reading(1.0, 1.0), other])


def test_a_backward_after_its_worker_idled_pays_the_idle_cost_measured_for_its_span():
    from pipesim.readings import IdleCost

    prof = uniform_profile(2)  # F = 1 s, B = 2 s per sample and layer
    plan = Plan([1, 1], 2, 2, checkpoint="never", schedule="gpipe")
    # stage 0 (layer [0, 1)) at 1 sample: +0.5 s after 1 s idle, +1 s after 4 s or more
    measured = (IdleCost(0, 1, 1, False, 1.0, 0.5), IdleCost(0, 1, 1, False, 4.0, 1.0))
    cluster = Cluster([Device("a"), Device("b")], idle_costs=measured)
    assert cluster.idle_cost(0, 1, 1, False) == ((0.0, 0.0), (1.0, 0.5), (4.0, 1.0))
    actions = simulate(prof, plan, cluster).actions.sort_values("start")
    compute = actions[actions.kind.isin(["F", "B"])]
    dev0 = compute[compute.stage == 0].reset_index(drop=True)
    backwards = dev0.index[dev0.kind == "B"]
    for i in backwards:
        idle = dev0.start[i] - dev0.end[i - 1]
        extra = np.interp(idle, [0.0, 1.0, 4.0], [0.0, 0.5, 1.0])  # 1.0 beyond 4 s
        assert dev0.end[i] - dev0.start[i] == pytest.approx(2.0 + extra)
    # GPipe: stage 0's first backward waits from its last forward's end (t=2) for stage 1's
    # first backward (t=3..5): 3 s idle, +0.5 + 2/6 s; its second backward follows at once
    first = backwards[0]
    assert dev0.start[first] - dev0.end[first - 1] == pytest.approx(3.0)
    assert dev0.end[first] - dev0.start[first] == pytest.approx(2.0 + 0.5 + 2 / 6)
    assert dev0.end[backwards[1]] - dev0.start[backwards[1]] == pytest.approx(2.0)
    # stage 1 was not measured: its backwards keep their profile; so do checkpointed
    # micro-batches (measured apart) and a replay's durations
    other = compute[(compute.stage == 1) & (compute.kind == "B")]
    assert (other.end - other.start).tolist() == pytest.approx([2.0, 2.0])
    ckpt = Plan([1, 1], 2, 2, checkpoint="always", schedule="gpipe")
    assert metrics(simulate(prof, ckpt, cluster)).iteration_time_s == pytest.approx(
        metrics(simulate(prof, ckpt, Cluster([Device("a"), Device("b")]))).iteration_time_s)
    durations = {(s, k, mb): 1.0 for s in (0, 1) for k in ("F", "B") for mb in (0, 1)}
    replay = simulate(prof, plan, cluster, durations=durations).actions
    assert (replay.end - replay.start).max() == pytest.approx(1.0)


def test_a_forward_right_after_a_backward_that_waited_pays_the_curve_measured_for_it():
    # 1F1B: stage 0's backward waits for its gradient, then its next forward follows at
    # once; that forward pays the "FB" curve at the backward's wait (what it touches
    # faded meanwhile), where without one it pays its own curve at the gap before it (none)
    from pipesim.readings import IdleCost

    prof = uniform_profile(2)  # F = 1 s, B = 2 s per sample and layer
    plan = Plan([1, 1], 4, 4, checkpoint="never", schedule="1f1b")
    # stage 0's forward at 1 sample: +0.1 s after 1 s idle before it; right after a
    # backward that waited 1 s, +0.5 s, and 4 s or more, +1 s
    own = (IdleCost(0, 1, 1, False, 1.0, 0.1, "F"), IdleCost(0, 1, 1, False, 4.0, 0.1, "F"))
    after = (IdleCost(0, 1, 1, False, 1.0, 0.5, "FB"), IdleCost(0, 1, 1, False, 4.0, 1.0, "FB"))

    def stage0(rows: tuple) -> pd.DataFrame:
        a = simulate(prof, plan, Cluster([Device("a"), Device("b")], idle_costs=rows)).actions
        return a[a.kind.isin(["F", "B"]) & (a.stage == 0)].sort_values("start").reset_index(
            drop=True)

    plain, measured = stage0(own), stage0(own + after)
    # F0 F1 B0 F2 B1 F3 B2 B3: B0 waits 2..4 s for stage 1's first backward, F2 follows it
    assert measured.kind.tolist() == list("FFBFBFBB")
    assert measured.start[2] - measured.end[1] == pytest.approx(2.0)
    assert measured.start[3] == pytest.approx(measured.end[2])
    assert plain.end[3] - plain.start[3] == pytest.approx(1.0)  # no wait just before it
    assert measured.end[3] - measured.start[3] == pytest.approx(1.0 + 0.5 + 0.5 / 3)
    # every forward after a backward: the larger of its own wait's and the backward's
    for i in range(1, len(measured)):
        if measured.kind[i] == "F" and measured.kind[i - 1] == "B":
            gap = measured.start[i] - measured.end[i - 1]
            waited = measured.start[i - 1] - measured.end[i - 2]
            extra = max(np.interp(gap, [0.0, 1.0, 4.0], [0.0, 0.1, 0.1]),
                        np.interp(waited, [0.0, 1.0, 4.0], [0.0, 0.5, 1.0]))
            assert measured.end[i] - measured.start[i] == pytest.approx(1.0 + extra)
    # (the backwards were not measured: their profile either way); a cluster's file
    # keeps the curve
    assert set((measured.end - measured.start)[measured.kind == "B"].round(9)) == {2.0}
    c = Cluster([Device("a")], idle_costs=after)
    assert Cluster.from_dict(c.to_dict()).idle_cost(0, 1, 1, False, "FB") == (
        (0.0, 0.0), (1.0, 0.5), (4.0, 1.0))


def test_an_idle_cost_is_not_paid_where_another_stage_thread_kept_the_shared_core_busy():
    # the same plan and idle curve: each worker on a core of its own pays it after its own
    # wait; two workers taking turns on one core do not, the core never idling (on the
    # 2-core VM a stage thread's forward after the other's on the same core took 1.04x the
    # steady pace of one thread running both, 1.12x on another core:
    # experiments/wait_placement.py)
    from pipesim.readings import IdleCost

    prof = uniform_profile(2)  # F = 1 s, B = 2 s per sample and layer
    plan = Plan([1, 1], 1, 1, checkpoint="never", schedule="gpipe")
    measured = (IdleCost(0, 1, 1, False, 1.0, 0.5), IdleCost(0, 1, 1, False, 4.0, 1.0))

    def stage0_backward(cores: int) -> tuple[float, float]:
        cluster = dataclasses.replace(Cluster.cpu_threads(2, cores=cores),
                                      compute_overhead_s=0.0, idle_costs=measured)
        b = simulate(prof, plan, cluster).actions.query("kind == 'B' and stage == 0")
        return float(b.start.iloc[0]), float(b.end.iloc[0] - b.start.iloc[0])

    # own cores: F0 0..1, F1 1..2, B1 2..4, then B0 after 3 s of its core idle: +0.5 + 2/6
    assert stage0_backward(2) == pytest.approx((4.0, 2.0 + 0.5 + 2 / 6))
    # one core: the same turns, the core busy with stage 1 until B0 starts: its profile
    assert stage0_backward(1) == pytest.approx((4.0, 2.0))
    # nor a curve's value at no idle (read against the profile's regime, the in-place
    # pace): there the action runs at the profile's
    anchored = tuple(dataclasses.replace(c, hot_s=1.5, profile_s=2.0) for c in measured)
    cluster = dataclasses.replace(Cluster.cpu_threads(2, cores=1), compute_overhead_s=0.0,
                                  idle_costs=anchored)
    b = simulate(prof, plan, cluster).actions.query("kind == 'B' and stage == 0")
    assert float(b.end.iloc[0] - b.start.iloc[0]) == pytest.approx(2.0)


def test_idle_costs_are_read_against_the_profiles_own_regime_where_it_was_measured():
    from pipesim.readings import IdleCost

    prof = uniform_profile(2)  # F = 1 s, B = 2 s per sample and layer
    plan = Plan([1, 1], 2, 2, checkpoint="never", schedule="gpipe")
    # stage 1's forward: 0.5 s at once where the same session's profile gave 1 s; +0.25 s
    # after 1 s idle, +0.5 s after 4 s: its profile less 0.5 s at no idle, less 0.25 after 1
    rows = tuple(IdleCost(1, 2, 1, False, idle, extra, "F", hot_s=0.5, profile_s=1.0)
                 for idle, extra in ((1.0, 0.25), (4.0, 0.5)))
    cluster = Cluster([Device("a"), Device("b")], idle_costs=rows)
    assert cluster.idle_cost(1, 2, 1, False, "F") == ((0.0, -0.5), (1.0, -0.25), (4.0, 0.0))
    f = simulate(prof, plan, cluster).actions.query("kind == 'F'").set_index(
        ["stage", "microbatch"])
    # its first forward has no action before it on its worker: its profile
    assert f.loc[(1, 0), "end"] - f.loc[(1, 0), "start"] == pytest.approx(1.0)
    # its second's input lands (t=2) as the first ends: no idle, 0.5 s less
    assert f.loc[(1, 1), "start"] == pytest.approx(2.0)
    assert f.loc[(1, 1), "end"] - f.loc[(1, 1), "start"] == pytest.approx(0.5)
    # stage 0 was not measured: its profile
    assert f.loc[(0, 1), "end"] - f.loc[(0, 1), "start"] == pytest.approx(1.0)
    # without the profile's seconds the curve is read as measured, from 0
    plain = Cluster([Device("a"), Device("b")], idle_costs=tuple(
        IdleCost(1, 2, 1, False, idle, extra, "F", hot_s=0.5) for idle, extra in
        ((1.0, 0.25), (4.0, -0.1))))
    assert plain.idle_cost(1, 2, 1, False, "F") == ((0.0, 0.0), (1.0, 0.25), (4.0, 0.0))


def test_idle_costs_interpolate_in_log_size_are_validated_and_round_trip(tmp_path):
    from pipesim.errors import ClusterError
    from pipesim.readings import IdleCost

    c = Cluster([Device("a"), Device("b")], idle_costs=(
        IdleCost(0, 3, 2, False, 0.01, 1e-3), IdleCost(0, 3, 8, False, 0.01, 3e-3),
        IdleCost(0, 3, 2, True, 0.01, 5e-3)))
    curve = c.idle_cost(0, 3, 4, False)
    assert len(curve) == 2 and curve[0] == (0.0, 0.0)  # nothing at no idle
    assert curve[1] == (0.01, pytest.approx(2e-3))  # halfway in log2(size) at 4 samples
    assert c.idle_cost(0, 3, 32, False)[1][1] == pytest.approx(3e-3)  # the nearest size's
    assert c.idle_cost(0, 3, 4, True)[1][1] == pytest.approx(5e-3)
    assert c.idle_cost(3, 6, 4, False) == ()  # another span: not measured
    assert Cluster.load(c.save(tmp_path / "c.json")).idle_costs == c.idle_costs
    with pytest.raises(ClusterError, match=r"layers \[0, 3\) at 2 samples needs idle_s > 0"):
        Cluster([Device("a")], idle_costs=(IdleCost(0, 3, 2, False, 0.0, 1e-3),))
    with pytest.raises(ClusterError, match=r"kind 'F', 'B' or 'FB', got 0\.01, 0\.001 and 'W'"):
        Cluster([Device("a")], idle_costs=(IdleCost(0, 3, 2, False, 0.01, 1e-3, "W"),))


def test_a_run_of_forwards_or_backwards_costs_the_scale_measured_for_its_order():
    # GPipe: each stage's forwards follow forwards, its backwards backwards (but the
    # first of each); 1F1B's steady forwards follow backwards and keep their profile
    from pipesim.readings import RunOnCost

    prof = uniform_profile(2)  # F = 1 s, B = 2 s per sample and layer
    runs = (RunOnCost(0, 1, 1, False, "F", 0.5), RunOnCost(0, 1, 1, False, "B", 0.75),
            RunOnCost(1, 2, 1, False, "F", 0.5))
    cluster = Cluster([Device("a"), Device("b")], run_on_costs=runs)

    def durations(schedule: str) -> pd.DataFrame:
        plan = Plan([1, 1], 4, 4, checkpoint="never", schedule=schedule)
        a = simulate(prof, plan, cluster).actions
        a = a[a.kind.isin(["F", "B"])].sort_values("start").copy()
        a["before"] = a.groupby("stage").kind.shift(1)
        a["seconds"] = a.end - a.start
        return a

    gpipe = durations("gpipe")
    for (stage, kind, before), want in {(0, "F", "F"): 0.5, (1, "F", "F"): 0.5,
                                        (0, "B", "B"): 1.5, (1, "B", "B"): 2.0,
                                        (0, "B", "F"): 2.0, (1, "B", "F"): 2.0}.items():
        rows = gpipe[(gpipe.stage == stage) & (gpipe.kind == kind) & (gpipe.before == before)]
        assert len(rows) and rows.seconds.tolist() == pytest.approx([want] * len(rows))
    firsts = gpipe[gpipe.before.isna()]  # each stage's first forward: nothing before it
    assert firsts.seconds.tolist() == pytest.approx([1.0, 1.0])
    f1b = durations("1f1b")
    after_backward = f1b[(f1b.kind == "F") & (f1b.before == "B")]
    assert len(after_backward) and after_backward.seconds.tolist() == pytest.approx(
        [1.0] * len(after_backward))
    # GPipe: stage 1's forwards 1 + 3 x 0.5 s, its backwards 4 x 2 s, after stage 0's
    # first forward (1 s); stage 0's last backward ends 1.5 s after stage 1's last
    gpipe_plan = Plan([1, 1], 4, 4, checkpoint="never", schedule="gpipe")
    assert metrics(simulate(prof, gpipe_plan, cluster)).iteration_time_s == pytest.approx(
        1.0 + 2.5 + 8.0 + 1.5)
    # a replay's durations are the run's own: no scale on them
    replay = simulate(prof, gpipe_plan, cluster,
                      durations={(s, k, mb): 1.0 for s in (0, 1) for k in ("F", "B")
                                 for mb in range(4)}).actions
    assert (replay.end - replay.start).max() == pytest.approx(1.0)


def test_run_on_costs_interpolate_in_log_size_are_validated_and_round_trip(tmp_path):
    from pipesim.errors import ClusterError
    from pipesim.readings import RunOnCost

    c = Cluster([Device("a"), Device("b")], run_on_costs=(
        RunOnCost(0, 3, 2, False, "F", 0.6), RunOnCost(0, 3, 8, False, "F", 0.9),
        RunOnCost(0, 3, 2, True, "F", 0.8), RunOnCost(0, 3, 2, False, "B", 0.95)))
    assert c.run_on_scale(0, 3, 4, False, "F") == pytest.approx(0.75)  # halfway in log2
    assert c.run_on_scale(0, 3, 32, False, "F") == pytest.approx(0.9)  # the nearest size's
    assert c.run_on_scale(0, 3, 4, True, "F") == pytest.approx(0.8)
    assert c.run_on_scale(0, 3, 4, False, "B") == pytest.approx(0.95)
    assert c.run_on_scale(3, 6, 4, False, "F") == 1.0  # another span: not measured
    assert c.run_on_scale(0, 3, 4, True, "B") == 1.0  # nor that mode and kind
    assert Cluster.load(c.save(tmp_path / "c.json")).run_on_costs == c.run_on_costs
    with pytest.raises(ClusterError, match=r"layers \[0, 3\) at 2 samples needs .* got 0\.0 and 'F'"):
        Cluster([Device("a")], run_on_costs=(RunOnCost(0, 3, 2, False, "F", 0.0),))
    with pytest.raises(ClusterError, match=r"kind 'F' or 'B', got 0\.9 and 'W'"):
        Cluster([Device("a")], run_on_costs=(RunOnCost(0, 3, 2, False, "W", 0.9),))


def test_a_checkpointed_backward_without_an_idle_curve_costs_its_plain_one_and_the_extra_measured():
    from pipesim.readings import CheckpointExtra, IdleCost

    prof = uniform_profile(2)  # F = 1 s, B = 2 s per sample and layer
    plan = Plan([1, 1], 1, 1, checkpoint="always", schedule="gpipe")

    def backwards(cluster: Cluster) -> list[float]:
        b = simulate(prof, plan, cluster).actions.query("kind == 'B'").sort_values("stage")
        return (b.end - b.start).tolist()

    two = [Device("a"), Device("b")]
    # the profile's: the plain backward (2 s) and the recomputation (1 s)
    assert backwards(Cluster(two)) == pytest.approx([3.0, 3.0])
    # measured in place: checkpointing adds 0.5 s to the last stage's backward, 4 s to
    # the first's -- which has an idle curve, so it is read in place already
    curve = (IdleCost(0, 1, 1, True, 1.0, 0.0),)
    extras = (CheckpointExtra(1, 2, 1, 0.5), CheckpointExtra(0, 1, 1, 4.0))
    assert backwards(Cluster(two, checkpoint_extras=extras, idle_costs=curve)) == \
        pytest.approx([3.0, 2.5])
    assert backwards(Cluster(two, checkpoint_extras=extras)) == pytest.approx([6.0, 2.5])
    # plain micro-batches and a replay's durations are not touched
    never = Plan([1, 1], 1, 1, checkpoint="never", schedule="gpipe")
    assert metrics(simulate(prof, never, Cluster(two, checkpoint_extras=extras))) \
        .iteration_time_s == pytest.approx(metrics(simulate(prof, never, Cluster(two)))
                                           .iteration_time_s)
    durations = {(s, k, 0): 1.0 for s in (0, 1) for k in ("F", "B")}
    replay = simulate(prof, plan, Cluster(two, checkpoint_extras=extras), durations=durations)
    assert (replay.actions.end - replay.actions.start).max() == pytest.approx(1.0)


def test_a_checkpointed_backward_measured_below_its_forward_and_backward_keeps_the_saving():
    # a GPU at 8-32 samples: the checkpointed backward (recomputation + backward) measures
    # less than the plain forward and backward it stands for.  The saving is kept as far
    # as the whole model, checkpointed as one call, measured one too, never beyond half
    # the span's forward (a recomputation is one)
    prof = uniform_profile(2)  # F = 1 s, B = 2 s per sample and layer; sizes 1 and 64

    def with_extra(layer_extra: float, whole_extra: float | None = None) -> Profile:
        table = prof.table.assign(ckpt_fwd_s=prof.table.fwd_s,
                                  ckpt_bwd_s=prof.table.fwd_s + prof.table.bwd_s + layer_extra)
        whole = {str(b): {"fwd_s": 2.0 * b, "bwd_s": 4.0 * b, "ckpt_fwd_s": 2.0 * b,
                          "ckpt_bwd_s": 6.0 * b + (2 * layer_extra if whole_extra is None
                                                   else whole_extra)} for b in (1, 64)}
        return Profile(table, {**prof.meta, "whole_model": whole}, prof.source)

    plan = Plan([1, 1], 1, 1, checkpoint="always", schedule="gpipe")

    def backwards(p: Profile) -> list[float]:
        b = simulate(p, plan, Cluster([Device("a"), Device("b")])).actions.query("kind == 'B'")
        return (b.end - b.start).tolist()

    assert backwards(with_extra(0.0)) == pytest.approx([3.0, 3.0])
    assert backwards(with_extra(+0.25)) == pytest.approx([3.25, 3.25])
    assert backwards(with_extra(-0.25)) == pytest.approx([2.75, 2.75])
    assert with_extra(-0.25).checkpoint_saving(1) == pytest.approx((0.0, 0.25))
    # the layers read a saving the whole model does not: none is kept
    assert backwards(with_extra(-0.25, whole_extra=0.0)) == pytest.approx([3.0, 3.0])
    # nor without a whole-model reading
    bare = with_extra(-0.25)
    bare = Profile(bare.table, {"device": "synthetic"}, bare.source)
    assert backwards(bare) == pytest.approx([3.0, 3.0])
    assert backwards(with_extra(-2.5)) == pytest.approx([2.5, 2.5])  # half the forward
    span = with_extra(-0.25).span_cost(0, 2, 1)
    assert (span.ckpt_fwd_extra_s, span.ckpt_bwd_extra_s) == pytest.approx((0.0, -0.5))


def test_checkpoint_extras_interpolate_in_log_size_are_validated_and_round_trip(tmp_path):
    from pipesim.errors import ClusterError
    from pipesim.readings import CheckpointExtra

    c = Cluster([Device("a"), Device("b")], checkpoint_extras=(
        CheckpointExtra(0, 3, 2, 1e-3), CheckpointExtra(0, 3, 8, 3e-3),
        CheckpointExtra(3, 6, 2, -1e-4)))
    assert c.checkpoint_extra(0, 3, 4) == pytest.approx(2e-3)  # halfway in log2(size)
    assert c.checkpoint_extra(0, 3, 32) == pytest.approx(3e-3)  # the nearest size's
    assert c.checkpoint_extra(3, 6, 2) == 0.0  # below 0: noise
    assert c.checkpoint_extra(1, 3, 2) is None  # another span: not measured
    assert Cluster.load(c.save(tmp_path / "c.json")).checkpoint_extras == c.checkpoint_extras
    with pytest.raises(ClusterError, match=r"layers \[0, 3\) needs a micro-batch >= 1 and "
                                           r"finite seconds, got 2 and nan"):
        Cluster([Device("a")], checkpoint_extras=(CheckpointExtra(0, 3, 2, float("nan")),))


def test_an_action_measured_in_place_costs_that_alone_and_keeps_its_sharing_and_recompute_share():
    from pipesim.readings import IdleCost, InPlaceCost

    prof = uniform_profile(2)  # F = 1 s, B = 2 s per sample and layer
    plan = Plan([1, 1], 1, 1, checkpoint="always", schedule="gpipe")
    two = [Device("a"), Device("b")]

    def actions(cluster: Cluster, p: Plan = plan) -> dict[tuple[int, str], float]:
        a = simulate(prof, p, cluster).actions.query("kind in ('F', 'B')")
        return {(r.stage, r.kind): r.end - r.start for r in a.itertuples()}

    # the profile's: F 1 s, the checkpointed B 3 s of which the recomputation 1 s
    assert actions(Cluster(two)) == pytest.approx({(0, "F"): 1.0, (1, "F"): 1.0,
                                                   (0, "B"): 3.0, (1, "B"): 3.0})
    # stage 1 measured in place checkpointed: F 0.5 s, B 6 s (its recomputation keeps
    # its third of it: 2 s); its plain row and stage 0 (unmeasured) leave the rest alone
    costs = (InPlaceCost(1, 2, 1, True, 0.5, 6.0), InPlaceCost(1, 2, 1, False, 9.0, 9.0))
    placed = Cluster(two, in_place_costs=costs)
    assert actions(placed) == pytest.approx({(0, "F"): 1.0, (1, "F"): 0.5,
                                             (0, "B"): 3.0, (1, "B"): 6.0})
    recompute = simulate(prof, plan, placed).actions.query("kind == 'R' and stage == 1")
    assert (recompute.end - recompute.start).tolist() == pytest.approx([2.0])
    # the plain mode reads its own row
    never = Plan([1, 1], 1, 1, checkpoint="never", schedule="gpipe")
    assert actions(placed, never)[(1, "B")] == pytest.approx(9.0)
    # an action with an idle curve reads its cost in place already; a replay's durations win
    curve = (IdleCost(1, 2, 1, True, 1.0, 0.0, "F"),)
    assert actions(Cluster(two, in_place_costs=costs, idle_costs=curve))[(1, "F")] == \
        pytest.approx(1.0)
    durations = {(s, k, 0): 1.0 for s in (0, 1) for k in ("F", "B")}
    replay = simulate(prof, plan, placed, durations=durations)
    assert (replay.actions.end - replay.actions.start).max() == pytest.approx(1.0)


def test_in_place_costs_read_their_mode_in_log_size_are_validated_and_round_trip(tmp_path):
    from pipesim.errors import ClusterError
    from pipesim.readings import InPlaceCost

    c = Cluster([Device("a"), Device("b")], in_place_costs=(
        InPlaceCost(0, 3, 2, False, 1e-3, 2e-3), InPlaceCost(0, 3, 8, False, 3e-3, 6e-3),
        InPlaceCost(0, 3, 2, True, 5e-3, 9e-3)))
    assert c.in_place_cost(0, 3, 4, False) == pytest.approx((2e-3, 4e-3))  # log2 halfway
    assert c.in_place_cost(0, 3, 32, True) == pytest.approx((5e-3, 9e-3))  # nearest size's
    assert c.in_place_cost(3, 6, 2, False) is None  # another span: not measured
    assert Cluster.load(c.save(tmp_path / "c.json")).in_place_costs == c.in_place_costs
    with pytest.raises(ClusterError, match=r"in-place cost of layers \[0, 3\) needs a "
                                           r"micro-batch >= 1 and seconds > 0, got 2, 0.0"):
        Cluster([Device("a")], in_place_costs=(InPlaceCost(0, 3, 2, True, 0.0, 1e-3),))


def test_an_action_pauses_its_stages_executor_gap_beyond_the_calibration_pipelines():
    from pipesim.readings import ExecutorGap

    prof = uniform_profile(2)  # F = 1 s, B = 2 s per sample and layer
    plan = Plan([1, 1], 2, 2, checkpoint="never", schedule="gpipe")
    two = [Device("a"), Device("b")]
    base = Cluster(two, action_gap_s=0.25, wakeup_gap_s=0.5)

    def starts(cluster: Cluster, **kw) -> dict[tuple[int, str, int], float]:
        a = simulate(prof, plan, cluster, **kw).actions.query("kind in ('F', 'B')")
        return {(r.stage, r.kind, r.microbatch): r.start for r in a.itertuples()}

    # the calibration pipeline's executor spends 0.1 s around an action, stage 1's 0.6 s:
    # each of stage 1's actions pauses 0.5 s more than the calibrated gap, stage 0's none
    # (its span unmeasured)
    gaps = Cluster(two, action_gap_s=0.25, wakeup_gap_s=0.5, executor_gap_base_s=0.1,
                   executor_gaps=(ExecutorGap(1, 2, 1, False, 0.6),))
    before, after = starts(base), starts(gaps)
    #   stage 0   .25 |== F0 ==| .25 |== F1 ==|
    #   stage 1         F0 arrives at 1.25 |.5|== F0 ==|.25 + .5|== F1 ==|
    # stage 1 blocked on F0: woken 0.5 after its arrival, as calibrated (the executor's
    # work after its previous action was done before it blocked)
    assert before[(1, "F", 0)] == after[(1, "F", 0)] == pytest.approx(1.75)
    assert after[(0, "F", 1)] == pytest.approx(before[(0, "F", 1)])
    # F1 there when stage 1 reaches it (F0 ends at 2.75): its gap 0.25 and 0.5 more
    assert before[(1, "F", 1)] == pytest.approx(3.0)
    assert after[(1, "F", 1)] == pytest.approx(3.5)
    # a replay of measured durations pauses it too: it is time between actions
    durations = {(s, k, m): 1.0 for s in (0, 1) for k in ("F", "B") for m in (0, 1)}
    assert starts(gaps, durations=durations)[(1, "F", 1)] == pytest.approx(3.5)
    # where the stage's executor is quicker than the calibration pipeline's, less; never
    # below no pause at all
    quick = dataclasses.replace(gaps, executor_gaps=(ExecutorGap(1, 2, 1, False, 0.0),))
    assert starts(quick)[(1, "F", 1)] == pytest.approx(2.75 + 0.15)
    none = dataclasses.replace(gaps, executor_gap_base_s=10.0)
    assert starts(none)[(1, "F", 1)] == pytest.approx(2.75)


def test_a_blocked_workers_wake_up_grows_with_its_wait_by_the_measured_curve(tmp_path):
    from pipesim.errors import ClusterError

    prof = uniform_profile(2)  # F = 1 s, B = 2 s per sample and layer
    plan = Plan([1, 1], 1, 1, checkpoint="never", schedule="gpipe")
    two = [Device("a"), Device("b")]
    curve = ((0.0, 0.0), (1.0, 0.1), (10.0, 1.0))
    flat = Cluster(two, action_gap_s=0.25, wakeup_gap_s=0.5)
    grows = dataclasses.replace(flat, wakeup_curve=curve)

    def start(cluster: Cluster, stage: int, kind: str) -> float:
        a = simulate(prof, plan, cluster).actions
        return float(a[(a.stage == stage) & (a.kind == kind)].start.iloc[0])

    #   stage 0  .25|== F0 ==|          ...waits 3.75 s...          |wake|=== B0 ===
    #   stage 1      F0 arrives 1.25 |.5|== F0 ==|.25|==== B0 ====| 5.0
    # stage 1's first action has no wait before it to read: the plain wake-up
    assert start(flat, 1, "F") == start(grows, 1, "F") == pytest.approx(1.75)
    # stage 0 waited 3.75 s for its gradient: 0.5 and the curve at 3.75 (0.1 + 2.75 * 0.1)
    assert start(flat, 0, "B") == pytest.approx(5.5)
    assert start(grows, 0, "B") == pytest.approx(5.0 + 0.5 + 0.375)
    assert grows.wakeup_after(30.0) == pytest.approx(1.5)  # the last point's beyond
    assert grows.wakeup_after(0.0) == flat.wakeup_after(3.0) == 0.5
    assert Cluster.load(grows.save(tmp_path / "c.json")).wakeup_curve == curve
    with pytest.raises(ClusterError, match="wakeup_curve must run from idle 0"):
        Cluster(two, wakeup_curve=((1.0, 0.1),))
    with pytest.raises(ClusterError, match="finite seconds >= 0"):
        Cluster(two, wakeup_curve=((0.0, 0.0), (1.0, -0.1)))


def test_executor_gaps_read_their_mode_in_log_size_less_the_base_are_validated_and_round_trip(
        tmp_path):
    from pipesim.errors import ClusterError
    from pipesim.readings import ExecutorGap

    two = [Device("a"), Device("b")]
    c = Cluster(two, executor_gap_base_s=1e-4, executor_gaps=(
        ExecutorGap(0, 3, 2, False, 2e-4), ExecutorGap(0, 3, 8, False, 4e-4),
        ExecutorGap(0, 3, 2, True, 1e-3), ExecutorGap(3, 6, 2, False, 5e-5)))
    assert c.executor_gap(0, 3, 4, False) == pytest.approx(2e-4)  # halfway: 3e-4 - 1e-4
    assert c.executor_gap(0, 3, 32, False) == pytest.approx(3e-4)  # the nearest size's
    assert c.executor_gap(0, 3, 8, True) == pytest.approx(9e-4)  # its mode's row
    assert c.executor_gap(3, 6, 2, True) == pytest.approx(-5e-5)  # the other mode's: less
    assert c.executor_gap(1, 3, 2, False) == 0.0  # another span: the calibrated gap
    assert Cluster(two).executor_gap(0, 3, 2, False) == 0.0
    again = Cluster.load(c.save(tmp_path / "c.json"))
    assert (again.executor_gaps, again.executor_gap_base_s) == (c.executor_gaps, 1e-4)
    with pytest.raises(ClusterError, match=r"layers \[0, 3\) needs a micro-batch >= 1 and "
                                           r"seconds >= 0, got 2 and -0\.001"):
        Cluster(two, executor_gap_base_s=1e-4,
                executor_gaps=(ExecutorGap(0, 3, 2, False, -1e-3),))
    with pytest.raises(ClusterError, match="executor_gaps need executor_gap_base_s"):
        Cluster(two, executor_gaps=(ExecutorGap(0, 3, 2, False, 1e-3),))


def _one_gpu(n: int, speedup: tuple[float, ...]) -> Cluster:
    return Cluster([Device(f"w{i}", physical="gpu") for i in range(n)],
                   device_sharing="concurrent", device_speedup=speedup)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_streams_that_never_slow_each_other_act_like_separate_devices(schedule):
    prof = uniform_profile(4)
    plan = Plan([1, 1, 1, 1], 8, 8, checkpoint="never", schedule=schedule)
    shared = metrics(simulate(prof, plan, _one_gpu(4, (1, 2, 3, 4))))
    apart = metrics(simulate(prof, plan))
    assert shared.iteration_time_s == pytest.approx(apart.iteration_time_s, abs=1e-9)
    assert shared.bubble == pytest.approx(apart.bubble, abs=1e-9)


def test_a_saturated_device_conserves_work_while_streams_overlap():
    # two streams at speedup 1: overlapping actions each run at half speed, so the device
    # does one second of work a second, never more -- and is never idle with work pending
    prof = uniform_profile(2)
    plan = Plan([1, 1], 2, 2, checkpoint="never")
    trace = simulate(prof, plan, _one_gpu(2, (1, 1)))
    f = trace.actions.query("kind == 'F'").set_index(["stage", "microbatch"])
    assert f.loc[(0, 0), "end"] == pytest.approx(1.0)  # alone: full speed
    assert f.loc[(0, 1), "end"] == pytest.approx(3.0)  # with stage 1's F0: half speed
    assert f.loc[(1, 0), "end"] == pytest.approx(3.0)
    total = 2 * 2 * (F + B)  # all the work of both stages, one sample each micro-batch
    assert metrics(trace).iteration_time_s == pytest.approx(total)


def test_speedup_from_the_profile_reads_the_size_scaling():
    from pipesim.contention import speedup_from_scaling

    flat = speedup_from_scaling(lambda b: 1.0, 4, 3)  # launch-bound: size costs nothing
    assert flat == [1.0, 2.0, 3.0]
    linear = speedup_from_scaling(lambda b: 0.5 * b, 4, 3)  # saturated: time ~ size
    assert linear == [1.0, 1.0, 1.0]
    assert speedup_from_scaling(lambda b: 1 + b, 2, 2) == [1.0, pytest.approx(2 * 3 / 5)]


def test_a_measured_stream_law_in_the_profile_replaces_the_scaling_law():
    # time proportional to size: the size scaling says a second stream gains nothing
    prof = uniform_profile(2)
    plan = Plan([1, 1], 2, 2, checkpoint="never")
    shared = Cluster([Device(f"w{i}", physical="gpu") for i in range(2)],
                     device_sharing="concurrent")
    assert PlanCosts(prof, plan).device_speedup(2) == [1.0, 1.0]
    in_turn = metrics(simulate(prof, plan, shared)).iteration_time_s
    assert in_turn == pytest.approx(2 * 2 * (F + B))  # all the work, one action at a time
    # measured: two streams together do twice the work (small kernels fill each other's gaps)
    measured = Profile(prof.table, {**prof.meta, "stream_speedup": {"1": [1.0, 2.0]}})
    assert PlanCosts(measured, plan).device_speedup(2) == [1.0, 2.0]
    apart = metrics(simulate(prof, plan)).iteration_time_s
    assert metrics(simulate(measured, plan, shared)).iteration_time_s == pytest.approx(apart)
    assert apart < in_turn
    # the cluster's own law, where set, still wins over the profile's
    fixed = dataclasses.replace(shared, device_speedup=(1.0, 1.0))
    assert metrics(simulate(measured, plan, fixed)).iteration_time_s == pytest.approx(in_turn)


def test_the_stream_law_is_read_between_sizes_and_validated_on_load(tmp_path):
    from pipesim.errors import ProfileError

    prof = uniform_profile(2)
    law = Profile(prof.table, {"stream_speedup": {"2": [1.0, 1.2], "8": [1.0, 1.8, 2.4]}})
    assert law.stream_speedup(1) == [1.0, 1.2]  # below the sizes measured: the nearest
    assert law.stream_speedup(4) == pytest.approx([1.0, 1.4])  # linear; the streams both have
    assert law.stream_speedup(32) == [1.0, 1.8, 2.4]
    assert prof.stream_speedup(4) is None
    assert PlanCosts(law, Plan([1, 1], 1, 8)).device_speedup(4) == [1.0, 1.8, 2.4, 2.4]
    back = Profile.load(law.save(tmp_path / "p.csv"))
    assert back.stream_speedup(8) == [1.0, 1.8, 2.4]
    with pytest.raises(ProfileError, match=r"stream_speedup.*\[1, k\]"):
        Profile(prof.table, {"stream_speedup": {"2": [1.0, 2.5]}})
    with pytest.raises(ProfileError, match="stream_speedup"):
        Profile(prof.table, {"stream_speedup": {"2": "fast"}})


def test_device_sharing_is_validated_and_round_trips(tmp_path):
    from pipesim.errors import ClusterError

    with pytest.raises(ClusterError, match="device_sharing"):
        Cluster([Device("a")], device_sharing="sometimes")
    with pytest.raises(ClusterError, match=r"device_speedup\[k-1\]"):
        Cluster([Device("a")], device_sharing="concurrent", device_speedup=(1.0, 2.5))
    c = _one_gpu(2, (1.0, 1.3))
    back = Cluster.load(c.save(tmp_path / "c.json"))
    assert back.device_sharing == "concurrent" and back.device_speedup == (1.0, 1.3)
    assert Cluster.shared_gpu(2).device_sharing == "concurrent"


# ------------------------------------------------------------- memory rules
def _levels(trace):
    return trace.memory.sort_values(["device", "time"])


def _static_and_grads(prof, plan, cluster):
    """What a device holds after an iteration: parameters, optimizer state, gradients."""
    held: dict[str, float] = {}
    for s in range(plan.n_stages):
        device = cluster.devices[plan.stage_devices[s]].resource
        size = prof.micro_batch_sizes[0]  # parameters do not depend on it
        params = sum(prof.at(layer, size)["param_bytes"] for layer in plan.stage_layers(s))
        held[device] = held.get(device, 0.0) + params * (2 + plan.optimizer_state_factor)
    return held


def _assert_memory_balances(prof, plan, cluster, abs_tol):
    """Levels never negative; after the iteration each device holds exactly its
    parameters, their gradients and the optimizer state: everything else was freed."""
    trace = simulate(prof, plan, cluster)
    assert (trace.memory["bytes"] >= -1e-6).all()
    final = _levels(trace).groupby("device")["bytes"].last()
    for device, expected in _static_and_grads(prof, plan, cluster).items():
        assert final[device] == pytest.approx(expected, abs=abs_tol)
    # by category: each level never negative, and only parameters and gradients remain
    split = trace.memory_by_category
    assert split is not None and (split["bytes"] >= -abs_tol).all()
    last = split.sort_values("time", kind="stable").groupby(["device", "category"])["bytes"].last()
    for (device, category), level in last.items():
        if category not in ("parameters", "gradients"):
            assert level == pytest.approx(0.0, abs=abs_tol), (device, category)
    assert last.groupby(level="device").sum().to_dict() == pytest.approx(final.to_dict(),
                                                                          abs=abs_tol)


@st.composite
def memory_scenarios(draw):
    prof, plan, _ = draw(scenarios())
    n_dev = plan.n_devices
    kind = draw(st.sampled_from(["free", "link", "near_free", "one_gpu"]))
    if kind == "free":
        cluster = Cluster.free(n_dev)
    elif kind == "one_gpu":
        cluster = Cluster([Device(f"w{i}", physical="gpu") for i in range(n_dev)],
                          device_sharing=draw(st.sampled_from(["serial", "concurrent"])),
                          device_speedup=(1.0, 1.5))
    else:
        link = (Link(0.0, 1e30) if kind == "near_free"
                else Link(draw(st.floats(0, 0.5)), draw(st.floats(100.0, 1e5))))
        cluster = Cluster([Device(f"d{i}") for i in range(n_dev)], link=link,
                          sender_keeps_sends=draw(st.booleans()),
                          receives_ahead=draw(st.booleans()),
                          receives_after_inputs=draw(st.booleans()))
    return prof, plan, cluster


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(memory_scenarios())
def test_property_memory_levels_never_negative_and_every_free_matches_an_allocation(case):
    prof, plan, cluster = case
    _assert_memory_balances(prof, plan, cluster, abs_tol=1e-6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_property_a_near_free_link_gives_the_free_clusters_memory(case):
    prof, plan, _ = case
    n_dev = plan.n_devices
    free = metrics(simulate(prof, plan, Cluster.free(n_dev))).peak_memory_bytes
    near = metrics(simulate(prof, plan, Cluster([Device(f"dev{i}") for i in range(n_dev)],
                                                link=Link(0.0, 1e30)))).peak_memory_bytes
    assert near == pytest.approx(free, rel=1e-9)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_property_slow_links_raise_peaks_only_by_buffers_in_flight(case):
    # a slower link can only delay arrivals: a peak grows at most by the bytes that can
    # be received and held at once -- every boundary tensor of every micro-batch, each
    # the sending stage's output (activation and gradient alike; no skips here)
    prof, plan, cluster = case
    n_dev = plan.n_devices
    free = metrics(simulate(prof, plan, Cluster.free(n_dev))).peak_memory_bytes
    slow = metrics(simulate(prof, plan, cluster)).peak_memory_bytes
    size = max(plan.micro_batch_sizes)
    in_flight = plan.n_microbatches * 2 * sum(
        prof.span_cost(plan.stage_layers(s).start, plan.stage_layers(s).stop, size).output_bytes
        for s in range(plan.n_stages - 1))
    for device, peak in free.items():
        renamed = device.replace("dev", "d")
        assert slow[renamed] <= peak + in_flight + 1e-6


def test_unet_free_cluster_matches_an_instant_link():
    # the defect: on the free cluster a receiver freed buffers it never received
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "experiments/results/profile_cpu_unet.csv"
    prof = Profile.load(path)
    for ckpt in ("never", "always"):
        plan = Plan(list(_halves(prof.n_layers)), 4, 32, checkpoint=ckpt, optimizer="sgd")
        free = simulate(prof, plan, Cluster.free(2))
        near = simulate(prof, plan, Cluster([Device("dev0"), Device("dev1")], link=Link(0, 1e30)))
        assert (free.memory["bytes"] >= 0).all()
        assert metrics(free).peak_memory_bytes == pytest.approx(metrics(near).peak_memory_bytes)


def _halves(n: int) -> tuple[int, int]:
    return n // 2, n - n // 2


@pytest.mark.parametrize("keeps", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ckpt", ["never", "except_last", "always"])
def test_skip_memory_balances_on_every_link(keeps, schedule, ckpt):
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "experiments/results/profile_cpu_unet.csv"
    prof = Profile.load(path)
    plan = Plan([8, 5], 4, 32, checkpoint=ckpt, schedule=schedule)
    for link in (Link(0.0, 1e30), Link(1e-4, 1e8)):
        cluster = Cluster([Device("d0"), Device("d1")], link=link, sender_keeps_sends=keeps)
        _assert_memory_balances(prof, plan, cluster, abs_tol=1e-3)


def test_receives_posted_ahead_hold_their_buffer_from_the_step_before():
    """pipesim's gloo transport posts a receive as the worker moves to the action before
    the one that needs it, or once that action's own inputs are in: the buffer is held
    from then (Cluster.receives_ahead, receives_after_inputs)."""
    prof = uniform_profile(2, fwd_s=1.0, bwd_s=2.0, act_bytes=100, saved_bytes=300,
                           param_bytes=0)
    plan = Plan([1, 1], 4, 4, checkpoint="never")
    base = Cluster.free(2)
    ahead = dataclasses.replace(base, receives_ahead=True)

    def level(cluster, device, t):
        mem = simulate(prof, plan, cluster).memory
        part = mem[(mem.device == device) & (mem.time <= t)]
        return part.bytes.iloc[-1] if len(part) else 0.0

    # device 1 reaches F(1,0) at 0 and posts F(1,1)'s receive (F(1,0)'s own at 0 too)
    assert level(base, "dev1", 0.5) == 0
    assert level(ahead, "dev1", 0.5) == 200
    # the executor's order: F(1,1)'s receive once F(1,0)'s input is in, at 1 as it starts
    after = dataclasses.replace(ahead, receives_after_inputs=True)
    assert level(after, "dev1", 0.5) == 100
    assert level(after, "dev1", 1.0) == level(ahead, "dev1", 1.0)
    assert Cluster.from_dict(after.to_dict()).receives_after_inputs
    # the executor's order since 2026-11-30: every receive posted as the step starts
    # (device 1's four inputs, 100 bytes each), each freed as its backward ends
    start = dataclasses.replace(after, receives_at_start=True)
    assert level(start, "dev1", 0.0) == 400
    assert Cluster.from_dict(start.to_dict()).receives_at_start
    for cluster in (base, ahead, after, start):  # everything allocated is freed by the end
        mem = simulate(prof, plan, cluster).memory
        assert (mem.bytes >= 0).all()
        assert mem.groupby("device").bytes.last().eq(0).all()


@pytest.mark.parametrize("schedule,balance,v", [("zb-h1", [1, 1], 1), ("zbv", [1, 1], 2),
                                                 ("interleaved", [1, 1], 2)])
def test_receives_posted_after_inputs_balance_with_split_backwards(schedule, balance, v):
    """Split backwards post their next receives as they are reached, the rest once their
    inputs are in: either way every buffer posted is freed by the step's end."""
    prof = uniform_profile(2 * v, fwd_s=1.0, bwd_s=2.0, act_bytes=100, saved_bytes=300,
                           param_bytes=0)
    plan = Plan([1] * (2 * v), 4, 4, checkpoint="never", schedule=schedule, virtual_stages=v)
    for after, at_start in ((False, False), (True, False), (True, True)):
        cluster = Cluster([Device("d0"), Device("d1")], link=Link(0.1, 1e4),
                          sender_keeps_sends=True, receives_ahead=True,
                          receives_after_inputs=after, receives_at_start=at_start)
        _assert_memory_balances(prof, plan, cluster, abs_tol=1e-6)


def test_more_busy_workers_than_cores_share_them():
    """4 single-threaded ranks on 2 cores: all computing, each runs at half speed."""
    from pipesim.contention import host_law

    assert host_law(0.0, cores=2)(4) == pytest.approx(0.5)
    assert host_law(0.1, cores=2)(2) == pytest.approx(1 / 1.1)
    assert host_law(0.1)(4) == pytest.approx(1 / 1.3)
    prof = uniform_profile(4, fwd_s=1.0, bwd_s=2.0)
    plan = Plan([1] * 4, 32, 32, checkpoint="never")
    devices = [Device(f"r{i}", host="h") for i in range(4)]
    free = metrics(simulate(prof, plan, Cluster(devices))).iteration_time_s
    sliced = metrics(simulate(prof, plan, Cluster(devices, host_cores=2))).iteration_time_s
    assert 1.6 < sliced / free <= 2.0
    assert Cluster.from_dict(Cluster(devices, host_cores=2).to_dict()).host_cores == 2


def test_an_action_waits_for_every_input_that_is_still_on_the_wire():
    """Found with a slow link: a time computed from profile numbers (numpy floats) was taken
    for an event, and a backward started before its gradient had arrived."""
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "experiments/results/profile_cpu_unet.csv"
    prof = Profile.load(path)
    plan = Plan([8, 5], 4, 32, checkpoint="never", schedule="gpipe")
    trace = simulate(prof, plan, Cluster([Device("d0"), Device("d1")], link=Link(1e-4, 1e8)))
    a = trace.actions
    arrivals = a[a.kind.isin(["SEND_B", "SEND_SB"])].groupby("microbatch")["end"].max()
    for r in a[(a.kind == "B") & (a.stage == 0)].itertuples():
        assert r.start >= arrivals[r.microbatch] - 1e-12


def test_memory_stack_draws_each_category_under_the_measured_total():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipesim.plot import memory_stack

    prof = uniform_profile(4, fwd_s=1.0, bwd_s=2.0)
    plan = Plan([2, 2], 4, 4, checkpoint="never")
    predicted = simulate(prof, plan)
    fig, ax = plt.subplots()
    memory_stack(predicted, "dev0", ax, measured=predicted, share_of_iteration=True)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    # (the first stage of a synthetic profile has no temporaries: no transients profiled)
    assert labels == ["parameters", "gradients", "activations", "received", "measured (total)",
                      "measured up to parameters", "measured up to gradients",
                      "measured up to activations"]
    # the top of the stack is the total
    top = max(collection.get_paths()[0].vertices[:, 1].max() for collection in ax.collections)
    assert top * 2**20 == pytest.approx(metrics(predicted).peak_memory_bytes["dev0"])
    plt.close(fig)


def test_a_first_backward_forms_each_layers_gradients_as_it_reaches_it():
    # two layers on one stage, the last with 3x the parameters: walking back, the last
    # layer's gradients appear as the backward starts, the first layer's halfway through
    # (equal backward seconds); each layer's saved tensors go as it ends
    prof = uniform_profile(2, sizes=(1, 2))
    t = prof.table.copy()
    t.loc[t.layer == 1, "param_bytes"] = 3000
    prof = Profile(t, prof.meta)
    trace = simulate(prof, Plan([2], 1, 1, checkpoint="never"))
    b = trace.actions.query("kind == 'B'").iloc[0]
    grads = trace.memory_by_category.query("category == 'gradients'")
    steps = grads[grads.bytes.diff().fillna(grads.bytes) != 0]
    assert list(steps.bytes) == [3000, 4000]
    assert list(steps.time) == pytest.approx([b.start, b.start + (b.end - b.start) / 2])
    acts = trace.memory_by_category.query("category == 'activations'")
    during = acts[(acts.time > b.start) & (acts.time <= b.end)]
    assert list(during.time) == pytest.approx([b.start + (b.end - b.start) / 2, b.end])


def test_an_accelerators_memory_changes_run_along_its_hosts_issue():
    # the caching allocator counts a tensor from the host's call that makes it to the
    # host's release of it: a device-bound backward whose host issues it in a quarter of
    # its seconds frees its stage's activations within that quarter, not along its kernels
    # (measured on an H100: a stage thread's checkpointed backward issued in 9 ms of its
    # 55 on the device, its recomputed activations gone before the other stage's came)
    prof = uniform_profile(2, sizes=(1, 2))
    prof = Profile(prof.table.assign(host_fwd_s=prof.table.fwd_s,
                                     host_bwd_s=prof.table.bwd_s / 4), prof.meta)
    plan = Plan([1, 1], 1, 1, checkpoint="never")

    def activations_freed(cluster: Cluster) -> tuple[float, float, float]:
        trace = simulate(prof, plan, cluster)
        b = trace.actions.query("kind == 'B' and stage == 1").iloc[0]
        device = cluster.devices[1].resource
        acts = trace.memory_by_category.query(
            f"category == 'activations' and device == '{device}'")
        freed = acts[(acts.time > b.start) & (acts.time <= b.end) & (acts.bytes.diff() < 0)]
        return b.start, b.end, float(freed.time.max())

    start, end, freed = activations_freed(Cluster.shared_gpu(2))
    assert freed == pytest.approx(start + (end - start) / 4)
    # on CPU processes the host is the device: along the whole backward
    start, end, freed = activations_freed(Cluster.cpu_processes(2))
    assert freed == pytest.approx(end)


def _threads_of_one_process(prof: Profile, shares: tuple[float, float] | None) -> Profile:
    meta = dict(prof.meta)
    if shares is not None:
        meta["interpreter_share"] = {str(b): {"F": shares[0], "B": shares[1]}
                                     for b in prof.micro_batch_sizes}
    return Profile(prof.table, meta)


def test_threads_of_one_process_take_turns_for_their_interpreter_share():
    # two stages on two cores of one process; 4 micro-batches of 1 sample: in the
    # steady state stage 0's F(m+1) runs beside stage 1's F(m)
    plan = Plan([1, 1], 4, 4, checkpoint="never")
    threads = Cluster([Device(f"t{i}", physical=f"core{i}", process="p") for i in range(2)])
    apart = Cluster([Device(f"t{i}", physical=f"core{i}") for i in range(2)])
    prof = uniform_profile(2, sizes=(1, 2))
    free = metrics(simulate(prof, plan, apart)).iteration_time_s
    # nothing measured, or nothing under the interpreter: as separate processes
    assert metrics(simulate(prof, plan, threads)).iteration_time_s == pytest.approx(free)
    none = _threads_of_one_process(prof, (0.0, 0.0))
    assert metrics(simulate(none, plan, threads)).iteration_time_s == pytest.approx(free)
    # forwards wholly under the interpreter: two at once take turns (each lasts 2x)
    held = simulate(_threads_of_one_process(prof, (1.0, 0.0)), plan, threads)
    f = held.actions.query("kind == 'F'").set_index(["stage", "microbatch"])
    assert f.loc[(0, 0), "end"] - f.loc[(0, 0), "start"] == pytest.approx(F)  # alone
    assert f.loc[(0, 1), "end"] - f.loc[(0, 1), "start"] == pytest.approx(2 * F)  # beside F(1, 0)
    assert metrics(held).iteration_time_s > free
    # half of each forward: two together still fit in their own time
    half = _threads_of_one_process(prof, (0.5, 0.0))
    assert metrics(simulate(half, plan, threads)).iteration_time_s == pytest.approx(free)


def test_the_cpu_threads_preset_is_threads_of_one_process_on_cores_of_their_own():
    threads = Cluster.cpu_threads(3, cores=2)
    # one interpreter; a core each, the third thread taking turns on the first core
    assert [(d.process, d.resource) for d in threads.devices] == [
        ("main", "core0"), ("main", "core1"), ("main", "core0")]
    assert [d.resource for d in Cluster.cpu_threads(3).devices] == ["core0", "core1", "core2"]
    # it shares the interpreter as the hand-made cluster of threads does
    plan = Plan([1, 1], 4, 4, checkpoint="never")
    held = _threads_of_one_process(uniform_profile(2, sizes=(1, 2)), (1.0, 0.0))
    hand = Cluster([Device(f"t{i}", physical=f"core{i}", process="p") for i in range(2)],
                   compute_overhead_s=Cluster.cpu_threads(2).compute_overhead_s)
    assert metrics(simulate(held, plan, Cluster.cpu_threads(2))).iteration_time_s == \
        pytest.approx(metrics(simulate(held, plan, hand)).iteration_time_s)


def test_the_executors_gaps_hold_the_interpreter_where_the_cluster_says_so(tmp_path):
    # two stages as threads of one process, 4 micro-batches of 1 sample, forwards wholly
    # under the interpreter; the executor spends G seconds before each action (its Python:
    # handing over the output, posting receives; a woken thread's too)
    G = 0.25
    plan = Plan([1, 1], 4, 4, checkpoint="never")
    devices = [Device(f"t{i}", physical=f"core{i}", process="p") for i in range(2)]
    held = _threads_of_one_process(uniform_profile(2, sizes=(1, 2)), (1.0, 0.0))
    free = Cluster(devices, action_gap_s=G)
    hold = dataclasses.replace(free, gaps_hold_interpreter=True)

    def forwards(cluster):
        return simulate(held, plan, cluster).actions.query("kind == 'F'").set_index(
            ["stage", "microbatch"])

    # F(0, 0) ends at G + F; then stage 0's gap before F(0, 1) and stage 1's wake-up
    # before F(1, 0) run at once: on their own, G each; holding the interpreter, in turn
    for cluster, gap in ((free, G), (hold, 2 * G)):
        f = forwards(cluster)
        assert f.loc[(0, 0), "end"] == pytest.approx(G + F)
        assert f.loc[(0, 1), "start"] - f.loc[(0, 0), "end"] == pytest.approx(gap)
        assert f.loc[(1, 0), "start"] - f.loc[(0, 0), "end"] == pytest.approx(gap)
    assert metrics(simulate(held, plan, hold)).iteration_time_s > \
        metrics(simulate(held, plan, free)).iteration_time_s
    # separate processes hold no common interpreter: the flag changes nothing
    apart = [dataclasses.replace(d, process="") for d in devices]
    assert metrics(simulate(held, plan, dataclasses.replace(hold, devices=apart))
                   ).iteration_time_s == pytest.approx(
        metrics(simulate(held, plan, dataclasses.replace(free, devices=apart))).iteration_time_s)
    assert Cluster.load(hold.save(tmp_path / "c.json")).gaps_hold_interpreter
    # threads sharing by measured pairs: a gap is Python, slowed and slowing as a forward
    # (a forward beside a forward twice as slow: the two gaps at once take 2 G, as above)
    for ratio, gap in ((1.0, G), (2.0, 2 * G)):
        paired = _paired(held, {"F|F": ratio})
        f = simulate(paired, plan, dataclasses.replace(hold, thread_pairs=True)).actions.query(
            "kind == 'F'").set_index(["stage", "microbatch"])
        assert f.loc[(0, 1), "start"] - f.loc[(0, 0), "end"] == pytest.approx(gap)


def test_a_checkpointed_micro_batch_holds_the_interpreter_for_its_own_measured_share():
    # F and B measured outside the interpreter, their checkpointed kind wholly under it:
    # only the checkpointed plan's threads take turns
    threads = Cluster([Device(f"t{i}", physical=f"core{i}", process="p") for i in range(2)])
    apart = Cluster([Device(f"t{i}", physical=f"core{i}") for i in range(2)])
    prof = uniform_profile(2, sizes=(1, 2))
    shares = _with_shares(prof, 0.0, 0.0, 1.0, 1.0)
    assert shares.checkpointed_interpreter_share(1) == (1.0, 1.0)
    assert prof.checkpointed_interpreter_share(1) is None
    for mode, slower in (("never", False), ("always", True)):
        plan = Plan([1, 1], 4, 4, checkpoint=mode)
        alone = metrics(simulate(shares, plan, apart)).iteration_time_s
        together = metrics(simulate(shares, plan, threads)).iteration_time_s
        assert (together > alone * 1.01) is slower, mode
    # a recomputing backward holds it for all its seconds, recomputation included
    b = PlanCosts(shares, Plan([1, 1], 4, 4, checkpoint="always")).cost(1, 0)
    assert b.interpreter_ckpt_bwd_share == 1.0 and b.interpreter_fwd_share == 1.0
    never = Plan([1, 1], 4, 4, checkpoint="never")
    assert PlanCosts(shares, never).cost(1, 0).interpreter_ckpt_bwd_share is None


def _with_host(prof: Profile, fwd: float, bwd: float) -> Profile:
    """``prof`` with host issue seconds, ``fwd`` / ``bwd`` of each layer's device seconds."""
    table = prof.table.assign(host_fwd_s=prof.table.fwd_s * fwd,
                              host_bwd_s=prof.table.bwd_s * bwd)
    return Profile(table, prof.meta)


def _with_shares(prof: Profile, f: float, b: float, fc: float, bc: float) -> Profile:
    """``prof`` with the interpreter shares measured for its passes, alike at every size."""
    return Profile(prof.table, {**prof.meta, "interpreter_share": {
        str(size): {"F": f, "B": b, "Fc": fc, "Bc": bc} for size in prof.micro_batch_sizes}})


def _two_threads_on_a_gpu() -> tuple[Cluster, Cluster]:
    """Two workers on ``cuda:0`` whose streams run fully concurrently (speedup 2): as
    threads of one process, and as processes of their own."""
    gpu = Cluster([Device(f"w{i}", physical="cuda:0", process="p") for i in range(2)],
                  device_sharing="concurrent", device_speedup=(1.0, 2.0))
    return gpu, dataclasses.replace(gpu, devices=[dataclasses.replace(d, process="")
                                                  for d in gpu.devices])


def test_a_worker_has_an_engine_thread_only_as_a_thread_driving_an_accelerator():
    assert Device("w", physical="cuda:0", process="p").engine == "p/cuda:0"
    assert Device("w", physical="cuda:0").engine == ""  # a process of its own
    assert Device("w", physical="core0", process="p").engine == ""  # a CPU: its own thread
    assert Device("w", physical="cpu", process="p").engine == ""


def test_an_accelerators_host_runs_ahead_and_hides_its_gaps_behind_device_bound_work():
    # one stage on a GPU, GPipe, 2 micro-batches of 1 sample: F F B B, a 0.5 s gap between
    # each two.  Issued in a quarter of F and half of B, each next action's host is ready
    # before the device is free, so no gap is paid:
    #   host    |F|..|F|..|=B=|..|=B=|            (..: the gap, hidden)
    #   device  |==F==|==F==|====B====|====B====|
    plan = Plan([1], 2, 2, checkpoint="never")
    gpu = Cluster([Device("w0", physical="cuda:0")], action_gap_s=0.5)
    ahead = dataclasses.replace(gpu, issue_ahead=True)
    device_bound = _with_host(uniform_profile(1, sizes=(1, 2)), 0.25, 0.5)
    busy = metrics(simulate(device_bound, plan, gpu)).iteration_time_s
    assert busy == pytest.approx(2 * F + 2 * B + 3 * 0.5)
    assert metrics(simulate(device_bound, plan, ahead)).iteration_time_s == pytest.approx(
        busy - 3 * 0.5)
    # launch-bound (issue takes the action's time): every gap is paid, as on a CPU
    launch_bound = _with_host(uniform_profile(1, sizes=(1, 2)), 1.0, 1.0)
    assert metrics(simulate(launch_bound, plan, ahead)).iteration_time_s == pytest.approx(busy)
    cpu = Cluster([Device("w0", physical="cpu")], action_gap_s=0.5, issue_ahead=True)
    assert metrics(simulate(device_bound, plan, cpu)).iteration_time_s == pytest.approx(busy)
    # a replay's measured durations hold their own issue: the host is busy to their end
    rows = simulate(device_bound, plan, gpu).actions
    durations = {(r.stage, r.kind, r.microbatch): r.end - r.start for r in rows.itertuples()}
    replay = simulate(device_bound, plan, ahead, durations=durations)
    assert metrics(replay).iteration_time_s == pytest.approx(busy)


def test_a_host_ahead_of_its_device_still_waits_for_an_input_and_wakes_up_after_it():
    # two stages on one GPU as processes (streams fully concurrent), GPipe, 2 micro-batches
    # of 1 sample, 3 and 2 layers.  Stage 1's host is done issuing F(0) early and reaches
    # F(1) before its input: it waits, and wakes up (1.5 s) after the input arrives --
    # later than its device is free, so F(1) starts a wake-up after the arrival:
    #   stage 0  |===F(0)===|===F(1)===|
    #   stage 1             ~~~~|==F(0)==|  ~~~~|==F(1)==|     (~~~~: wake-ups)
    plan = Plan([3, 2], 2, 2, checkpoint="never")
    _, apart = _two_threads_on_a_gpu()
    apart = dataclasses.replace(apart, action_gap_s=0.1, wakeup_gap_s=1.5, issue_ahead=True)
    prof = _with_host(uniform_profile(5, sizes=(1, 2)), 0.25, 0.25)
    a = simulate(prof, plan, apart).actions.set_index(["stage", "microbatch", "kind"])
    arrived = a.loc[(0, 1, "F"), "end"]
    assert a.loc[(1, 0, "F"), "end"] < arrived + 1.5  # the device was free before
    assert a.loc[(1, 1, "F"), "start"] == pytest.approx(arrived + 1.5)


def test_threads_on_one_gpu_issue_their_backwards_in_turn():
    # two stages as threads on one GPU whose streams run fully concurrently (speedup 2):
    # GPipe, 2 micro-batches of 1 sample, one layer a stage.  The backwards go
    #   stage 1: B(1,a) |==|            then B(1,b) |==|
    #   stage 0:                  B(0,a) |==|       then B(0,b) |==|
    # and B(1,b) overlaps B(0,a): issued by one engine thread in turn, each takes 2B
    # there (the pair ends 2B later than on two threads of their own), forwards unchanged
    plan = Plan([1, 1], 2, 2, checkpoint="never")
    gpu, apart = _two_threads_on_a_gpu()
    prof = uniform_profile(2, sizes=(1, 2))
    free = metrics(simulate(_with_host(prof, 1.0, 1.0), plan, apart)).iteration_time_s
    turns = simulate(_with_host(prof, 1.0, 1.0), plan, gpu)
    assert metrics(turns).iteration_time_s == pytest.approx(free + B)
    f = turns.actions.query("kind == 'F'")
    assert (f.end - f.start).tolist() == pytest.approx([F] * 4)
    # a backward issued in a tenth of its device time leaves the engine free enough
    quick = simulate(_with_host(prof, 1.0, 0.1), plan, gpu)
    assert metrics(quick).iteration_time_s == pytest.approx(free)
    # the same threads on CPU cores run their backwards on their own threads
    cores = Cluster([Device(f"t{i}", physical=f"core{i}", process="p") for i in range(2)])
    cores_apart = Cluster([Device(f"t{i}", physical=f"core{i}") for i in range(2)])
    assert (metrics(simulate(_with_host(prof, 1.0, 1.0), plan, cores)).iteration_time_s
            == pytest.approx(metrics(simulate(prof, plan, cores_apart)).iteration_time_s))


def test_a_backward_share_measured_on_a_gpu_is_the_engine_threads_turn():
    # two threads' backwards measured together on one GPU read the engine's turns: with a
    # measured backward share of 1 the engine holds each backward whole (the host columns'
    # 0.1 aside), and the interpreter holds no backward beside it
    plan = Plan([1, 1], 2, 2, checkpoint="never")
    gpu, apart = _two_threads_on_a_gpu()
    prof = _with_host(uniform_profile(2, sizes=(1, 2)), 1.0, 0.1)
    free = metrics(simulate(prof, plan, apart)).iteration_time_s
    measured = _threads_of_one_process(prof, (0.0, 1.0))
    assert metrics(simulate(measured, plan, gpu)).iteration_time_s == pytest.approx(free + B)
    # on CPU cores the same measured share is the interpreter's: the same turns there
    cores = Cluster([Device(f"t{i}", physical=f"core{i}", process="p") for i in range(2)])
    cores_apart = Cluster([Device(f"t{i}", physical=f"core{i}") for i in range(2)])
    assert (metrics(simulate(measured, plan, cores)).iteration_time_s
            == pytest.approx(metrics(simulate(measured, plan, cores_apart)).iteration_time_s + B))


def test_a_recomputation_on_the_engine_thread_takes_turns_with_a_forward_for_the_interpreter():
    # two stages as threads on one GPU (streams fully concurrent), 1F1B, 2 micro-batches of
    # 1 sample, checkpointed: forwards hold the interpreter wholly, backwards are issued by
    # autograd's thread in a tenth of their seconds -- but their recomputation (F seconds)
    # is a Python forward that thread runs, under the interpreter too.  At t = 3 F stage
    # 1's B(1,0) ends its recomputation alone (1 F); at t = 6 F stage 0's B(0,0) recomputes
    # while stage 1 runs F(1,1): the two take turns, each lasting 2 F.
    #   stage 0   F00 |F01==|             |R00=|B00 proper|
    #   stage 1       |F10==|R10|B10 proper|F11=|R11 ...
    gpu, apart = _two_threads_on_a_gpu()
    prof = _with_host(uniform_profile(2, sizes=(1, 2)), 1.0, 0.1)
    shares = _with_shares(prof, 1.0, 0.0, 1.0, 0.0)
    plan = Plan([1, 1], 2, 2, checkpoint="always", schedule="1f1b")
    a = simulate(shares, plan, gpu).actions.set_index(["stage", "kind", "microbatch"])
    span = a.end - a.start
    assert span[(1, "R", 0)] == pytest.approx(F)  # alone
    assert a.start[(0, "R", 0)] == a.start[(1, "F", 1)] == pytest.approx(6 * F)
    assert span[(0, "R", 0)] == pytest.approx(2 * F)  # beside F(1,1), in turn
    assert span[(1, "F", 1)] == pytest.approx(2 * F)
    # the backward proper follows the recomputation: B seconds of device work after it
    assert a.end[(0, "B", 0)] == pytest.approx(a.end[(0, "R", 0)] + B)
    # on processes of their own, nothing is shared: every recomputation lasts F
    own = simulate(shares, plan, apart).actions.query("kind == 'R'")
    assert (own.end - own.start).tolist() == pytest.approx([F] * 4)
    # a recomputation outside the interpreter (its forward share 0): no turns
    free = _with_shares(prof, 1.0, 0.0, 0.0, 0.0)
    r = simulate(free, plan, gpu).actions.query("kind == 'R'")
    assert (r.end - r.start).tolist() == pytest.approx([F] * 4)


def test_a_recomputation_has_autograds_thread_to_itself():
    # two stages as threads on one GPU, GPipe, 2 micro-batches of 1 sample, checkpointed;
    # forwards (and recomputations) issued in their seconds under the interpreter,
    # backwards in a tenth of theirs.  At t = 7 F both threads start a backward: torch's
    # checkpoint re-runs a forward inside one node of autograd's thread for the GPU, so the
    # two recomputations run one after the other, each alone (F), and the recomputed
    # activations of the two stages are never held at once
    #   stage 1   B(1,0) |R10|==== B proper ====|
    #   stage 0   B(0,1) |...|R01|==== B proper ====|
    gpu, _ = _two_threads_on_a_gpu()
    prof = _with_host(uniform_profile(2, sizes=(1, 2)), 1.0, 0.1)
    shares = _with_shares(prof, 1.0, 0.0, 1.0, 0.0)
    plan = Plan([1, 1], 2, 2, checkpoint="always", schedule="gpipe")
    held = simulate(shares, plan, gpu)
    a = held.actions.set_index(["stage", "kind", "microbatch"])
    assert a.start[(1, "B", 0)] == a.start[(0, "B", 1)] == pytest.approx(7 * F)
    first, second = sorted([(1, "R", 0), (0, "R", 1)], key=lambda k: a.start[k])
    assert a.start[first] == pytest.approx(7 * F)
    assert a.start[second] == pytest.approx(a.end[first])
    assert (a.end - a.start)[first] == (a.end - a.start)[second] == pytest.approx(F)
    # taking turns on that thread as two backwards' nodes do instead (the model before
    # 2026-11-28), both recompute at once, at half speed, and hold both recomputations
    turns = simulate(shares, plan, dataclasses.replace(gpu, recompute_holds_engine=False))
    r = turns.actions.query("kind == 'R' and start > 0").set_index(["stage", "microbatch"])
    assert r.start[(1, 0)] == r.start[(0, 1)] == pytest.approx(7 * F)
    assert r.end[(1, 0)] == r.end[(0, 1)] == pytest.approx(9 * F)
    assert (metrics(held).peak_memory_bytes["cuda:0"]
            < metrics(turns).peak_memory_bytes["cuda:0"])
    # and the other thread's backward waits it out: backwards issued in all their seconds,
    # the last micro-batch not checkpointed -- at t = 6 F stage 1 recomputes alone (F)
    # while stage 0's plain B(0,1) waits, then the two share the thread (2 B each)
    #   stage 1   |R10|== B(1,0) proper ==|          turns: |R10 ==|== B ==|
    #   stage 0   |...|== B(0,1) =========|                 |== B(0,1) ==|
    bound = _with_shares(_with_host(uniform_profile(2, sizes=(1, 2)), 1.0, 1.0), 1.0, 0.0, 1.0, 0.0)
    last = Plan([1, 1], 2, 2, checkpoint="except_last", schedule="gpipe")
    b = simulate(bound, last, gpu).actions.set_index(["stage", "kind", "microbatch"])
    assert b.start[(1, "R", 0)] == b.start[(0, "B", 1)] == pytest.approx(6 * F)
    assert b.end[(1, "R", 0)] == pytest.approx(7 * F)
    assert b.end[(0, "B", 1)] == b.end[(1, "B", 0)] == pytest.approx(7 * F + 2 * B)
    b = simulate(bound, last, dataclasses.replace(gpu, recompute_holds_engine=False)).actions
    b = b.set_index(["stage", "kind", "microbatch"])
    assert b.end[(1, "R", 0)] == pytest.approx(8 * F)
    assert b.end[(0, "B", 1)] == pytest.approx(6 * F + 2 * B)
    # the thread goes on once it has issued a recomputation, its kernels running on: one
    # issued in a quarter of its seconds lets the other begin a quarter F later
    quick = _with_shares(_with_host(uniform_profile(2, sizes=(1, 2)), 0.25, 0.1),
                         0.25, 0.0, 0.25, 0.0)
    q = simulate(quick, plan, gpu).actions.set_index(["stage", "kind", "microbatch"])
    first, second = sorted([(1, "R", 0), (0, "R", 1)], key=lambda k: q.start[k])
    assert q.start[second] == pytest.approx(q.start[first] + F / 4)
    assert (q.end - q.start)[first] == (q.end - q.start)[second] == pytest.approx(F)


def test_a_checkpointed_backwards_measured_share_holds_autograds_thread_once_not_twice():
    # one stage per thread on one GPU, 1 micro-batch (nothing overlaps), checkpointed: a
    # share measured for the whole checkpointed backward (Bc 1: two threads' together
    # took twice one's) covers its recomputation and its backward proper, so alone it
    # lasts its seconds -- the recomputation's issue (a tenth of it) is part of the
    # share, not held again beside it
    gpu, _ = _two_threads_on_a_gpu()
    prof = _with_host(uniform_profile(2, sizes=(1, 2)), 0.1, 0.1)
    plan = Plan([1, 1], 1, 1, checkpoint="always")

    def backward_s(bc: float) -> float:
        a = simulate(_with_shares(prof, 1.0, 0.0, 1.0, bc), plan, gpu).actions
        b = a[(a.kind == "B") & (a.stage == 1)].iloc[0]
        return b.end - b.start

    assert backward_s(1.0) == pytest.approx(backward_s(0.0))  # = F (recomputed) + B
    assert backward_s(1.0) == pytest.approx(F + B)


def test_a_checkpointed_backwards_hooks_take_turns_with_the_other_threads_forwards():
    # checkpointed, every pass issued wholly from the host: the backward proper on
    # autograd's thread overlaps stage 1's next forward.  Its unpack hooks holding the
    # interpreter (share 1) make the two take turns; held by no one (0, or not measured:
    # the engine's C++), they overlap; workers as processes of their own share nothing
    gpu, apart = _two_threads_on_a_gpu()
    prof = _with_host(uniform_profile(2, sizes=(1, 2)), 1.0, 1.0)
    base = _with_shares(prof, 1.0, 0.0, 1.0, 0.0).meta

    def with_hooks(share: float | None) -> Profile:
        meta = dict(base)
        if share is not None:
            meta["engine_interpreter_share"] = {str(b): {"Bc": share}
                                                for b in prof.micro_batch_sizes}
        return Profile(prof.table, meta)

    plan = Plan([1, 1], 4, 4, checkpoint="always", schedule="1f1b")

    def iteration(share: float | None, cluster: Cluster) -> float:
        return metrics(simulate(with_hooks(share), plan, cluster)).iteration_time_s

    assert iteration(0.0, gpu) == iteration(None, gpu)
    assert iteration(1.0, gpu) > iteration(0.0, gpu)
    assert iteration(1.0, apart) == pytest.approx(iteration(0.0, apart))
    # a plain backward's share is read apart (0 unless measured), and validated
    assert with_hooks(0.7).engine_interpreter_share(1) == (0.0, 0.7)
    assert prof.engine_interpreter_share(1) == (0.0, 0.0)
    from pipesim.errors import ProfileError
    with pytest.raises(ProfileError, match=r"engine_interpreter_share.*\[0, 1\]"):
        Profile(prof.table, {"engine_interpreter_share": {"1": {"Bc": 1.5}}})
    # a replay's measured durations hold their turns already
    durations = {(s, k, m): 1.0 for s in (0, 1) for k in "FB" for m in range(4)}
    replays = [simulate(with_hooks(h), plan, gpu, durations=durations) for h in (0.0, 1.0)]
    assert metrics(replays[0]).iteration_time_s == metrics(replays[1]).iteration_time_s


def test_host_shares_come_from_the_host_columns_and_default_to_the_whole_action():
    prof = uniform_profile(4, sizes=(1, 2))
    plan = Plan([2, 2], 2, 2, checkpoint="never")
    assert PlanCosts(prof, plan).cost(0, 0).host_bwd_share == 1.0
    c = PlanCosts(_with_host(prof, 0.25, 0.5), plan).cost(0, 0)
    assert (c.host_fwd_share, c.host_bwd_share) == pytest.approx((0.25, 0.5))
    # issuing cannot take longer than the action it issues
    assert PlanCosts(_with_host(prof, 3.0, 2.0), plan).cost(1, 1).host_fwd_share == 1.0


def test_a_blocking_send_holds_its_sender_until_its_bytes_are_written():
    # uniform layers: F = 1 s a sample; each micro-batch's 100-byte activation takes 0.5 s
    # on the link.  Streamed in the background, stage 0's second forward follows its first
    # at once; written from the sender's thread (gloo), 0.5 s later -- and its arrival at
    # stage 1 is the same either way
    prof = uniform_profile(2, sizes=(1, 2))
    plan = Plan([1, 1], 2, 2, checkpoint="never", schedule="gpipe")
    devices = [Device(f"d{i}") for i in range(2)]
    streamed = Cluster(devices, link=Link(0.0, 200.0))
    blocking = dataclasses.replace(streamed, blocking_sends=True)
    for cluster, wait in ((streamed, 0.0), (blocking, 0.5)):
        f = simulate(prof, plan, cluster).actions.query("kind == 'F'").set_index(
            ["stage", "microbatch"])
        assert f.loc[(0, 1), "start"] == pytest.approx(f.loc[(0, 0), "end"] + wait)
        assert f.loc[(1, 0), "start"] == pytest.approx(f.loc[(0, 0), "end"] + 0.5)
    # a local hand-over costs nothing, blocking or not
    one = dataclasses.replace(blocking, devices=[Device("w0", physical="cpu0"),
                                                 Device("w1", physical="cpu0")])
    assert metrics(simulate(prof, plan, one)).iteration_time_s == pytest.approx(
        metrics(simulate(prof, plan, dataclasses.replace(one, blocking_sends=False))).iteration_time_s)
    assert Cluster.from_dict(blocking.to_dict()).blocking_sends


def _shared_lock_ends(jobs: dict[str, tuple[float, float, float, float]]) -> dict[str, float]:
    """When each job ends on one lock shared by processor sharing (interpreter law): name
    -> (seconds of work, slowdown, priority, start time)."""
    import simpy

    from pipesim.contention import ProcessorSharing, interpreter_law

    env = simpy.Environment()
    lock = ProcessorSharing(env, interpreter_law)
    ends = {}

    def job(name, seconds, slowdown, priority, at):
        yield env.timeout(at)
        yield lock.run(seconds, slowdown, priority)
        ends[name] = env.now

    for name, args in jobs.items():
        env.process(job(name, *args))
    env.run()
    return ends


def test_a_slowed_job_loses_its_slowdown_only_while_it_has_company():
    # A (slowdown 1.5) beside B (1 s each): B at 1/2 ends at 2 s, A has done 2/3 at 1/3
    # and finishes its last third alone; C alone later is not slowed at all
    ends = _shared_lock_ends({"A": (1.0, 1.5, 0, 0.0), "B": (1.0, 1.0, 0, 0.0),
                              "C": (1.0, 3.0, 0, 5.0)})
    assert ends == pytest.approx({"B": 2.0, "A": 2.0 + 1.0 / 3.0, "C": 6.0})


def test_a_job_of_higher_priority_is_served_alone_and_the_others_wait():
    #   A (0) |=====..........=====|     A does 1 s, waits while B and C are served,
    #   B (1)       |==========|           B and C (equal priority) share the thread:
    #   C (1)       |==========|           each 1 s of work in 2 s
    ends = _shared_lock_ends({"A": (2.0, 1.0, 0, 0.0), "B": (1.0, 1.0, 1, 1.0),
                              "C": (1.0, 1.0, 1, 1.0)})
    assert ends == pytest.approx({"B": 3.0, "C": 3.0, "A": 4.0})


def test_a_paused_resource_serves_nobody_and_keeps_their_work():
    #   A |==....==|        A: 2 s of work from 0; paused 1-3 (twice over, 1.5-2.5),
    #   B    |.....====|    B: 1 s from 1.5: A and B share the thread from 3
    import simpy

    from pipesim.contention import ProcessorSharing, interpreter_law

    env = simpy.Environment()
    lock = ProcessorSharing(env, interpreter_law)
    ends = {}

    def job(name, seconds, at):
        yield env.timeout(at)
        yield lock.run(seconds)
        ends[name] = env.now

    def pause(at, until):
        yield env.timeout(at)
        lock.pause()
        yield env.timeout(until - at)
        lock.resume()

    env.process(job("A", 2.0, 0.0))
    env.process(job("B", 1.0, 1.5))
    env.process(pause(1.0, 3.0))
    env.process(pause(1.5, 2.5))
    env.run()
    assert ends == pytest.approx({"A": 5.0, "B": 5.0})
    with pytest.raises(RuntimeError, match="resume without a pause"):
        lock.resume()


def test_autograds_thread_serves_the_worker_whose_forwards_create_more_nodes_first():
    # two stages as threads on one GPU (streams fully concurrent), GPipe, 2 micro-batches
    # of 1 sample, one layer a stage; the engine holds each backward whole.  B(1,a) and
    # B(0,b) both start at 3F + B, when B(1,b) ends:
    #   fair (no node counts)     each at half speed, both end at 3F + 3B
    #   stage 1 makes more nodes  B(1,a) alone to 3F + 2B, then B(0,b) to 3F + 3B
    #   stage 0 makes more nodes  B(0,b) alone to 3F + 2B, then B(1,a) to 3F + 3B
    plan = Plan([1, 1], 2, 2, checkpoint="never")
    gpu, _ = _two_threads_on_a_gpu()
    prof = _with_host(uniform_profile(2, sizes=(1, 2)), 1.0, 1.0)

    def backward_ends(nodes: tuple[int, int] | None) -> dict[tuple[int, int], float]:
        p = prof if nodes is None else Profile(
            prof.table.assign(autograd_nodes=prof.table.layer.map(dict(enumerate(nodes)))),
            prof.meta)
        b = simulate(p, plan, gpu).actions.query("kind == 'B'")
        return {(r.stage, r.microbatch): r.end for r in b.itertuples()}

    fair, later, earlier = backward_ends(None), backward_ends((3, 5)), backward_ends((5, 3))
    assert fair[(0, 1)] == fair[(1, 0)] == pytest.approx(3 * F + 3 * B)
    assert later[(1, 0)] == pytest.approx(3 * F + 2 * B)
    assert later[(0, 1)] == pytest.approx(3 * F + 3 * B)
    assert earlier[(0, 1)] == pytest.approx(3 * F + 2 * B)
    assert earlier[(1, 0)] == pytest.approx(3 * F + 3 * B)
    # equal counts share the thread as if none were known
    assert backward_ends((4, 4)) == pytest.approx(fair)


def test_the_interpreter_slowdown_is_read_per_pass_and_validated():
    from pipesim.errors import ProfileError

    prof = uniform_profile(2, sizes=(1, 4))
    slow = Profile(prof.table, {"interpreter_slowdown": {"1": {"F": 1.0, "Fc": 1.5},
                                                         "4": {"F": 1.2, "Fc": 1.5}}})
    assert slow.interpreter_slowdown(4) == pytest.approx({"F": 1.2, "B": 1.0, "Fc": 1.5,
                                                         "Bc": 1.0})
    assert prof.interpreter_slowdown(2) == {"F": 1.0, "B": 1.0, "Fc": 1.0, "Bc": 1.0}
    with pytest.raises(ProfileError, match="at least 1"):
        Profile(prof.table, {"interpreter_slowdown": {"1": {"F": 0.5}}})
    # a checkpointed micro-batch's actions carry the checkpointed passes' slowdowns
    cost = PlanCosts(slow, Plan([1, 1], 2, 2, checkpoint="always")).cost(0, 0)
    assert (cost.interpreter_fwd_slowdown, cost.interpreter_bwd_slowdown) == (1.5, 1.0)


def test_the_interpreter_share_is_read_between_sizes_and_validated():
    from pipesim.errors import ProfileError

    prof = uniform_profile(2, sizes=(1, 4))
    shares = Profile(prof.table, {"interpreter_share": {"1": {"F": 1.0, "B": 0.2},
                                                        "4": {"F": 0.4, "B": 0.2}}})
    assert shares.interpreter_share(2) == pytest.approx((0.8, 0.2))
    assert prof.interpreter_share(2) is None
    with pytest.raises(ProfileError, match=r"interpreter_share.*\[0, 1\]"):
        Profile(prof.table, {"interpreter_share": {"1": {"F": 1.5, "B": 0.0}}})
    with pytest.raises(ProfileError, match="interpreter_share"):
        Profile(prof.table, {"interpreter_share": {"1": 0.5}})


def test_a_recomputation_builds_its_activations_up_layer_by_layer():
    # two equal layers, checkpointed: the re-run forward inside the backward brings each
    # layer's saved tensors back as that layer's re-run ends, not all at the start
    prof = uniform_profile(2, sizes=(1, 2))
    trace = simulate(prof, Plan([2], 1, 1, checkpoint="always"))
    r = trace.actions.query("kind == 'R'").iloc[0]
    acts = trace.memory_by_category.query("category == 'activations'")
    rises = acts[(acts.time > r.start) & (acts.time <= r.end + 1e-12) & (acts.bytes.diff() > 0)]
    assert list(rises.time) == pytest.approx([r.start + (r.end - r.start) / 2, r.end])


def test_the_noise_floor_compares_one_schedule_measured_twice():
    from experiments.validation import noise_floor

    rows = [dict(model="a", balance="1,1", checkpoint="never", chunks=1, schedule="gpipe",
                 measured_ms=10.0),
            dict(model="a", balance="1,1", checkpoint="never", chunks=1, schedule="1f1b",
                 measured_ms=11.0),
            dict(model="a", balance="1,1", checkpoint="always", chunks=1, schedule="gpipe",
                 measured_ms=20.0),
            dict(model="a", balance="1,1", checkpoint="always", chunks=1, schedule="1f1b",
                 measured_ms=19.0),
            dict(model="a", balance="1,1", checkpoint="never", chunks=4, schedule="1f1b",
                 measured_ms=99.0)]
    assert noise_floor(pd.DataFrame(rows)) == pytest.approx((7.5, 10.0))
    assert noise_floor(pd.DataFrame(rows[:1] + rows[4:])) is None


def test_one_runs_error_is_read_against_its_noise_on_a_line_to_zero_noise():
    from experiments.grid_history import error_against_noise

    # four runs on error = 2% + 0.5 x noise, one without a noise reading (left out)
    per_run = {r: {"median_abs_error_pct": 2.0 + 0.5 * n}
               for r, n in (("a", 4.0), ("b", 8.0), ("c", 12.0), ("d", 5.0))}
    per_run["e"] = {"median_abs_error_pct": 40.0}
    conditions = {r: {"pass_noise_median_pct": n}
                  for r, n in (("a", 4.0), ("b", 8.0), ("c", 12.0), ("d", 5.0))}
    conditions["e"] = {"pass_noise_median_pct": None}
    line = error_against_noise(per_run, conditions)
    assert line["runs"] == 4 and line["r"] == pytest.approx(1.0)
    assert (line["at_zero_noise_pct"], line["per_noise_point"]) == pytest.approx((2.0, 0.5))
    assert (line["quiet_runs"], line["quiet_median_abs_error_pct"]) == (2, pytest.approx(4.25))
    assert error_against_noise({"a": per_run["a"]}, conditions) is None


def test_a_plans_prediction_tracks_the_machines_speed_read_beside_it():
    from experiments.validation import drift_tracked, reference_ms

    # a model's three plans measured while the machine ran at its median speed, 10%
    # slower and 10% faster (the reference read beside each): the prediction follows
    table = pd.DataFrame({"model": ["a", "a", "a", "b"], "predicted_ms": [10.0, 20.0, 30.0, 5.0],
                          "reference_ms": [2.0, 2.2, 1.8, 7.0]})
    assert drift_tracked(table).tolist() == pytest.approx([10.0, 22.0, 27.0, 5.0])
    assert drift_tracked(table.drop(columns="reference_ms")).isna().all()
    # a plan's reading: the mean over its passes, or its one; NaN where none was read
    assert reference_ms(Trace(pd.DataFrame(), meta={"pass_reference_s": [0.002, 0.004]})) \
        == pytest.approx(3.0)
    assert reference_ms(Trace(pd.DataFrame(), meta={"reference_s": 0.001})) == pytest.approx(1.0)
    assert np.isnan(reference_ms(Trace(pd.DataFrame(), meta={})))


def test_a_runs_phase_clock_keeps_each_phases_seconds_and_sums_a_recurring_one(
        monkeypatch, capsys):
    import experiments.common as common

    now = iter([100.0, 103.0, 110.0, 111.5])  # start, then three marks
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(now))
    clock = common.PhaseClock()
    clock.mark("calibration")
    clock.mark("mlp: profile")
    clock.mark("calibration")
    assert clock.seconds == pytest.approx({"calibration": 4.5, "mlp: profile": 7.0})
    assert "[    10 s] mlp: profile: 7 s" in capsys.readouterr().out


def test_each_recorded_source_reports_its_own_noise_floor_once_over_its_variants():
    from experiments.repredict_evidence import summarise

    def row(source, schedule, measured, variant, predicted):
        return dict(source=source, model="mlp", dtype="float32", balance="4,5", chunks=1,
                    checkpoint="never", schedule=schedule, plan=f"{schedule} m=1",
                    variant=variant, predicted_ms=predicted, measured_ms=measured,
                    bubble_pred=0.5, bubble_meas=0.5)

    rows = [row("traces", s, m, v, 10.0) for s, m in (("gpipe", 10.0), ("1f1b", 12.0))
            for v in ("recorded", "today")]
    rows.append(row("cpu16", "gpipe", 10.0, "recorded", 11.0))  # no pair: no floor
    out = summarise(pd.DataFrame(rows)).set_index(["source", "variant"])
    # the pair 20% apart, under every variant alike (the same measurements)
    assert out.loc[("traces", "today"), "noise_floor_median_pct"] == pytest.approx(20.0)
    assert out.loc[("traces", "recorded"), "noise_floor_max_pct"] == pytest.approx(20.0)
    assert out.loc[("traces", "today"), "median_abs_err_pct"] == pytest.approx(8.333, rel=1e-3)
    assert np.isnan(out.loc[("cpu16", "recorded"), "noise_floor_median_pct"])


def test_memory_shape_reads_each_timeline_on_its_own_step():
    from pipesim.compare import memory_shape

    def timeline(times, levels):
        return pd.DataFrame({"time": times, "bytes": levels})

    # the same shape, the measured step twice as long: the peak falls at the same place
    pred = timeline([0.0, 1.0, 2.0, 3.0, 4.0], [10, 30, 50, 20, 10])
    meas = timeline([0.0, 2.0, 4.0, 6.0, 8.0], [10, 30, 50, 20, 10])
    same = memory_shape(pred, meas)
    assert same["peak_shift"] == pytest.approx(0.0, abs=0.01)
    assert same["peak_at_pred"] == pytest.approx(0.5, abs=0.01)
    assert same["shape_error"] == pytest.approx(0.0)
    # the peak a quarter of a step late, the levels otherwise alike
    late = timeline([0.0, 1.0, 3.0, 4.0], [10, 30, 50, 10])
    shifted = memory_shape(pred, late)
    assert shifted["peak_shift"] == pytest.approx(-0.25, abs=0.01)
    assert shifted["shape_error"] > 0.0
    with pytest.raises(ValueError, match="both sides"):
        memory_shape(pred, timeline([], []))


def test_memory_shape_along_the_schedule_ignores_how_long_each_action_took():
    from pipesim.compare import memory_shape

    # two actions: the first holds 40 bytes, the second 20.  Measured, the second took
    # four times as long: by time the shapes differ, along the schedule they are one
    pred = pd.DataFrame({"time": [0.0, 1.0, 2.0], "bytes": [40, 20, 10]})
    meas = pd.DataFrame({"time": [0.0, 1.0, 5.0], "bytes": [40, 20, 10]})
    by_time = memory_shape(pred, meas)
    along = memory_shape(pred, meas, predicted_actions=[(0.0, 1.0), (1.0, 2.0)],
                         measured_actions=[(0.0, 1.0), (1.0, 5.0)])
    assert by_time["shape_error"] == pytest.approx(0.15, abs=0.01)
    assert along["shape_error"] == pytest.approx(0.0, abs=0.01)
    assert along["peak_shift"] == pytest.approx(0.0, abs=0.01)


def test_traces_of_one_plan_join_into_one_with_every_iteration():
    prof = uniform_profile(2, sizes=(1, 2))
    plan = Plan([1, 1], 2, 2, checkpoint="never")
    one = simulate(prof, plan, iterations=2)
    slow = simulate(prof, plan, Cluster([Device("a"), Device("b")], compute_overhead_s=F),
                    iterations=1)
    joined = Trace.joined([one, slow])
    assert sorted(joined.actions.iteration.unique()) == [0, 1, 2]
    assert joined.meta["iterations"] == 3 and joined.meta["runs"] == 2
    times = metrics(joined).iteration_times_s
    assert times == pytest.approx(metrics(one).iteration_times_s + metrics(slow).iteration_times_s)
    # laid end to end: the second run starts after the first ends
    first_end = joined.actions[joined.actions.iteration == 1].end.max()
    assert joined.actions[joined.actions.iteration == 2].start.min() >= first_end
    with pytest.raises(ValueError, match="at least one"):
        Trace.joined([])


def _fake_grid(speeds):
    """A Measure that 'runs' plans as simulations, each call on a machine ``speeds[k]``
    times slower (call k), and counts the orders it was asked in."""
    prof = uniform_profile(2, sizes=(1, 2, 4))
    calls = []

    def measure(plans):
        slow = speeds[len(calls)]
        calls.append([p.label() for p in plans])
        cluster = Cluster([Device("a"), Device("b")], compute_overhead_s=(slow - 1) * F)
        return [simulate(prof, p, cluster, iterations=2) for p in plans]

    return prof, measure, calls


def test_a_grid_measured_in_passes_joins_each_plans_runs_and_reports_their_spread():
    from experiments.validation import in_passes, pass_noise

    prof, measure, calls = _fake_grid([1.0, 2.0])
    plans = [Plan([1, 1], m, 4, checkpoint="never") for m in (1, 2, 4)]
    traces = in_passes(measure, 2)(plans)
    # the second pass runs the grid backwards; each plan keeps both passes' iterations
    assert calls[1] == calls[0][::-1]
    assert [t.meta["iterations"] for t in traces] == [4, 4, 4]
    for t in traces:
        first, second = t.meta["pass_iteration_s"]
        assert second > first  # the slower machine of the second pass
    median, worst = pass_noise(traces)
    assert 0 < median <= worst
    assert pass_noise([simulate(prof, plans[0])]) is None
    assert in_passes(measure, 1) is measure


def test_a_grid_in_four_passes_also_says_what_its_first_two_measured():
    from experiments.validation import (
        first_passes_ms,
        in_passes,
        pass_columns,
        summarise_two_passes,
    )

    # passes 1 and 2 on a slow machine (+2 s an action), 3 and 4 at the usual speed (and
    # the two of the grid after)
    _, measure, calls = _fake_grid([3.0, 3.0, 1.0, 1.0, 1.0, 1.0])
    plans = [Plan([1, 1], m, 4, checkpoint="never") for m in (1, 2)]
    for t in in_passes(measure, 4)(plans):
        slow, _, fast, _ = t.meta["pass_iteration_s"]
        assert t.meta["pass_iterations"] == [2, 2, 2, 2]
        assert first_passes_ms(t) == pytest.approx(1e3 * slow)  # the first two alone
        assert first_passes_ms(t, 4) != first_passes_ms(t, 4)  # NaN: no more passes to drop
        assert 1e3 * fast < 1e3 * metrics(t).iteration_time_s < first_passes_ms(t)
        row = pass_columns(t)
        assert [float(x) for x in row["pass_ms"].split(";")] == pytest.approx(
            [1e3 * x for x in t.meta["pass_iteration_s"]], rel=1e-6)
    # two passes: nothing to compare with
    two = in_passes(measure, 2)(plans)
    assert len(calls) == 6
    assert all(first_passes_ms(t) != first_passes_ms(t) for t in two)
    table = pd.DataFrame({"predicted_ms": [10.0, 20.0], "measured_ms_two_passes": [8.0, 25.0]})
    assert summarise_two_passes(table)["two_passes"] == {"median_abs_error_pct": 22.5,
                                                         "max_abs_error_pct": 25.0}
    assert summarise_two_passes(table.assign(measured_ms_two_passes=float("nan"))) == {}


def test_a_plan_whose_passes_disagree_is_measured_once_more():
    from experiments.validation import in_passes, pass_noise

    # the second pass ran on a slow machine (2 s more an action), the third at the first's
    _, measure, calls = _fake_grid([1.0, 3.0, 1.0])
    plans = [Plan([1, 1], m, 4, checkpoint="never") for m in (1, 2)]
    traces = in_passes(measure, 2, disagree=0.15)(plans)
    assert len(calls) == 3 and calls[2] == calls[0]  # both apart: a third pass for both
    # a reading between the passes comes after the first alone: not after the last pass,
    # nor after the tie-break
    _, measure, calls = _fake_grid([1.0, 3.0, 1.0])
    seen = []
    in_passes(measure, 2, disagree=0.15, between=lambda k: seen.append((k, len(calls))))(plans)
    assert seen == [(0, 1)] and len(calls) == 3
    for t in traces:
        first, _, third = t.meta["pass_iteration_s"]
        assert t.meta["tie_break"] and third == pytest.approx(first)
        # the joined median is the majority's (2 of 3 passes at the first's speed)
        assert metrics(t).iteration_time_s == pytest.approx(first)
        assert t.meta["iterations"] == 6
    # the noise floor is still the first two passes
    apart = [100 * (t.meta["pass_iteration_s"][1] / t.meta["pass_iteration_s"][0] - 1)
             for t in traces]
    assert pass_noise(traces)[1] == pytest.approx(max(apart))
    # passes within the bound: no third pass
    _, measure, calls = _fake_grid([1.0, 1.1])
    assert not any(t.meta["tie_break"] for t in in_passes(measure, 2, disagree=0.15)(plans))
    assert len(calls) == 2


def _timed(seconds: float) -> Trace:
    """A measured Trace of one iteration ``seconds`` long (one forward)."""
    return Trace(pd.DataFrame({"iteration": [0], "device": [0], "stage": [0],
                               "microbatch": [0], "kind": ["F"], "start": [0.0],
                               "end": [seconds]}))


def test_the_tuners_pick_is_measured_again_beside_the_fastest_plan():
    from experiments.validation import confirm_choice

    plans = [Plan([1, 1], m, 4, checkpoint="never") for m in (1, 2)]
    chosen, best = plans  # predicted fastest, measured fastest
    table = pd.DataFrame({"throughput_pred": [2.0, 1.0], "throughput_meas": [1.0, 2.0]})
    calls = []

    def measure(on):
        """The chosen plan 5% slower than the best; the machine 1% slower every run."""
        def run(ps):
            calls.append([p.label() for p in ps])
            return [_timed(on(p, k)) for k, p in enumerate(ps)]
        return run

    out = confirm_choice(table, plans, measure(lambda p, k: (1.05 if p is chosen else 1.0)
                                               * (1 + 0.01 * k)), rounds=5)
    # one set of processes, the pair's order swapped every round: neither always first
    c, b = chosen.label(), best.label()
    assert calls == [[c, b, b, c, c, b, b, c, c, b]]
    assert out["chosen"] == c and out["best_measured"] == b and out["rounds"] == 5
    # each round's pair read together: the regret is the median of theirs, near the
    # true 1 - 1/1.05 = 4.8% though the machine drifts 1% a run, and no tie
    assert out["regret_low_pct"] <= out["regret_pct"] <= out["regret_high_pct"]
    assert out["regret_low_pct"] > 3.5 and out["regret_high_pct"] < 6.0
    assert not out["tie"]
    # two plans equally fast, each measurement 3% off either way: a regret is read, but
    # the rounds disagree on its sign -- a tie
    tie = confirm_choice(table, plans, measure(lambda p, k: 1.0 + 0.03 * (-1) ** k))
    assert tie["regret_pct"] != 0.0 and tie["tie"]
    assert tie["regret_low_pct"] < 0 < tie["regret_high_pct"]
    # the pick is the best measured: nothing to re-run
    same = confirm_choice(table.assign(throughput_pred=[1.0, 2.0]), plans,
                          measure=lambda _: pytest.fail("re-ran the best plan"))
    assert same["regret_pct"] == 0.0 and same["rounds"] == 0


def test_the_repeat_share_is_read_off_the_whole_model_timed_both_ways():
    prof = uniform_profile(2, fwd_s=F, bwd_s=B)
    sums = prof.table.groupby("micro_batch")[["fwd_s", "bwd_s"]].sum()
    whole = {str(int(b)): {"fwd_s": r.fwd_s, "bwd_s": r.bwd_s, "fwd_repeat_s": 0.5 * r.fwd_s,
                           "bwd_repeat_s": 0.75 * r.bwd_s} for b, r in sums.iterrows()}
    cheaper = Profile(prof.table, {**prof.meta, "whole_model": whole}, prof.source)
    assert cheaper.repeat_factor(1) == pytest.approx((0.5, 0.75))
    # measured only: the simulator does not apply it (the CPU grid was no better with it)
    plan = Plan([1, 1], 4, 4, checkpoint="never", schedule="gpipe")
    assert (metrics(simulate(cheaper, plan)).iteration_time_s
            == pytest.approx(metrics(simulate(prof, plan)).iteration_time_s))
    assert prof.repeat_factor(1) is None


def test_runs_pooled_keep_each_plans_bias_and_lose_the_drift_between_runs():
    import pandas as pd

    from experiments.grid_history import KEY, figures, pooled, prediction_columns

    plan = {"model": "m", "balance": "1,1", "checkpoint": "never", "schedule": "gpipe"}
    rows = []
    # plan m=1: 10% over, 10% under, on time -> no bias; plan m=2 20% over in every run
    for run, drift in (("r1", 1.1), ("r2", 1 / 1.1), ("r3", 1.0)):
        rows.append({**plan, "chunks": 1, "run": run, "measured_ms": 10.0,
                     "predicted_ms": 10.0 * drift, "predicted_ms_x": 10.0})
        rows.append({**plan, "chunks": 2, "run": run, "measured_ms": 5.0 * drift,
                     "predicted_ms": 6.0 * drift, "predicted_ms_x": float("nan")})
    runs = pd.DataFrame(rows)
    assert prediction_columns(runs) == ["predicted_ms"]  # a column some run lacks is left out
    plans = pooled(runs, "predicted_ms").set_index("chunks")
    assert plans.loc[1, "pooled_error_pct"] == pytest.approx(0.0, abs=1e-9)
    assert plans.loc[2, "pooled_error_pct"] == pytest.approx(20.0)
    assert plans.loc[2, "scatter_pct"] == pytest.approx(0.0, abs=1e-9)
    assert plans.loc[1, "scatter_pct"] > 9  # the drift, seen as scatter
    assert set(KEY) <= set(plans.reset_index().columns)
    f = figures(runs, plans.reset_index(), "predicted_ms")
    assert f["runs"] == 3 and f["pooled_max_abs_error_pct"] == pytest.approx(20.0)
    # every run predicts m=2 the faster, and the pooled measurement agrees: no regret
    assert f["regret"]["m"] == {"median_pct": 0.0, "max_pct": 0.0}
    assert f["per_run"]["r3"]["median_abs_error_pct"] == pytest.approx(10.0)


def test_a_grids_error_splits_into_the_plans_bias_the_hours_shift_and_each_sides_scatter():
    import math

    import pandas as pd

    from experiments.error_split import split

    plan = {"model": "m", "balance": "1,1", "checkpoint": "never", "schedule": "gpipe"}
    rows = []
    # three runs at three speeds, the prediction following each run's speed; plan m=2
    # predicted 10% over in every run (a bias); the measurement of m=4 in run r2 lucky
    for run, speed in (("r1", 1.0), ("r2", 1.2), ("r3", 0.9)):
        for chunks, bias in ((1, 1.0), (2, 1.1), (4, 1.0), (8, 1.0), (16, 1.0)):
            luck = 0.8 if (run, chunks) == ("r2", 4) else 1.0
            rows.append({**plan, "chunks": chunks, "run": run,
                         "measured_ms": 10.0 * speed * luck,
                         "predicted_ms": 10.0 * speed * bias})
    parts = split(pd.DataFrame(rows), "predicted_ms")
    assert parts["runs"] == 3 and parts["plans"] == 5
    assert parts["shift_meas_sd_pct"] == pytest.approx(parts["shift_pred_sd_pct"])
    assert parts["shift_error_sd_pct"] == pytest.approx(0.0, abs=1e-9)  # the hour cancels
    assert parts["scatter_pred_sd_pct"] == pytest.approx(0.0, abs=1e-9)
    assert parts["scatter_meas_sd_pct"] > 5  # the lucky measurement alone
    assert math.isnan(parts["scatter_correlation"])  # nothing for the prediction to follow
    # per run, the median plan: on time (the bias and the luck are one plan's each)
    assert parts["grid_median_abs_error_pct"] == pytest.approx(0.0, abs=1e-9)
    assert parts["grid_median_abs_scatter_pct"] == pytest.approx(0.0, abs=1e-9)
    # the typical-time reference: knowing every plan's median time (m=4's: 9.6 ms, r2's
    # lucky one) and each run's shift, r2 reads m=4 at 1 / 1.2 of its shift (-17%), r1
    # and r3 at 1 / 0.96 (+4.2%); every other cell nothing
    assert parts["typical_grid_median_abs_error_pct"] == pytest.approx(0.0, abs=1e-9)
    assert parts["typical_grid_max_abs_error_pct"] == pytest.approx(100 * (1 / 0.96 - 1))
    assert parts["typical_runs_max_within_10_pct"] == pytest.approx(100 * 2 / 3)  # not r2


def test_a_choice_between_plans_that_run_one_program_costs_nothing():
    import pandas as pd

    from experiments.grid_history import figures, pooled
    from experiments.validation import chosen_regret, confirm_choice, program_groups

    # at one micro-batch GPipe and 1F1B are one program, measured 7.6 and 7.4 ms by noise;
    # the prediction ties them and picks 1F1B; m=2 (a program of its own) is slower
    grid = pd.DataFrame({"model": "m", "balance": "1,1", "checkpoint": "never",
                         "chunks": [1, 1, 2], "schedule": ["1f1b", "gpipe", "gpipe"],
                         "measured_ms": [7.6, 7.4, 9.0], "predicted_ms": [7.5, 7.5001, 8.0]})
    assert program_groups(grid).tolist() == [0, 0, 1]
    table = grid.assign(throughput_meas=1 / grid.measured_ms, throughput_pred=1 / grid.predicted_ms)
    assert chosen_regret(table) == 0.0
    # a real miss still counts: m=2 predicted the fastest, slower than the program's mean
    missed = chosen_regret(table.assign(throughput_pred=[1.0, 1.0, 2.0]))
    assert missed == pytest.approx(1 - (1 / 9.0) / ((1 / 7.6 + 1 / 7.4) / 2))
    # confirmed: nothing to re-run
    plans = [Plan([1, 1], c, 4, checkpoint="never", schedule=s)
             for c, s in zip(grid.chunks, grid.schedule, strict=True)]
    out = confirm_choice(table, plans, measure=lambda _: pytest.fail("re-ran one program"))
    assert out["regret_pct"] == 0.0 and out["rounds"] == 0
    # pooled over runs alike
    runs = pd.concat([grid.assign(run=r) for r in ("r1", "r2")])
    f = figures(runs, pooled(runs, "predicted_ms"), "predicted_ms")
    assert f["regret"]["m"] == {"median_pct": 0.0, "max_pct": 0.0}


def test_a_models_cluster_takes_the_medians_of_the_readings_it_is_given():
    from experiments.validation import bracketed

    base = Cluster([Device("a"), Device("b")], action_gap_s=1.0, wakeup_gap_s=1.0)
    c = bracketed(base, [0.1, 0.3], [(2e-4, 4e-4, 3e-4), (4e-4, 8e-4, 6e-4)])
    assert c.host_contention == pytest.approx(0.2)
    assert (c.action_gap_s, c.wakeup_gap_s) == pytest.approx((3e-4, 6e-4))
    # one reading: itself; a reading without a wake-up gap: one gap for both
    assert bracketed(base, [0.1], [(2e-4, 4e-4, 3e-4)]).wakeup_gap_s == pytest.approx(4e-4)
    assert bracketed(base, [0.1], [(2e-4, None, 2e-4), (4e-4, 8e-4, 6e-4)]).wakeup_gap_s is None
    # the in-action overhead where its readings are given, else the cluster's own
    assert c.compute_overhead_s == base.compute_overhead_s
    assert bracketed(base, [0.1], [(2e-4, 4e-4, 3e-4)], [5e-5, 1.5e-4]).compute_overhead_s == \
        pytest.approx(1e-4)
    # the executor's part of the gaps and the wake-up's growth, where every reading has
    # them (the curve point by point; JSON gives its points as lists); else the cluster's
    later = bracketed(base, [0.1], [(2e-4, 4e-4, 3e-4, 4e-5, [[0, 0], [0.01, 2e-4]]),
                                    (4e-4, 8e-4, 6e-4, 6e-5, ((0, 0), (0.01, 4e-4)))])
    assert later.executor_gap_base_s == pytest.approx(5e-5)
    assert [p[0] for p in later.wakeup_curve] == [0.0, 0.01]
    assert [p[1] for p in later.wakeup_curve] == pytest.approx([0.0, 3e-4])
    mixed = bracketed(base, [0.1], [(2e-4, 4e-4, 3e-4), (4e-4, 8e-4, 6e-4, 6e-5, [[0, 0]])])
    assert (mixed.executor_gap_base_s, mixed.wakeup_curve) == (0.0, ())
    # more than two readings: their median, so that one loaded moment does not carry
    assert bracketed(base, [0.02, 0.55, 0.08], [(2e-4, 4e-4, 3e-4)]).host_contention == \
        pytest.approx(0.08)


def test_a_model_takes_the_contention_readings_asked_for_and_its_gaps_around_its_grid(tmp_path):
    import json

    from experiments.validation import READINGS, saved_grid

    uniform_profile(2).save(tmp_path / "profile_cpu_a.csv")
    uniform_profile(2).save(tmp_path / "profile_cpu_b.csv")
    Cluster([Device("a"), Device("b")]).save(tmp_path / "calibration_cpu.json")
    pd.DataFrame([dict(model=m, balance="1,1", chunks=2, checkpoint="never", schedule="gpipe",
                       predicted_ms=1.0, measured_ms=1.0) for m in ("a", "b")]).to_csv(
        tmp_path / "validation_cpu.csv", index=False)
    # a reading before the first grid and after each: b's grid lies between 0.5 and 0.1
    (tmp_path / "validation_cpu.json").write_text(json.dumps({"summary": {
        "host_contention_readings": [0.2, 0.5, 0.1],
        "gap_readings": [[1e-4, 1e-4], [3e-4, 3e-4], [5e-4, 5e-4]]}}))
    contention = {which: {m: c.host_contention for m, c in
                          saved_grid(tmp_path, readings=which).clusters.items()}
                  for which in READINGS}
    assert contention["bracketed"] == pytest.approx({"a": 0.35, "b": 0.3})  # the default
    assert saved_grid(tmp_path).clusters["b"].host_contention == pytest.approx(0.3)
    assert contention["so_far"] == pytest.approx({"a": 0.35, "b": 0.2})
    assert contention["run"] == pytest.approx({"a": 0.2, "b": 0.2})
    # the gaps follow the hour: the two around the grid, whichever contention readings
    assert saved_grid(tmp_path).clusters["b"].action_gap_s == pytest.approx(4e-4)
    with pytest.raises(ValueError, match="readings 'all'"):
        saved_grid(tmp_path, readings="all")


def test_a_saved_run_is_predicted_again_with_the_idle_costs_it_measured(tmp_path):
    import json

    from experiments.validation import predict_saved

    # one GPipe plan, 2 stages x 1 layer, 2 micro-batches: stage 0's backward of
    # micro-batch 1 follows its forward of micro-batch 1 after the pipeline's round trip
    uniform_profile(2).save(tmp_path / "profile_cpu_m.csv")
    Cluster([Device("a"), Device("b")]).save(tmp_path / "calibration_cpu.json")
    pd.DataFrame([dict(model="m", balance="1,1", chunks=2, checkpoint="never",
                       schedule="gpipe", predicted_ms=1.0, measured_ms=1.0)]).to_csv(
        tmp_path / "validation_cpu.csv", index=False)
    curve = [dict(first=0, stop=1, micro_batch=b, checkpointed=False, idle_s=idle,
                  seconds=seconds, kind="B") for b in (1, 64) for idle, seconds in
             ((0.5, 0.0), (100.0, 10.0))]
    (tmp_path / "validation_cpu.json").write_text(json.dumps(
        {"batch": 32, "summary": {"idle_costs": {"m": curve}}}))
    with_own = predict_saved(tmp_path).predicted_ms_now.iloc[0]
    without = predict_saved(tmp_path, idle={}).predicted_ms_now.iloc[0]
    assert with_own > without  # the run's own curve, unless told none
    older = json.loads((tmp_path / "validation_cpu.json").read_text())
    del older["summary"]["idle_costs"]  # a run from before they were measured
    (tmp_path / "validation_cpu.json").write_text(json.dumps(older))
    assert predict_saved(tmp_path).predicted_ms_now.iloc[0] == pytest.approx(without)
    # three CPU threads runs kept theirs under another key, before they were the default
    older["summary"]["idle_costs_in_place"] = {"m": curve}
    (tmp_path / "validation_cpu.json").write_text(json.dumps(older))
    assert predict_saved(tmp_path).predicted_ms_now.iloc[0] == pytest.approx(with_own)
    # run-on costs a run measured (validate.py --run-on) are an ablation: predicted with
    # only when given (GPipe: stage 0's second forward after its first, at half; its
    # backward then waits longer, and pays the curve for it)
    runs = [dict(first=0, stop=1, micro_batch=1, checkpointed=False, kind="F", scale=0.5)]
    older["summary"]["run_on_costs"] = {"m": runs}
    (tmp_path / "validation_cpu.json").write_text(json.dumps(older))
    assert predict_saved(tmp_path).predicted_ms_now.iloc[0] == pytest.approx(with_own)
    assert predict_saved(tmp_path, run_on={"m": runs}).predicted_ms_now.iloc[0] != pytest.approx(
        with_own)


def test_a_run_cut_before_its_predictions_is_predicted_from_what_it_measured(tmp_path):
    from experiments.validation import measured_table, predict_saved

    # validate.py saves each grid as measured before predicting it: a run "measured" by
    # the simulator itself, saved so, is predicted later to exactly what it measured
    prof, cluster = uniform_profile(4), Cluster([Device("a"), Device("b")])
    plans = [Plan([2, 2], chunks, 32, schedule=schedule)
             for chunks in (1, 4) for schedule in ("gpipe", "1f1b")]
    runs = [simulate(prof, plan, cluster) for plan in plans]
    table = measured_table("m", plans, runs)
    assert table.measured_ms.tolist() == pytest.approx(
        [1e3 * metrics(t).iteration_time_s for t in runs])
    assert (table.bubble_meas > 0).all() and (table.peak_meas_bytes > 0).all()
    table.to_csv(tmp_path / "validation_cpu.csv", index=False)
    prof.save(tmp_path / "profile_cpu_m.csv")
    cluster.save(tmp_path / "calibration_cpu.json")
    again = predict_saved(tmp_path)  # no summary: the run never reached it
    assert again.predicted_ms_now.tolist() == pytest.approx(table.measured_ms.tolist())


def test_one_runs_overhead_readings_are_pooled_by_their_median():
    from experiments.repredict_evidence import pooled_overheads

    # the recorded traces' four in-action readings (ms), one model's an outlier
    readings = [(0.0, 0.157), (0.0011, 0.138), (0.064, 0.165), (0.185, 0.145)]
    clusters = [Cluster([Device("a"), Device("b")], compute_overhead_s=inside * 1e-3,
                        action_gap_s=gap * 1e-3) for inside, gap in readings]
    pooled = pooled_overheads(clusters)
    assert pooled["compute_overhead_s"] == pytest.approx((0.0011 + 0.064) / 2 * 1e-3)
    assert pooled["action_gap_s"] == pytest.approx((0.145 + 0.157) / 2 * 1e-3)
    assert "wakeup_gap_s" not in pooled  # none of them measured it: left as it is
    clusters[0].wakeup_gap_s = 3e-4
    assert pooled_overheads(clusters)["wakeup_gap_s"] == pytest.approx(3e-4)


def test_a_measured_concurrency_law_is_borrowed_only_by_a_profile_of_the_same_layers(tmp_path):
    import json

    from experiments.repredict_evidence import _with_stream_law, measured_laws

    law = {"1": [1.0, 1.2], "64": [1.0, 1.05]}
    (tmp_path / "device_speedup.json").write_text(json.dumps(
        {"mlp/float32/2st": {size: {"measured": v, "from_profile": [1.0, 1.0]}
                             for size, v in law.items()}}))
    uniform_profile(3).save(tmp_path / "profile_mlp_float32.csv")
    assert measured_laws(tmp_path) == {"mlp/float32/2st": law}
    older = uniform_profile(3, fwd_s=2.0)  # same layers, its own (older) times
    assert _with_stream_law(older, tmp_path, "mlp/float32/2st").meta["stream_speedup"] == law
    # other layers (parameter bytes), another label, or a size the law lacks: unchanged
    for other, label in ((uniform_profile(3, param_bytes=7), "mlp/float32/2st"),
                         (older, "mlp/bfloat16/2st"),
                         (uniform_profile(3, sizes=(1, 32)), "mlp/float32/2st")):
        assert "stream_speedup" not in _with_stream_law(other, tmp_path, label).meta
    assert measured_laws(tmp_path / "nowhere") == {}


def test_two_readings_of_in_place_rows_are_averaged_per_span_size_and_mode():
    from experiments.validation import mean_readings
    from pipesim.readings import CheckpointExtra, InPlaceCost

    before = [InPlaceCost(0, 2, 4, True, 1.0, 3.0), InPlaceCost(2, 4, 4, True, 5.0, 5.0)]
    after = [InPlaceCost(0, 2, 4, True, 2.0, 5.0), InPlaceCost(0, 2, 4, False, 1.0, 1.0)]
    assert mean_readings(before, after) == [InPlaceCost(0, 2, 4, False, 1.0, 1.0),
                                            InPlaceCost(0, 2, 4, True, 1.5, 4.0),
                                            InPlaceCost(2, 4, 4, True, 5.0, 5.0)]
    assert mean_readings([CheckpointExtra(0, 2, 4, 1.0)], [CheckpointExtra(0, 2, 4, 2.0)]) == \
        [CheckpointExtra(0, 2, 4, 1.5)]


def test_the_median_of_three_idle_readings_leaves_out_a_slow_spells_reading_per_field():
    import statistics

    from experiments.validation import mean_readings
    from pipesim.readings import IdleCost

    def reading(seconds: float, hot_s: float) -> list[IdleCost]:
        return [IdleCost(0, 2, 4, False, 0.005, seconds, "B", hot_s, hot_s + seconds, 1e-3)]

    # the second reading ran in a slow spell: every action slower, its wait's cost too
    median = mean_readings(reading(1e-4, 1.0e-3), reading(9e-4, 1.6e-3), reading(2e-4, 1.1e-3),
                           statistic=statistics.median)
    assert median == reading(2e-4, 1.1e-3)  # the third, field by field
    # the key (span, size, mode, idle, kind, profile seconds) is kept, never averaged
    assert mean_readings(reading(1e-4, 1e-3), [dataclasses.replace(reading(3e-4, 1e-3)[0],
                                                                    kind="F")]) == \
        [*reading(1e-4, 1e-3), dataclasses.replace(reading(3e-4, 1e-3)[0], kind="F")]


def test_a_grids_idle_readings_combine_as_median_mean_none_and_each_alone():
    from experiments.idle_readings import variants
    from pipesim.readings import IdleCost

    rows = [[dataclasses.asdict(IdleCost(0, 2, 4, False, 0.005, s, "B", 1e-3, 1e-3 + s))]
            for s in (1e-4, 9e-4, 2e-4)]
    got = variants({"mlp": rows})
    assert list(got) == ["median", "mean", "none", "reading_1", "reading_2", "reading_3"]
    assert got["median"]["mlp"][0].seconds == 2e-4
    assert abs(got["mean"]["mlp"][0].seconds - 4e-4) < 1e-12
    assert got["none"] == {} and got["reading_2"]["mlp"][0].seconds == 9e-4


def test_interference_by_kind_reads_each_actions_excess_and_its_overlap_by_kind():
    import pandas as pd

    from experiments.interference_by_kind import fit, overlaps
    from pipesim.readings import InPlaceCost

    plan = Plan([1, 1], 2, 2, checkpoint="except_last", schedule="gpipe")  # mb 0 checkpointed
    cluster = Cluster([Device("a"), Device("b")], in_place_costs=(
        InPlaceCost(0, 1, 1, True, 1.0, 2.0), InPlaceCost(1, 2, 1, False, 1.0, 2.0)))
    #   stage 0   Bc(0)  |== 3 s ==|          its lone cost 2 s: 1 s over, beside 2 s of F
    #   stage 1   F(1)        |= 2 s =|       its lone cost 1 s: 1 s over, beside 2 s of Bc
    actions = pd.DataFrame([(0, 0, 0, "B", 0.0, 3.0), (0, 1, 1, "F", 1.0, 3.0)],
                           columns=["iteration", "stage", "microbatch", "kind", "start", "end"])
    rows = overlaps(plan, cluster, actions)
    assert [(r["kind"], r["excess_s"], r["overlap_F"], r["overlap_Bc"]) for r in rows] == [
        ("Bc", 1.0, 2.0, 0.0), ("F", 1.0, 0.0, 2.0)]
    # an unmeasured span is left out; the fit recovers a known slope per pair of kinds
    assert overlaps(plan, Cluster([Device("a"), Device("b")]), actions) == []
    table = pd.DataFrame([{"model": "m", "kind": "F", "excess_s": 0.5 * o,
                           "overlap_F": 0.0, "overlap_Fc": 0.0, "overlap_B": 0.0,
                           "overlap_Bc": o} for o in (1.0, 2.0, 4.0)])
    assert fit(table).iloc[0]["beside_Bc"] == pytest.approx(0.5)


def test_in_place_costs_beside_a_gpu_grid_are_each_figures_median_over_the_readings(tmp_path):
    import json

    from experiments.repredict_evidence import in_place_costs

    def row(first: int, fwd: float) -> dict:
        return {"first": first, "stop": first + 1, "micro_batch": 2, "checkpointed": False,
                "fwd_s": fwd, "bwd_s": 2 * fwd, "between_s": 0.0}

    readings = {"in_place_costs_gpu.json": [row(0, 1.0), row(1, 4.0)],
                "in_place_costs_gpu_repeat.json": [row(0, 3.0), row(1, 4.0)]}
    for name, rows in readings.items():
        (tmp_path / name).write_text(json.dumps({"mlp/float32/2st": rows,
                                                 "_machine": {"device_name": "x"}}))
    pooled = in_place_costs(tmp_path)
    assert list(pooled) == ["mlp/float32/2st"]  # the machine's note is no grid
    assert [(r["first"], r["fwd_s"], r["bwd_s"]) for r in pooled["mlp/float32/2st"]] == [
        (0, 2.0, 4.0), (1, 4.0, 8.0)]
    assert in_place_costs(tmp_path / "nowhere") == {}


def test_the_committed_16_core_grids_are_repredicted_beside_the_recorded_ones():
    import pandas as pd

    from experiments.repredict_evidence import LATEST_GPU, cpu16_latest
    from experiments.validation import row_plan

    rows = pd.DataFrame(cpu16_latest(LATEST_GPU))
    as_run = rows[(rows.variant == "as_run") & (rows.source == "cpu16_4ranks_latest")]
    saved = pd.read_csv(LATEST_GPU / "validation_cpu_4stages.csv")
    # every plan of the 4-rank grid, with the prediction the run made, and re-predicted
    assert len(as_run) == len(saved) == 120
    assert sorted(as_run.predicted_ms) == pytest.approx(sorted(saved.predicted_ms))
    today = rows[(rows.variant == "today") & (rows.source == "cpu16_4ranks_latest")]
    assert len(today) == 120 and today.predicted_ms.gt(0).all()
    # the 8-rank grid was cut after mlp: its finished plans still come back
    assert set(rows[rows.source == "cpu16_8ranks_latest"].model) == {"mlp"}
    # 2026-11-27's mlp grid in a folder of its own, predicted again with the idle costs it
    # measured on every rank at once (not as its ablation without them)
    folder = LATEST_GPU / "h200-2026-11-27"
    saved = pd.read_csv(folder / "validation_cpu_4stages_mlp.csv").assign(
        plan=lambda t: [row_plan(r, 32).label() for r in t.itertuples()]).set_index("plan")
    later = rows[rows.source == "cpu16_4ranks_1127"].pivot_table(
        index="plan", columns="variant", values="predicted_ms").loc[saved.index]
    assert len(later) == 60
    assert later["as_run"].to_numpy() == pytest.approx(saved.predicted_ms.to_numpy())
    without_idle = (later["today"] / saved.predicted_ms_no_idle_costs - 1).abs()
    assert without_idle.gt(0.02).mean() > 0.5
    # the evening's grid (receives posted once inputs are in) comes back as it ran
    evening = rows[rows.source == "cpu16_4ranks_1127e"]
    saved = pd.read_csv(LATEST_GPU / "h200-2026-11-27-evening" / "validation_cpu_4stages_mlp.csv")
    assert len(evening[evening.variant == "as_run"]) == len(saved) == 60
    assert sorted(evening[evening.variant == "as_run"].predicted_ms) == pytest.approx(
        sorted(saved.predicted_ms))


def test_action_costs_reads_a_runs_actions_against_their_predicted_seconds_alone():
    from experiments.action_costs import action_ratios, overlap_class, parse_plan

    prof = uniform_profile(2)  # F = 1 s per sample and layer
    plan = parse_plan("gpipe [1,1] m=2 ckpt=never", 2)
    assert (list(plan.balance), plan.n_microbatches, plan.checkpoint) == ([1, 1], 2, "never")
    host = Cluster([Device("a", host="h"), Device("b", host="h")], host_contention=0.5)
    # a "run" that is the simulation with contention: the overlapping actions take 1.5x
    trace = simulate(prof, plan, host)
    actions = trace.actions.assign(model="m", plan="gpipe [1,1] m=2 ckpt=never")
    table = action_ratios(actions, {"m": prof}, host, batch=2)
    f = table[table.kind == "F"].set_index(["stage", "overlap"])
    # stage 0's F0 runs alone at its profile; stage 0's F1 and stage 1's F0 run together
    assert f.loc[(0, "alone"), "ratio"] == pytest.approx(1.0)
    assert f.loc[(0, "overlapping"), "ratio"] == pytest.approx(1.5)
    assert f.loc[(1, "overlapping"), "ratio"] == pytest.approx(1.5)
    assert [overlap_class(x) for x in (0.05, 0.5, 0.95)] == ["alone", "partly", "overlapping"]
    # the idle before each action on its device: a device's first action has none (stage
    # 0's F0, stage 1's F0); stage 0's F1 follows its F0 at once
    idle = table.set_index(["stage", "kind", "overlap"]).idle_s
    assert np.isnan(idle.loc[(0, "F", "alone")]) and np.isnan(idle.loc[(1, "F", "overlapping")])
    assert idle.loc[(0, "F", "overlapping")] == pytest.approx(0.0)


def test_action_costs_finds_the_last_stages_late_backwards():
    from experiments.action_costs import action_ratios, late_backwards

    prof = uniform_profile(2)  # B = 2 s per sample and layer
    host = Cluster([Device("a"), Device("b")], action_gap_s=1e-4)
    trace = simulate(prof, Plan([1, 1], 4, 4, checkpoint="never"), host)
    # stage 1's third backward (B1: GPipe runs B3 B2 B1 B0) starts 1 ms late and runs
    # 0.5 s over; the others as simulated
    a = trace.actions.assign(model="m", plan="gpipe [1,1] m=4 ckpt=never")
    late = (a.stage == 1) & (a.kind == "B") & (a.microbatch == 1)
    a.loc[late, "start"] += 1e-3
    a.loc[late, "end"] += 0.501
    for later in ((a.device == 1) & (a.start > a.loc[late, "start"].iloc[0])).to_numpy().nonzero():
        a.loc[a.index[later], ["start", "end"]] += 0.501
    out = late_backwards(action_ratios(a, {"m": prof}, host, batch=4)).set_index(
        ["model", "schedule"]).loc[("m", "gpipe")]
    # three backwards after a backward (B2, B1, B0), one of them late
    assert out.backwards == 3 and out.late_share == pytest.approx(1 / 3)
    assert out.gap_ms_late == pytest.approx(1.1, abs=1e-6)
    assert out.over_alone_ms_late == pytest.approx(500.0, abs=1e-6)
    assert out.gap_ms_on_time == pytest.approx(0.1, abs=1e-6)
    assert out.over_alone_ms_on_time == pytest.approx(0.0, abs=1e-6)


def test_action_costs_predicts_a_runs_busy_seconds_under_each_host_law():
    from experiments.action_costs import busy_by_law

    prof = uniform_profile(2)
    host = Cluster([Device("a", host="h"), Device("b", host="h")], host_contention=0.5)
    # a "run" that is the simulation under the calibrated law: that law predicts it exactly,
    # no contention predicts less busy time (its overlapping actions at their profile)
    trace = simulate(prof, Plan([1, 1], 2, 2, checkpoint="never"), host)
    actions = trace.actions.assign(model="m", plan="gpipe [1,1] m=2 ckpt=never")
    (row,) = busy_by_law(actions, prof, host, 2, own=0.25, run="r")
    assert row["busy_ms_calibrated"] == pytest.approx(row["busy_ms"])
    assert row["iteration_ms_calibrated"] == pytest.approx(row["iteration_ms"])
    assert row["busy_ms_none"] < row["busy_ms_own_layers"] < row["busy_ms"]


def test_action_costs_bins_an_action_by_the_idle_before_it():
    from experiments.action_costs import idle_bin, idles_before

    #   device 0  |==|  |====|         device 1     |==|      |=|
    #             0  1  2    4                      2  3      6 7
    actions = pd.DataFrame([(0, 0.0, 1.0), (0, 2.0, 4.0), (1, 2.0, 3.0), (1, 6.0, 7.0)],
                           columns=["device", "start", "end"])
    idles = idles_before(actions)
    assert np.isnan(idles[0]) and np.isnan(idles[2])
    assert (idles[1], idles[3]) == (1.0, 3.0)
    assert [idle_bin(x) for x in (float("nan"), 0.0001, 0.002, 0.02)] == [
        "first", "hot <= 0.3 ms", "0.3-3 ms", "> 3 ms"]


def test_an_overtaking_is_a_later_backward_of_the_other_stage_ending_first():
    from experiments.engine_order import overtakings

    #   stage 0  B(0,0) |==========|         B(0,1)      |====|
    #   stage 1  B(1,1)    |===|     B(1,2) |======|
    # B(1,1) arrived during B(0,0) and ended first (stage 1 overtook); B(0,1) arrived
    # during B(1,2) and ended first (stage 0 overtook); the F is not a backward
    actions = pd.DataFrame(
        [(0, 0, 0, "B", 0.0, 10.0), (0, 1, 1, "B", 3.0, 6.0), (0, 1, 2, "B", 11.0, 18.0),
         (0, 0, 1, "B", 12.0, 16.0), (0, 1, 3, "F", 1.0, 20.0)],
        columns=["iteration", "stage", "microbatch", "kind", "start", "end"])
    assert overtakings(actions) == {"pairs_1": 1, "over_1": 1, "pairs_0": 1, "over_0": 1}
    # the same backwards without overlap: no pairs
    apart = actions.assign(start=[0.0, 11.0, 30.0, 41.0, 1.0], end=[10.0, 14.0, 38.0, 45.0, 2.0])
    assert overtakings(apart) == {"pairs_1": 0, "over_1": 0, "pairs_0": 0, "over_0": 0}


def _paired(prof: Profile, ratios: dict[str, float] | None = None) -> Profile:
    """``prof`` with every pair of passes measured at ratio 1 (beside another pass as
    fast as alone) but for ``ratios``, at every size."""
    from pipesim.profile import PAIRS

    row = {pair: 1.0 for pair in PAIRS} | (ratios or {})
    return Profile(prof.table, {**prof.meta, "pair_slowdown": {
        str(b): row for b in prof.micro_batch_sizes}})


def test_threads_sharing_by_pairs_slow_each_pass_by_what_runs_beside_it():
    gpu, _ = _two_threads_on_a_gpu()
    paired = dataclasses.replace(gpu, thread_pairs=True)
    apart = Cluster([Device(f"w{i}", physical=f"cuda:{i}") for i in range(2)])
    prof = uniform_profile(2, sizes=(1, 2))
    plan = Plan([1, 1], 4, 4, checkpoint="never")
    free = metrics(simulate(prof, plan, apart)).iteration_time_s
    # pairs measured as fast as alone: each thread as if it had the device and the
    # interpreter to itself (the pairs hold the device law, interpreter and engine)
    assert metrics(simulate(_paired(prof), plan, paired)).iteration_time_s == pytest.approx(free)
    # on a device they would otherwise take turns on, too
    serial = dataclasses.replace(paired, device_sharing="serial")
    assert metrics(simulate(_paired(prof), plan, serial)).iteration_time_s == pytest.approx(free)
    assert metrics(simulate(prof, plan, dataclasses.replace(
        serial, thread_pairs=False))).iteration_time_s > free * 1.2
    # a forward beside a forward twice as slow, nothing else: in the steady state stage
    # 0's F(m+1) runs beside stage 1's F(m), each 2x while together (processor sharing
    # of two equal F at rate 1/2: both last 2 F)
    slow = simulate(_paired(prof, {"F|F": 2.0}), plan, paired)
    f = slow.actions.query("kind == 'F'").set_index(["stage", "microbatch"])
    assert f.loc[(0, 0), "end"] - f.loc[(0, 0), "start"] == pytest.approx(F)  # alone
    assert f.loc[(0, 1), "end"] - f.loc[(0, 1), "start"] == pytest.approx(2 * F)
    # one direction only: F beside B slowed, B beside F not -- the backward keeps its time
    one_way = simulate(_paired(prof, {"B|F": 3.0}), Plan([1, 1], 4, 4, checkpoint="never",
                                                          schedule="1f1b"), paired)
    b = one_way.actions.query("kind == 'B' and stage == 1").set_index("microbatch")
    durations = (b.end - b.start).round(9)
    assert durations.min() == pytest.approx(B)  # a backward with nothing beside it
    assert durations.max() > B  # one that met a forward of stage 0
    fwd = one_way.actions.query("kind == 'F'")
    assert ((fwd.end - fwd.start).round(9) == F).all()  # forwards never slowed


def test_a_checkpointed_micro_batchs_passes_are_their_own_pairs():
    gpu, _ = _two_threads_on_a_gpu()
    paired = dataclasses.replace(gpu, thread_pairs=True)
    # (1F1B: stage 1's backwards run beside stage 0's forwards)
    prof = _paired(uniform_profile(2, sizes=(1, 2)), {"Bc|F": 4.0, "Bc|Fc": 4.0})
    fair = _paired(uniform_profile(2, sizes=(1, 2)))

    def iteration(profile: Profile, mode: str) -> float:
        plan = Plan([1, 1], 4, 4, checkpoint=mode, schedule="1f1b")
        return metrics(simulate(profile, plan, paired)).iteration_time_s

    assert iteration(prof, "never") == pytest.approx(iteration(fair, "never"))  # no Bc in it
    assert iteration(prof, "always") > iteration(fair, "always") * 1.05  # Bc beside forwards


def test_thread_pairs_need_a_profile_that_measured_them_and_round_trip(tmp_path):
    from pipesim.errors import ClusterError, ProfileError

    gpu, _ = _two_threads_on_a_gpu()
    paired = dataclasses.replace(gpu, thread_pairs=True)
    prof = uniform_profile(2, sizes=(1, 2))
    with pytest.raises(ClusterError, match="pair_slowdown"):
        simulate(prof, Plan([1, 1], 2, 2), paired)
    assert Cluster.load(paired.save(tmp_path / "c.json")).thread_pairs
    # a lone process's workers have no pairs to need
    simulate(prof, Plan([1, 1], 2, 2), dataclasses.replace(
        paired, devices=[dataclasses.replace(d, process="") for d in paired.devices]))
    measured = _paired(prof, {"F|B": 1.5})
    assert measured.pair_slowdown(1)["F|B"] == 1.5
    assert prof.pair_slowdown(1) is None
    with pytest.raises(ProfileError, match="pair_slowdown"):
        Profile(prof.table, {"pair_slowdown": {"1": {"F|F": 1.0}}})  # a pair missing
    with pytest.raises(ProfileError, match="positive"):
        _paired(prof, {"F|F": 0.0})


def test_pair_sharing_slows_each_action_by_the_passes_beside_it():
    import simpy

    from pipesim.contention import PairSharing
    from pipesim.profile import PAIR_KINDS

    def ends(jobs: list[tuple[float, str, dict[str, float]]]) -> list[float]:
        """End times of ``(seconds, pass, {other pass: ratio})`` started together."""
        env = simpy.Environment()
        share = PairSharing(env, PAIR_KINDS)
        done: list[float] = [0.0] * len(jobs)
        for i, (seconds, kind, ratios) in enumerate(jobs):
            row = tuple(ratios.get(k, 1.0) for k in PAIR_KINDS)
            share.run_pass(seconds, kind, row).callbacks.append(
                lambda _e, i=i: done.__setitem__(i, env.now))
        env.run()
        return done

    # two forwards that slow each other 2x: both end at 2 s
    assert ends([(1.0, "F", {"F": 2.0})] * 2) == pytest.approx([2.0, 2.0])
    # one direction: the forward runs at 1/3 beside the backward, which runs unhindered
    # (1 s); then alone, the forward's 2/3 s left
    assert ends([(1.0, "F", {"B": 3.0}), (1.0, "B", {})]) == pytest.approx([5 / 3, 1.0])
    # a third thread adds its own slowdown (1 + 1 + 1): each at 1/3
    assert ends([(1.0, "F", {"F": 2.0})] * 3) == pytest.approx([3.0] * 3)
    # a ratio under 1 (a measurement's noise) does not speed an action up
    assert ends([(1.0, "F", {"F": 0.8})] * 2) == pytest.approx([1.0, 1.0])
    with pytest.raises(ValueError, match="ratio beside each"):
        PairSharing(simpy.Environment(), PAIR_KINDS).run_pass(1.0, "X", (1.0,) * 4)


def test_a_paired_grid_measures_each_plans_schedules_side_by_side():
    from experiments.validation import grid, paired

    plans = grid(uniform_profile(4), 2, 8, chunks=(1, 2), checkpoints=("never", "always"))
    assert [p.schedule for p in plans[:len(plans) // 2]] == ["gpipe"] * (len(plans) // 2)
    out = paired(plans)
    assert sorted(p.label() for p in out) == sorted(p.label() for p in plans)
    for a, b in zip(out[::2], out[1::2], strict=True):  # twins, one after the other
        assert (a.schedule, b.schedule) == ("gpipe", "1f1b")
        assert (a.balance, a.chunks, a.checkpoint) == (b.balance, b.chunks, b.checkpoint)


def test_a_message_landing_in_its_receivers_action_lengthens_it_one_waited_for_costs_nothing(
        tmp_path):
    from pipesim.errors import ClusterError

    prof = uniform_profile(4)  # F = 1 s, B = 2 s per sample and layer
    plan = Plan([1, 3], 2, 2, checkpoint="never", schedule="gpipe")
    two = [Device("a"), Device("b")]
    quiet = Cluster(two)
    landing = dataclasses.replace(quiet, landing_s=0.5)

    def spans(cluster: Cluster) -> dict[tuple[int, str, int], tuple[float, float]]:
        a = simulate(prof, plan, cluster).actions
        return {(r.stage, r.kind, r.microbatch): (r.start, r.end)
                for r in a[a.kind.isin(["F", "B"])].itertuples()}

    #   stage 0  |F0|F1|            ...waits...             |=B1=|  ...  |=B0=|
    #   stage 1     |=== F0 ===+|=== F1 ===|====== B1 ======|====== B0 ======|
    #                  ^ F1's input lands at 2 s: + 0.5 s; F0's and both gradients come
    #                    to a waiting worker (stage 1 blocked on F0, stage 0 on B1, B0)
    before, after = spans(quiet), spans(landing)
    assert before[(1, "F", 0)] == pytest.approx((1.0, 4.0))
    assert after[(1, "F", 0)] == pytest.approx((1.0, 4.5))
    for key in before:  # everything else the same length, the rest 0.5 s later
        if key != (1, "F", 0):
            assert after[key][1] - after[key][0] == pytest.approx(before[key][1] - before[key][0])
    assert max(e for _, e in after.values()) == pytest.approx(
        max(e for _, e in before.values()) + 0.5)
    # a message's bytes cost too: F1's input (1 sample of the profile's output bytes)
    nbytes = float(PlanCosts(prof, plan).cost(0, 1).output_bytes)
    per_byte = dataclasses.replace(quiet, landing_byte_s=0.25 / nbytes)
    assert spans(per_byte)[(1, "F", 0)] == pytest.approx((1.0, 4.25))
    # the cluster file keeps them; a negative cost is refused by name
    both = dataclasses.replace(landing, landing_byte_s=1e-9)
    again = Cluster.load(both.save(tmp_path / "c.json"))
    assert (again.landing_s, again.landing_byte_s) == (0.5, 1e-9)
    with pytest.raises(ClusterError, match="landing_s must be non-negative"):
        Cluster(two, landing_s=-1.0)
    with pytest.raises(ClusterError, match="landing_byte_s must be non-negative"):
        Cluster(two, landing_byte_s=-1e-9)


def test_messages_landing_in_the_time_a_landing_added_lengthen_the_action_again():
    prof = uniform_profile(4)
    #   stage 0  |F0|F1|F2|F3|F4|          one layer: 1 s a forward
    #   stage 1     .|=== F0 ===+++|+|     three layers, woken 0.1 s after F0's input
    #   F1, F2, F3's inputs land at 2, 3, 4 s in its compute (1.1 -> 4.1 s); F4's at 5 s,
    #   in the time those added
    plan = Plan([1, 3], 5, 5, checkpoint="never", schedule="gpipe")
    cluster = Cluster([Device("a"), Device("b")], wakeup_gap_s=0.1, landing_s=0.75)
    a = simulate(prof, plan, cluster).actions
    f0 = a[(a.stage == 1) & (a.kind == "F") & (a.microbatch == 0)].iloc[0]
    assert (f0.start, f0.end) == pytest.approx((1.1, 1.1 + 3.0 + 4 * 0.75))
