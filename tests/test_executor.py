"""The executor: gradients equal to the unpipelined model, faults, the facade's contract."""

from __future__ import annotations

import functools
import os
import statistics
import time

import pandas as pd
import pytest
import torch
from torch import nn

from executor.distributed import RankFailed, spawn, spawn_plans
from executor.gpipe import GPipe
from executor.models import builtin_job
from executor.partition import split_module
from executor.pipeline import Pipeline
from executor.stage import ActionFailed
from executor.transport import DistTransport
from pipesim import PlanError
from pipesim.plan import Plan
from pipesim.schedule import Schedule, build_schedule, zero_bubble_order
from pipesim.trace import metrics

MLP = dict(width=16, depth=3, in_features=8)  # 4 layers
GPT = dict(vocab=32, d_model=16, n_layers=2, n_heads=2, seq_len=6)  # 4 layers
BATCH = 10  # 4 chunks make micro-batches of 3, 3, 3, 1: uneven on purpose

PLANS = [("gpipe", [1, 3], 1), ("1f1b", [2, 2], 1), ("interleaved", [1, 1, 1, 1], 2),
         ("zb-h1", [2, 2], 1), ("zb-h2", [1, 3], 1), ("zbv", [1, 1, 1, 1], 2)]
MODES = ["always", "except_last", "never"]
#: where the in-process gradient tests run their stages: CPU here and in CI; a GPU machine
#: runs the same specification with ``PIPESIM_TEST_DEVICE=cuda:0`` (experiments/gpu_run.sh)
DEVICE = os.environ.get("PIPESIM_TEST_DEVICE", "cpu")


def reference(job, device: str = "cpu"):
    """Loss and gradients of the unpipelined model (float64) on ``device``."""
    module, loss_fn, x, y = job()
    module.to(device)
    loss = loss_fn(module(x.to(device)), y.to(device))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in module.named_parameters()}


def assert_same_grads(module: nn.Module, ref: dict, tol: float = 1e-12):
    for name, p in module.named_parameters():
        assert p.grad is not None, name
        assert torch.allclose(p.grad, ref[name], rtol=tol, atol=tol), name


@pytest.mark.parametrize("model,sizes", [("mlp", MLP), ("gpt", GPT)])
@pytest.mark.parametrize("schedule,balance,v", PLANS)
@pytest.mark.parametrize("mode", MODES)
def test_threads_gradients_equal_unpipelined(model, sizes, schedule, balance, v, mode):
    job = functools.partial(builtin_job, model, BATCH, dtype="float64", **sizes)
    ref_loss, ref_grads = reference(job, DEVICE)
    module, loss_fn, x, y = job()
    plan = Plan(balance, 4, BATCH, checkpoint=mode, schedule=schedule, virtual_stages=v)
    result = Pipeline(module, plan, devices=[DEVICE] * plan.n_devices,
                      loss_fn=loss_fn).run(x, y, iterations=1, warmup=0)
    assert result.loss == pytest.approx(ref_loss, rel=1e-12)
    assert_same_grads(module, ref_grads)
    m = metrics(result.trace)
    assert m.iteration_time_s > 0 and set(m.busy_s) == set(range(plan.n_devices))


@pytest.mark.slow
@pytest.mark.parametrize("tags, directional", [(True, True), (False, True), (True, False)],
                         ids=["tags", "send-order (NCCL path)", "one group both ways"])
def test_processes_gradients_equal_unpipelined(tags, directional):
    job = functools.partial(builtin_job, "mlp", BATCH, dtype="float64", **MLP)
    ref_loss, ref_grads = reference(job)
    plans = [Plan(b, 4, BATCH, checkpoint=mode, schedule=s, virtual_stages=v)
             for s, b, v in PLANS for mode in MODES if len(b) // v == 2]  # two ranks
    for plan, (result, ranks) in zip(plans, spawn_plans(job, plans, iterations=1, warmup=0,
                                                        return_grads=True, tags=tags,
                                                        directional=directional),
                                     strict=True):
        assert result.loss == pytest.approx(ref_loss, rel=1e-12), plan.label()
        grads = {k: torch.from_numpy(v) for r in ranks.values() for k, v in r.grads.items()}
        assert set(grads) == set(ref_grads), plan.label()
        for name, g in grads.items():
            assert torch.allclose(g, ref_grads[name], rtol=1e-12, atol=1e-12), (plan.label(), name)
        assert set(result.trace.actions.device) == {0, 1}


@pytest.mark.slow
def test_processes_gradients_equal_unpipelined_with_every_receive_posted_at_the_start():
    # from the second step on the gloo transport knows every message's shape, and a rank
    # posts all of its step's receives as the step starts (StageRunner.receives_at_start):
    # split backwards and virtual stages included, the gradients stay the unpipelined
    # model's (the grads returned are the last step's)
    job = functools.partial(builtin_job, "mlp", BATCH, dtype="float64", **MLP)
    ref_loss, ref_grads = reference(job)
    plans = [Plan(b, 4, BATCH, checkpoint="except_last", schedule=s, virtual_stages=v)
             for s, b, v in PLANS if len(b) // v == 2]
    for plan, (result, ranks) in zip(plans, spawn_plans(job, plans, iterations=2, warmup=1,
                                                        return_grads=True), strict=True):
        assert result.loss == pytest.approx(ref_loss, rel=1e-12), plan.label()
        grads = {k: torch.from_numpy(v) for r in ranks.values() for k, v in r.grads.items()}
        assert set(grads) == set(ref_grads), plan.label()
        for name, g in grads.items():
            assert torch.allclose(g, ref_grads[name], rtol=1e-12, atol=1e-12), (plan.label(), name)


def test_messages_up_and_down_take_a_group_each():
    # a rank's sends to a higher rank and its receives from a lower one share the "up"
    # group; the other direction the "down" group: two ranks sending to each other at
    # once then use two connections (executor.distributed.directional_groups)
    transport = DistTransport(1, (0, 1, 2), 4, torch.device("cpu"), groups=("up", "down"))
    assert [transport._group(1, 2), transport._group(0, 1)] == ["up", "up"]
    assert [transport._group(1, 0), transport._group(2, 1)] == ["down", "down"]
    assert DistTransport(0, (0, 1), 4, torch.device("cpu"))._group(0, 1) is None  # default


def test_each_plan_runs_its_own_number_of_iterations_and_reads_the_speed_beside_it():
    job = functools.partial(builtin_job, "mlp", BATCH, **MLP)
    plans = [Plan([2, 2], 2, BATCH), Plan([2, 2], 4, BATCH, schedule="1f1b")]
    runs = spawn_plans(job, plans, iterations=[1, 3], warmup=0, track_memory=False,
                       reference=True)
    assert [r.trace.actions.iteration.nunique() for r, _ in runs] == [1, 3]
    assert [r.trace.meta["iterations"] for r, _ in runs] == [1, 3]
    # the machine's speed read before each plan on every rank, the ranks' mean kept
    for r, ranks in runs:
        readings = [rank.reference_s for rank in ranks.values()]
        assert min(readings) > 0
        assert r.trace.meta["reference_s"] == pytest.approx(sum(readings) / len(readings))


def test_the_speed_reference_changes_nothing_in_the_model():
    from executor.timing import speed_reference

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)).train()
    stats, x = model[1].running_mean.clone(), torch.randn(4, 8)
    rng = torch.get_rng_state()
    assert speed_reference(model, x) > 0
    assert model.training and all(m.training for m in model)
    assert torch.equal(model[1].running_mean, stats)  # no running statistics updated
    assert torch.equal(torch.get_rng_state(), rng)  # no dropout mask drawn
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("iterations", [[1], [1, 0], 0], ids=["one for two plans", "zero", "0"])
def test_iterations_must_be_a_count_or_one_per_plan(iterations):
    plans = [Plan([2, 2], 2, BATCH), Plan([2, 2], 4, BATCH)]
    with pytest.raises(ValueError, match="iterations"):
        spawn_plans(functools.partial(builtin_job, "mlp", BATCH, **MLP), plans,
                    iterations=iterations)


@pytest.mark.parametrize("split", [False, True], ids=["full backward", "split backward"])
def test_recomputation_sees_the_first_forwards_dropout_masks(split):
    def run(mode):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 32),
                               nn.Dropout(0.5), nn.Linear(32, 4)).double()
        x = torch.randn(8, 8, dtype=torch.float64)
        y = torch.randint(0, 4, (8,))
        torch.manual_seed(1)
        # one worker runs both stages: the random draws happen in schedule order
        plan = Plan([2, 3], 4, 8, checkpoint=mode, placement=(0, 0))
        schedule = (Schedule.from_order(zero_bubble_order(2, 4, (0, 0), [4])) if split
                    else None)
        loss = Pipeline(module, plan, schedule=schedule).run(x, y, iterations=1, warmup=0).loss
        return loss, [p.grad.clone() for p in module.parameters()]

    loss_a, grads_a = run("always")
    loss_n, grads_n = run("never")
    assert loss_a == loss_n
    for a, n in zip(grads_a, grads_n, strict=True):
        assert torch.equal(a, n)


def test_failure_in_a_thread_names_worker_stage_and_action():
    module, loss_fn, x, y = builtin_job("mlp", 8, **MLP)
    pipe = Pipeline(module, Plan([2, 2], 4, 8), loss_fn=loss_fn, timeout_s=30)
    t0 = time.monotonic()
    with pytest.raises(ActionFailed, match="worker 1 failed at stage 1 action 1F2: RuntimeError: "
                                           "injected failure"):
        pipe.step(x, y, fail_at=(1, "1F2"))
    assert time.monotonic() - t0 < 30  # stops, does not hang (not a speed target)


@pytest.mark.slow
def test_failure_in_a_rank_stops_every_rank():
    job = functools.partial(builtin_job, "mlp", 8, **MLP)
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1: ActionFailed: worker 1 failed at stage 1 action "
                                         "1B1: RuntimeError: injected failure"):
        spawn(job, Plan([2, 2], 4, 8, schedule="1f1b"), iterations=1, warmup=0,
              fail_at={1: "1B1"}, timeout_s=20)
    assert time.monotonic() - t0 < 60


def test_mismatched_schedule_or_batch_is_refused_before_running():
    module, _loss_fn, x, y = builtin_job("mlp", 8, **MLP)
    other = build_schedule(Plan([1, 1, 2], 4, 8))
    with pytest.raises(PlanError, match="schedule has 3 stages but the plan has 2"):
        Pipeline(module, Plan([2, 2], 4, 8), schedule=other).step(x, y)
    with pytest.raises(PlanError, match="batch has 8 samples but the plan's batch size is 16"):
        Pipeline(module, Plan([2, 2], 4, 16)).step(x, y)
    with pytest.raises(PlanError, match="chunks 16 is larger than the batch size 8"):
        Plan([2, 2], 16, 8)


# ---------------------------------------------------------------- the facade
def seq():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    (dict(balance=None), ValueError, "balance is required"),
    (dict(balance=[1, 1]), ValueError, r"module: 3, sum of balance: 2"),
    (dict(balance=[2, 0, 1]), ValueError, "must be positive"),
    (dict(balance=[1, 2], chunks=0), ValueError, "chunks must be positive"),
    (dict(balance=[1, 2], checkpoint="sometimes"), ValueError, "checkpoint is not one of"),
    (dict(balance=[1, 2], devices=["cpu"]), IndexError, r"devices: 1, partitions: 2"),
])
def test_facade_error_contract(kwargs, error, message):
    with pytest.raises(error, match=message):
        GPipe(seq(), **kwargs)


def test_facade_rejects_non_sequential():
    with pytest.raises(TypeError, match=r"nn\.Sequential"):
        GPipe(nn.Linear(2, 2), balance=[1])


def test_facade_trains_and_infers_like_the_model():
    module, loss_fn, x, y = builtin_job("mlp", BATCH, dtype="float64", **MLP)
    ref_loss, ref_grads = reference(functools.partial(builtin_job, "mlp", BATCH, dtype="float64",
                                                      **MLP))
    g = GPipe(module, balance=[2, 2], devices=["cpu", "cpu"], chunks=4, loss_fn=loss_fn)
    assert g.train_step(x, y) == pytest.approx(ref_loss, rel=1e-12)
    assert_same_grads(module, ref_grads)
    with torch.no_grad():
        assert torch.allclose(g(x), module(x))


@pytest.mark.slow
def test_measured_traces_hold_transfers_between_the_right_ranks():
    job = functools.partial(builtin_job, "mlp", 8, **MLP)
    result, _ = spawn(job, Plan([2, 2], 4, 8, schedule="1f1b"), iterations=1, warmup=0)
    a = result.trace.actions
    sends = a[a.kind.str.startswith("SEND")]
    assert sorted(sends.groupby(["kind", "resource"]).size().items()) == [
        (("SEND_B", "dev1->dev0"), 4), (("SEND_F", "dev0->dev1"), 4)]
    assert (sends.end >= sends.start).all()
    assert (sends.nbytes == 2 * 16 * 4).all()  # 2 samples x 16 float32 features


@pytest.mark.slow
@pytest.mark.parametrize("name,sizes,balance,schedule", [
    ("mlp", MLP, [2, 2], "1f1b"), ("unet", dict(depth=2, width=4, image_size=8), [3, 4, 6], "gpipe")])
def test_a_stage_alone_holds_what_it_holds_in_the_pipeline(name, sizes, balance, schedule):
    # one process per stage: each rank holds what it receives, as a stage alone does
    from executor.stage_alone import run_stage_alone

    job = functools.partial(builtin_job, name, 8, **sizes)
    module, loss_fn, x, y = job()
    plan = Plan(balance, 4, 8, checkpoint="except_last", schedule=schedule)
    piped, _ = spawn(job, plan, iterations=1, warmup=0)
    alone = [run_stage_alone(module, plan, s, x, y, loss_fn=loss_fn)["tracked"]
             for s in range(plan.n_stages)]
    piped_peaks = [piped.trace.meta["peak_memory"][f"rank{s}"] for s in range(plan.n_stages)]
    # the real transport holds a little more (shape headers, sent tensors kept to the end);
    # both post (make) the next action's receive buffer ahead
    for a, p in zip(alone, piped_peaks, strict=True):
        assert a <= p <= 1.15 * a


def test_memory_tracker_sees_every_tensor_of_a_step():
    from executor.memtrack import Timeline, Tracker

    layer = nn.Linear(64, 64)
    x = torch.randn(16, 64)
    timeline = Timeline()
    timeline.add_existing("d", layer.parameters())
    params = (64 * 64 + 64) * 4
    with Tracker(timeline, "d"):
        y = layer(x)  # the output; the weight's transposed view is no new memory
        assert timeline.level["d"] == params + 16 * 64 * 4
        y.sum().backward()  # gradients appear, and transients come and go
        del y
    assert timeline.level["d"] == 2 * params  # parameters and their gradients remain
    assert timeline.peak["d"] > 2 * params  # the backward's temporaries were seen
    levels = [b for _, _, b in timeline.rows]
    assert levels[-1] == timeline.level["d"] and max(levels) == timeline.peak["d"]


def test_a_stage_alone_lists_every_storage_with_the_operator_that_made_it():
    # what validate_memory.py --lives prints: the listing adds up to the peak measured
    from executor.stage_alone import run_stage_alone

    module, loss_fn, x, y = builtin_job("mlp", 8, **MLP)
    plan = Plan([2, 2], 2, 8, checkpoint="always")
    kept: list = []
    peak = run_stage_alone(module, plan, 0, x, y, loss_fn=loss_fn, iterations=1,
                           keep=kept)["tracked"]
    storages = kept[0]
    events = sorted([(born, n) for _, n, born, _, _ in storages]
                    + [(freed, -n) for _, n, _, freed, _ in storages if freed is not None])
    level = high = 0
    for _, n in events:
        level += n
        high = max(high, level)
    assert high == peak
    made = [label for _, _, _, _, label in storages if label]
    assert any(label.startswith("aten.addmm") for label in made)  # the Linear layers
    assert all(label.startswith("aten.") for label in made)


# ------------------------------------------------ long-lived workers, host columns
def test_workers_are_the_same_threads_across_steps_and_close_cleanly():
    module, loss_fn, x, y = builtin_job("mlp", 8, **MLP)
    with Pipeline(module, Plan([2, 2], 4, 8), loss_fn=loss_fn) as pipe:
        assert pipe.worker_threads == []  # nothing started before the first step
        pipe.step(x, y)
        first = pipe.worker_threads
        pipe.step(x, y)
        assert pipe.worker_threads == first and len(first) == 2
        assert all(t.is_alive() for t in first)
    for t in first:
        t.join(5)
    assert not any(t.is_alive() for t in first)


def test_a_dropped_pipeline_leaves_no_thread_behind():
    import gc
    import weakref

    module, loss_fn, x, y = builtin_job("mlp", 8, **MLP)
    pipe = Pipeline(module, Plan([2, 2], 4, 8), loss_fn=loss_fn)
    pipe.run(x, y, iterations=1, warmup=0)
    threads, alive = pipe.worker_threads, weakref.ref(pipe)
    del pipe
    gc.collect()
    assert alive() is None  # the threads do not keep their pipeline alive
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)


def test_a_failing_worker_ends_the_step_and_the_next_step_works():
    module, loss_fn, x, y = builtin_job("mlp", 8, **MLP)
    pipe = Pipeline(module, Plan([2, 2], 4, 8), loss_fn=loss_fn, timeout_s=20)
    t0 = time.monotonic()
    with pytest.raises(ActionFailed, match="action 0B1"):
        pipe.step(x, y, fail_at=(0, "0B1"))
    assert time.monotonic() - t0 < 20  # bounded (not a speed target)
    module.zero_grad(set_to_none=True)
    _rows, loss, _ = pipe.step(x, y)  # the same workers serve the next step
    assert loss > 0 and len(pipe.worker_threads) == 2
    pipe.close()


def test_measured_trace_has_host_columns_and_a_valid_chrome_trace(tmp_path):
    import json

    from pipesim.plot import chrome_trace
    from pipesim.trace import MEASURED_COLUMNS

    module, loss_fn, x, y = builtin_job("mlp", 8, **MLP)
    trace = Pipeline(module, Plan([2, 2], 4, 8), loss_fn=loss_fn).run(
        x, y, iterations=2, warmup=0).trace
    assert list(trace.actions.columns) == MEASURED_COLUMNS
    assert trace.actions[["host_start", "host_end"]].isna().all().all()  # CPU: they coincide
    events = json.loads(chrome_trace(trace, tmp_path / "t.json").read_text())["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e.get("name") == "thread_name"}
    assert names == {(0, "stream"), (1, "stream")}  # one track per worker
    assert all(isinstance(e["pid"], int) for e in events)
    assert {e["name"] for e in events if e.get("cat") == "F"} >= {"0F0", "1F3"}


def test_actions_are_labelled_for_the_torch_profiler():
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    module, loss_fn, x, y = builtin_job("mlp", 8, **MLP)
    pipe = Pipeline(module, Plan([2, 2], 2, 8), loss_fn=loss_fn)
    # the CPU profiler sees other threads only when asked to (torch >= 2.5)
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        pytest.skip("this torch's profiler cannot record other threads")
    with torch_profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        pipe.step(x, y)
    labels = {e.name for e in prof.events() if e.name.startswith("PP:")}
    # the first micro-batch is checkpointed (except_last): its recomputation is labelled too
    assert labels == {"PP:0F0", "PP:0F1", "PP:1F0", "PP:1F1", "PP:0B0", "PP:0B1", "PP:1B0", "PP:1B1",
                      "PP:0R0", "PP:1R0"}
    pipe.close()


@pytest.mark.parametrize(("schedule", "balance", "v"), [("gpipe", [1, 1, 2], 1),
                                                       ("1f1b", [2, 2], 1),
                                                       ("interleaved", [1, 1, 1, 1], 2)])
def test_send_order_is_the_order_the_runners_send_in(schedule, balance, v, monkeypatch):
    import threading

    from executor.distributed import send_order
    from executor.transport import ThreadTransport

    module, loss_fn, x, y = builtin_job("mlp", 8, **MLP)
    plan = Plan(balance, 4, 8, schedule=schedule, virtual_stages=v)
    sent: list[tuple[int, int, tuple]] = []
    original = ThreadTransport.send

    def spy(self, tensor, dst_stage, kind, mb, src_stage=None):
        worker = int(threading.current_thread().name.rsplit("-", 1)[1])
        sent.append((worker, self.placement[dst_stage], (dst_stage, kind, mb)))
        return original(self, tensor, dst_stage, kind, mb, src_stage)

    monkeypatch.setattr(ThreadTransport, "send", spy)
    pipe = Pipeline(module, plan, loss_fn=loss_fn)
    pipe.step(x, y)
    pipe.close()
    schedule_ = pipe.schedule
    for rank in range(schedule_.n_devices):
        for peer, order in send_order(schedule_, (), rank).items():
            assert order == [k for w, d, k in sent if w == peer and d == rank], (peer, rank)


def test_gpipe_facade_options_of_torchgpipe():
    from executor import GPipe as Exported
    from executor.batchnorm import DeferredBatchNorm

    assert Exported is GPipe
    seq = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    g = GPipe(seq, balance=[2, 1], devices=["cpu", "cpu"], chunks=2, deferred_batch_norm=True)
    assert any(isinstance(m, DeferredBatchNorm) for m in g.modules())
    with pytest.raises(ValueError, match="schedule must be one of"):
        GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), balance=[1, 1], schedule="zb")

    class Pair(nn.Module):
        def forward(self, x):
            return x, x

    tupled = GPipe(nn.Sequential(Pair(), nn.Linear(4, 2)), balance=[1, 1], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="one tensor between layers"):
        tupled(torch.randn(4, 4))
    with pytest.raises(TypeError, match="one tensor between layers"):
        tupled.train_step(torch.randn(4, 4), torch.zeros(4, dtype=torch.long))
    tupled.close()


def test_measured_traces_show_recomputation_inside_its_backward():
    module, loss_fn, x, y = builtin_job("mlp", 8, **MLP)
    trace = Pipeline(module, Plan([2, 2], 4, 8, checkpoint="except_last"), loss_fn=loss_fn).run(
        x, y, iterations=1, warmup=0).trace
    a = trace.actions.set_index(["stage", "microbatch", "kind"])
    recomputed = sorted({(s, m) for s, m, k in a.index if k == "R"})
    assert recomputed == [(s, m) for s in (0, 1) for m in range(3)]  # not the last micro-batch
    for s, m in recomputed:
        r, b = a.loc[(s, m, "R")], a.loc[(s, m, "B")]
        assert b["start"] <= r["start"] <= r["end"] <= b["end"]


def test_a_memory_snapshot_is_the_cuda_allocators_and_refused_on_cpu(tmp_path):
    module, loss_fn, x, y = builtin_job("mlp", 8, **MLP)
    with pytest.raises(ValueError, match="CUDA allocator"):
        Pipeline(module, Plan([2, 2], 2, 8), loss_fn=loss_fn).run(
            x, y, iterations=1, warmup=0, memory_snapshot=tmp_path / "snap.pickle")


def test_device_speedup_is_measured_within_its_bounds():
    from executor.profiler import measure_device_speedup

    module, loss_fn, x, y = builtin_job("mlp", 8, **MLP)
    speedup = measure_device_speedup(module, loss_fn, x, y, device="cpu", streams=2, iterations=5)
    assert speedup[0] == 1.0 and 1.0 <= speedup[1] <= 2.0


@pytest.mark.parametrize(("name", "v"), [("Interleaved1F1B", 2), ("LoopedBFS", 2), ("GPipe", 1),
                                         ("1F1B", 1), ("InterleavedZeroBubble", 2),
                                         ("ZBVZeroBubble", 2), ("DualPipeV", 2)])
@pytest.mark.parametrize("mode", MODES)
def test_torch_schedules_run_with_gradients_equal_unpipelined(name, v, mode):
    from executor.torch_schedules import from_torch
    from pipesim.simulator import simulate
    from pipesim.trace import metrics

    job = functools.partial(builtin_job, "mlp", 8, dtype="float64", **MLP)
    _, ref_grads = reference(job)
    schedule = from_torch(name, n_ranks=2, n_microbatches=4, stages_per_rank=v, batch_size=8)
    assert schedule.splits_backward == (name in ("InterleavedZeroBubble", "ZBVZeroBubble",
                                                 "DualPipeV"))
    plan = Plan([1] * 4 if v == 2 else [2, 2], 4, 8, checkpoint=mode,
                placement=schedule.placement)
    module, loss_fn, x, y = job()
    Pipeline(module, plan, loss_fn=loss_fn, schedule=schedule).run(x, y, iterations=1, warmup=0)
    assert_same_grads(module, ref_grads)
    from tests.helpers import uniform_profile

    prof = uniform_profile(4, sizes=(1, 8))
    assert metrics(simulate(prof, plan, schedule=schedule)).iteration_time_s > 0


def test_torch_schedules_refuse_what_torch_refuses():
    from executor.torch_schedules import from_torch
    from pipesim.errors import ScheduleError

    with pytest.raises(ScheduleError, match=r"torch's ZBVZeroBubble refuses 2 ranks x 3 stages"):
        from_torch("ZBVZeroBubble", n_ranks=2, n_microbatches=4, stages_per_rank=3)
    with pytest.raises(ScheduleError, match="torch has no schedule 'Nope'"):
        from_torch("Nope", n_ranks=2, n_microbatches=4)


def _torch_runtime_rank(rank: int, port: int, schedule_name: str, out) -> None:
    """One rank of torch's runtime running a pipesim schedule read from torch's CSV."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from executor.torch_schedules import to_torch_runtime

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=timedelta(seconds=60))
        v = 2 if schedule_name == "zbv" else 1
        plan = Plan([4 // (2 * v)] * (2 * v), 4, 8, checkpoint="never", schedule=schedule_name,
                    virtual_stages=v)
        schedule = build_schedule(plan)
        module, loss_fn, x, y = builtin_job("mlp", 8, dtype="float64", **MLP)
        parts = split_module(module, plan.balance)
        mine = [s for s in range(plan.n_stages) if schedule.placement[s] == rank]
        stages = [PipelineStage(parts[s], s, plan.n_stages, torch.device("cpu")) for s in mine]
        runtime = to_torch_runtime(schedule, stages, loss_fn)
        last = plan.n_stages - 1
        kwargs = {"target": y, "losses": []} if last in mine else {}
        if 0 in mine:
            runtime.step(x, **kwargs)
        else:
            runtime.step(**kwargs)
        # numpy arrays travel by value; tensors would travel as file descriptors, gone with
        # this process
        out.put((rank, {n: p.grad.numpy().copy() for s in mine
                        for n, p in _named(module, parts[s])}))
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the test, not lost in the child
        out.put((rank, f"{type(exc).__name__}: {exc}"))


def _named(module: nn.Module, part: nn.Module):
    """``part``'s parameters under their names in ``module``."""
    ids = {id(p) for p in part.parameters()}
    return [(n, p) for n, p in module.named_parameters() if id(p) in ids]


@pytest.mark.slow
@pytest.mark.parametrize("schedule_name", ["zb-h1", "zbv"])
def test_torchs_runtime_runs_pipesims_schedule_from_csv(schedule_name):
    """The reverse direction: a pipesim Schedule in torch's CSV, run by torch's own
    ``_PipelineScheduleRuntime``, gives the unpipelined model's gradients."""
    import torch.multiprocessing as mp

    from executor.distributed import _free_port

    job = functools.partial(builtin_job, "mlp", 8, dtype="float64", **MLP)
    _, ref_grads = reference(job)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_torch_runtime_rank, args=(r, port, schedule_name, out))
             for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    grads = {}
    for rank, value in got.items():
        assert isinstance(value, dict), f"rank {rank}: {value}"
        grads.update(value)
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        assert torch.allclose(torch.from_numpy(g), ref_grads[name], rtol=1e-10, atol=1e-12), name


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_measured_memory_is_sorted_into_categories(schedule):
    """The tracked iteration says what each byte held: parameters, weight gradients,
    activations (outliving the action that made them) and temporaries (born and gone
    inside one action); the categories add up to the measured total."""
    module, loss_fn, x, y = builtin_job("gpt", 8, **GPT)
    plan = Plan([2, 2], 4, 8, checkpoint="except_last", schedule=schedule)
    trace = Pipeline(module, plan, loss_fn=loss_fn).run(x, y, iterations=1, warmup=0).trace
    split = trace.memory_by_category
    assert split is not None and set(split.category) == {"parameters", "gradients",
                                                          "activations", "temporaries"}
    last = split.groupby(["device", "category"]).bytes.last()
    stages = split_module(module, plan.balance)
    for w in range(2):
        params = sum(t.untyped_storage().nbytes() for t in [*stages[w].parameters(),
                                                           *stages[w].buffers()])
        assert last[(f"dev{w}", "parameters")] == params
        assert last[(f"dev{w}", "gradients")] == sum(p.grad.untyped_storage().nbytes()
                                                     for p in stages[w].parameters())
        assert last[(f"dev{w}", "activations")] == 0 and last[(f"dev{w}", "temporaries")] == 0
        total = trace.memory[trace.memory.device == f"dev{w}"].bytes
        assert last[f"dev{w}"].sum() == total.iloc[-1]
        peak_parts = split[split.device == f"dev{w}"].groupby("category").bytes.max()
        assert peak_parts["temporaries"] > 0 and peak_parts["activations"] > 0
        assert peak_parts.sum() >= total.max()  # the parts' peaks bound the total's
    # the tracked step's own actions, in the timeline's clock: its shape is read against them
    for w in range(2):
        ran = trace.meta["memory_actions"][f"dev{w}"]
        assert len(ran) == len(build_schedule(plan).order[w])
        assert {mb for _, mb, kind, _, _ in ran if kind == "F"} == set(range(4))
        times = trace.memory[trace.memory.device == f"dev{w}"].time
        assert all(0.0 <= start < end <= times.max() + 1e-3 for *_, start, end in ran)


def test_calibration_tells_gaps_of_a_woken_worker_from_gaps_between_ready_actions():
    from executor.calibrate import unexplained_gaps

    # 2 stages, one micro-batch: F(0) [0, 1]; F(1) waits for it and starts 0.5 s after it
    # arrives; B(1) starts 0.2 s after F(1) (its own input); B(0) waits for B(1)'s gradient
    actions = pd.DataFrame(
        [(0, 0, 0, 0, "F", 0.0, 1.0), (0, 1, 1, 0, "F", 1.5, 2.5),
         (0, 1, 1, 0, "B", 2.7, 4.0), (0, 0, 0, 0, "B", 4.6, 6.0)],
        columns=["iteration", "device", "stage", "microbatch", "kind", "start", "end"])
    gaps = sorted(unexplained_gaps(actions))
    assert [blocked for _, blocked in gaps] == [False, True, True]
    assert [g for g, _ in gaps] == pytest.approx([0.2, 0.5, 0.6])
    # a latency is the message's own time, not the worker's
    assert [g for g, _ in sorted(unexplained_gaps(actions, latency_s=0.1))] == pytest.approx(
        [0.2, 0.4, 0.5])


def test_thread_overhead_is_the_median_of_its_readings():
    from executor.calibrate import measure_thread_overhead

    over = measure_thread_overhead("cpu", 2, iterations=2, readings=3)
    assert len(over["in_action_readings"]) == 3
    assert over["in_action_s"] == statistics.median(over["in_action_readings"])
    assert over["between_actions_s"] >= 0.0 and over["wakeup_s"] >= 0.0
    with pytest.raises(ValueError, match="readings must be at least 1, got 0"):
        measure_thread_overhead("cpu", 2, readings=0)


def test_in_place_contention_gives_each_stage_a_slowdown_per_micro_batch_size():
    from executor.in_place import stage_contention, stage_contention_readings

    job = functools.partial(builtin_job, "mlp", 8, width=32, depth=3, in_features=32)
    readings = stage_contention_readings(job, [1, 3], [2, 8], repeats=2, rounds=2,
                                         phase_s=0.005, pin_cores=False)
    assert len(readings) == 2  # each repeat its own reading, with its own ranks
    for spans in readings:
        assert [(s.first, s.stop, s.micro_batch) for s in spans] == [
            (0, 1, 2), (0, 1, 8), (1, 4, 2), (1, 4, 8)]  # every stage's layers, every size
        assert all(s.slowdown >= 1.0 for s in spans)
    # three ranks, one stage twice as long: its together phase waits for its step (every
    # rank counts one at least), and nothing waits forever for a rank that has left
    spans = stage_contention(job, [1, 1, 2], [2], repeats=1, rounds=2, phase_s=0.002,
                             pin_cores=False)
    assert [(s.first, s.stop) for s in spans] == [(0, 1), (1, 2), (2, 4)]
    assert all(s.slowdown >= 1.0 for s in spans)
    with pytest.raises(ValueError, match="at least 2 stages"):
        stage_contention(job, [4], [2])
    with pytest.raises(ValueError, match=r"balance \[2, 3\] sums to 5 layers, the model has 4"):
        stage_contention(job, [2, 3], [2])
    with pytest.raises(ValueError, match="micro-batch size 16 exceeds the job's batch of 8"):
        stage_contention(job, [2, 2], [16])
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        stage_contention(job, [2, 2], [2], repeats=0)


@pytest.mark.filterwarnings("ignore:profile.*noisy")  # (one repeat: its noise is no matter)
def test_stage_costs_time_each_stages_actions_in_place_per_size_and_checkpoint_mode():
    from executor.in_place import stage_costs
    from executor.profiler import profile
    from pipesim.cluster import Cluster
    from pipesim.readings import in_place_costs_of
    from pipesim.simulator import simulate

    job = functools.partial(builtin_job, "mlp", 8, width=32, depth=3, in_features=32)
    rows = stage_costs(job, [1, 3], [2, 8], rounds=2, phase_s=0.005, pin_cores=False)
    assert sorted((r["first"], r["stop"], r["micro_batch"], r["checkpointed"]) for r in rows) == [
        (0, 1, 2, False), (0, 1, 2, True), (0, 1, 8, False), (0, 1, 8, True),
        (1, 4, 2, False), (1, 4, 2, True), (1, 4, 8, False), (1, 4, 8, True)]
    assert all(r["fwd_s"] > 0 and r["bwd_s"] > 0 for r in rows)
    # and the executor's own seconds around each action: some, far less than the step's
    assert all(0.0 < r["between_s"] < r["fwd_s"] + r["bwd_s"] + 0.01 for r in rows)
    # a plan's actions cost those seconds: its stage, its micro-batch's size, its mode
    module, loss_fn, x, y = job()
    prof = profile(module, (x, y), [2, 4, 8], loss_fn=loss_fn, repeats=1, warmup=0,
                   progress=False)
    plan = Plan([1, 3], 4, 8, checkpoint="except_last")  # 4 micro-batches of 2 samples
    placed = Cluster.free(2)
    placed.in_place_costs = in_place_costs_of(rows)
    acts = simulate(prof, plan, placed, track_memory=False).actions
    took = {(r.stage, r.kind, r.microbatch): r.end - r.start for r in acts.itertuples()}
    cost = {(r["first"], r["checkpointed"]): (r["fwd_s"], r["bwd_s"]) for r in rows
            if r["micro_batch"] == 2}
    assert took[(1, "F", 0)] == pytest.approx(cost[(1, True)][0])
    assert took[(1, "B", 3)] == pytest.approx(cost[(1, False)][1])  # the last one: plain
    assert took[(0, "F", 2)] == pytest.approx(cost[(0, True)][0])
    # a size between two measured ones reads between them (log2 of the size); a balance
    # whose stages were not measured keeps the profile's seconds
    four = simulate(prof, Plan([1, 3], 2, 8, checkpoint="never"), placed,
                    track_memory=False).actions.query("stage == 1 and kind == 'F'")
    plain = {r["micro_batch"]: r["fwd_s"] for r in rows
             if r["first"] == 1 and not r["checkpointed"]}
    assert (four.end - four.start).tolist() == pytest.approx([(plain[2] + plain[8]) / 2] * 2)

    def seconds(cluster: Cluster) -> list[float]:
        a = simulate(prof, Plan([2, 2], 2, 8, checkpoint="never"), cluster,
                     track_memory=False).actions
        return (a.end - a.start).tolist()

    assert seconds(placed) == pytest.approx(seconds(Cluster.free(2)))
    with pytest.raises(ValueError, match="checkpoint modes must be 'never' or 'always'"):
        stage_costs(job, [2, 2], [2], modes=("sometimes",))
    with pytest.raises(ValueError, match="at least 2 stages"):
        stage_costs(job, [4], [2])


def test_checkpoint_extras_are_each_stages_checkpointed_backward_less_its_plain_one():
    from executor.in_place import checkpoint_extras

    job = functools.partial(builtin_job, "mlp", 8, width=32, depth=3, in_features=32)
    extras = checkpoint_extras(job, [1, 3], [2, 8], rounds=2, pin_cores=False)
    assert sorted((x.first, x.stop, x.micro_batch) for x in extras) == [
        (0, 1, 2), (0, 1, 8), (1, 4, 2), (1, 4, 8)]
    # a backward that recomputes its forward first: dearer than the plain one, by less
    # than the whole step (a forward is cheaper than a backward here)
    assert all(0.0 < x.seconds < 0.1 for x in extras)


def test_device_stage_costs_time_each_stage_alone_in_this_process_plain_and_checkpointed():
    from executor.in_place import device_stage_costs
    from pipesim.readings import in_place_costs_of

    job = functools.partial(builtin_job, "mlp", 8, width=32, depth=3, in_features=32)
    threads = torch.get_num_threads()
    rows = device_stage_costs(job, [1, 3], [2, 8], device="cpu", rounds=2, phase_s=0.005)
    assert torch.get_num_threads() == threads  # the caller's setting kept
    assert sorted((r["first"], r["stop"], r["micro_batch"], r["checkpointed"]) for r in rows) \
        == [(f, s, b, c) for f, s in ((0, 1), (1, 4)) for b in (2, 8) for c in (False, True)]
    assert all(0.0 < r["fwd_s"] < 0.1 and 0.0 < r["bwd_s"] < 0.1 for r in rows)
    # a checkpointed backward recomputes its forward first: dearer than the plain one
    by = {(r["first"], r["micro_batch"], r["checkpointed"]): r["bwd_s"] for r in rows}
    assert all(by[(f, b, True)] > by[(f, b, False)] for f in (0, 1) for b in (2, 8))
    costs = in_place_costs_of(rows)
    assert [(c.first, c.stop, c.fwd_s, c.bwd_s) for c in costs] == \
        [(r["first"], r["stop"], r["fwd_s"], r["bwd_s"]) for r in rows]
    with pytest.raises(ValueError, match="checkpoint modes must be 'never' or 'always'"):
        device_stage_costs(job, [2, 2], [2], device="cpu", modes=("sometimes",))


def test_executor_gaps_are_the_executors_seconds_around_each_action_in_place():
    from executor.calibrate import calibration_executor_gap
    from executor.in_place import executor_gaps_of

    rows = [{"first": 0, "stop": 1, "micro_batch": 2, "checkpointed": False, "fwd_s": 1e-3,
             "bwd_s": 2e-3, "between_s": 5e-5},
            {"first": 1, "stop": 4, "micro_batch": 2, "checkpointed": True, "fwd_s": 1e-3,
             "bwd_s": 2e-3, "between_s": -1e-6}]
    gaps = executor_gaps_of(rows)
    assert [(g.first, g.stop, g.micro_batch, g.checkpointed) for g in gaps] == [
        (0, 1, 2, False), (1, 4, 2, True)]
    assert [g.seconds for g in gaps] == [5e-5, 0.0]  # a reading below 0 is noise
    # the calibration pipeline's own, measured the same way: tens of microseconds here,
    # well under a millisecond anywhere
    base = calibration_executor_gap(width=64, micro_batch=2)
    assert 0.0 < base < 1e-3


def test_measure_wakeups_gives_the_wake_ups_growth_with_the_wait_before_it():
    from executor.calibrate import measure_wakeups

    curve = measure_wakeups(idles=(0.004, 0.001), repeats=3)
    # from (0, 0), then each idle measured, in order, against the shortest one's wake-up
    assert [p[0] for p in curve] == [0.0, 0.001, 0.004]
    assert curve[1][1] == 0.0 and 0.0 <= curve[2][1] < 0.05
    with pytest.raises(ValueError, match="idles must be positive seconds"):
        measure_wakeups(idles=(0.0, 0.001))


def test_measure_landing_times_a_step_with_a_message_landing_in_it_against_between_steps():
    from executor.calibrate import measure_landing

    m = measure_landing(sizes=(1 << 15, 1 << 12), rounds=2, steps=3)
    # per size, in order: the median over rounds of landing less between (seconds; either
    # sign on a noisy machine), and the line through them, never below 0
    assert list(m["by_size"]) == [1 << 12, 1 << 15]
    assert all(abs(v) < 0.05 for v in m["by_size"].values())
    assert m["landing_s"] >= 0.0 and m["landing_byte_s"] >= 0.0
    assert 0.0 < m["step_s"] < 0.1
    with pytest.raises(ValueError, match="sizes must be at least 4 bytes"):
        measure_landing(sizes=(2,))


def test_the_wait_and_send_micro_benchmarks_time_every_condition_on_two_ranks():
    from executor.calibrate import _gather
    from executor.distributed import _free_port
    from experiments import blocked_wait, send_after

    # an action after a sleep and after a receive blocked as long, against at once
    (rows,) = _gather(blocked_wait._trials, 2, (_free_port(), 32, 2, (2,), (0.002,), 2),
                      expected=1)
    table = pd.DataFrame(rows, columns=["kind", "size", "condition", "idle_s", "waited_s",
                                        "action_s"])
    assert sorted(set(zip(table.kind, table.condition, strict=True))) == [
        (k, c) for k in ("B", "F") for c in ("hot", "recv", "sleep")]
    assert len(table) == 2 * 2 * 3 and (table.action_s > 0).all()
    waited = table.groupby("condition").waited_s.min()
    # the waits really happened: a sleep and a blocked receive last their idle at least
    assert waited["sleep"] >= 0.002 and waited["recv"] >= 0.002 and waited["hot"] < 0.002
    # the sender's second backward after no send, a posted receive, a later one
    (rows,) = _gather(send_after._trials, 2, (_free_port(), 32, 2, 2, (4096,), False, 2),
                      expected=1)
    table = pd.DataFrame(rows, columns=["bytes", "condition", "gap_s", "backward_s"])
    assert sorted(set(zip(table["bytes"], table.condition, strict=True))) == [
        (0, "none"), (4096, "later"), (4096, "posted")]
    assert len(table) == 3 * 2 and (table.backward_s > 0).all() and (table.gap_s >= 0).all()


def test_gc_in_pipeline_places_each_collection_on_the_traces_timeline():
    from experiments.gc_in_pipeline import place_collections, run

    # two iterations laid end to end: the second starts where the first's last row ended
    actions = pd.DataFrame(
        [(0, 1, "F", 0.001, 0.004), (0, 1, "B", 0.006, 0.009), (0, 0, "F", 0.000, 0.010),
         (1, 1, "F", 0.011, 0.014), (1, 1, "B", 0.016, 0.019), (1, 0, "F", 0.010, 0.020)],
        columns=["iteration", "device", "kind", "start", "end"])
    origins = [100.0, 200.0]  # rank 1's perf_counter at each iteration's origin
    events = [(0, 100.002, 100.0025),  # inside iteration 0's forward
              (1, 100.0045, 100.005),  # between its forward and backward
              (0, 200.007, 200.008),  # inside iteration 1's backward (offset 0.010)
              (2, 200.050, 200.060),  # past iteration 1's last row
              (0, 50.0, 50.001)]  # before the first measured origin (warm-up)
    placed = place_collections(actions, 1, origins, events)
    assert list(placed.place) == ["in_F", "between", "in_B", "outside", "outside"]
    assert list(placed.generation) == [0, 1, 0, 2, 0]
    assert placed.seconds.to_numpy() == pytest.approx([0.0005, 0.0005, 0.001, 0.01, 0.001])
    with pytest.raises(ValueError, match="1 origins for 2 measured iterations"):
        place_collections(actions, 1, origins[:1], events)
    # a real run: every rank's collections counted, each in one of the places
    table = run("mlp", (2, 3), 2, ["gpipe"], iterations=2, warmup=1, pin_cores=False,
                width=32, depth=4, in_features=32)
    assert set(table["rank"]) == {0, 1} and set(table.place) <= {"in_F", "in_B", "between",
                                                                 "outside"}
    assert (table["count"] > 0).all() and (table.iteration_s > 0).all()
    # the run's own bookkeeping after its iterations collects: some fall outside them
    assert "outside" in set(table.place)


def test_stage_order_alone_times_a_stage_in_each_schedules_order():
    from experiments.stage_order_alone import summarise, time_orders

    actions = time_orders("mlp", (2, 3), 4, 1, ["gpipe", "1f1b"], iterations=2, rounds=2,
                          warmup=1, width=32, depth=4, in_features=32)
    assert (actions.seconds > 0).all() and (actions.gap_s.dropna() >= 0).all()
    table = summarise(actions).set_index(["schedule", "kind", "before"]).actions
    runs = 2 * 2  # iterations x rounds
    # GPipe's last stage: four forwards, then four backwards, the first after a forward;
    # 1F1B's alternates (F B F B ...): every backward after a forward
    assert table.to_dict() == {("1f1b", "B", "F"): 4 * runs, ("1f1b", "F", "B"): 3 * runs,
                               ("gpipe", "B", "B"): 3 * runs, ("gpipe", "B", "F"): 1 * runs,
                               ("gpipe", "F", "F"): 3 * runs}
    # waits to replay are one schedule's, one per forward and backward of the stage
    tiny = dict(width=32, depth=4, in_features=32)
    with pytest.raises(ValueError, match="one schedule's waits"):
        time_orders("mlp", (2, 3), 4, 1, ["gpipe", "1f1b"], 1, gaps=[0.0] * 8, **tiny)
    with pytest.raises(ValueError, match="gaps: 3 for stage 1's 8 forwards and backwards"):
        time_orders("mlp", (2, 3), 4, 1, ["gpipe"], 1, gaps=[0.0] * 3, **tiny)


@pytest.mark.parametrize("after_inputs,at_start", [(True, False), (False, False),
                                                    (True, True)])
def test_a_stage_posts_its_next_receives_once_its_current_inputs_are_in(after_inputs, at_start):
    """Posting a receive while a message streams in on the same gloo connection stalls
    it (experiments/send_then_compute.py, ``next``): a stage waits for its action's inputs
    before it posts the next action's receives, then computes.  By default every receive
    of the step is posted as it starts, before any message can come (a message sent
    before its receive is posted waits for the sender's I/O thread)."""
    from executor.pipeline import stage_skips
    from executor.recorder import Recorder
    from executor.stage import StageRunner
    from executor.stage_alone import SynthTransport, message_shapes

    class Logged(SynthTransport):
        def prefetch(self, stage, kind, mb, src_stage=None):
            log.append(("post", kind, mb))
            super().prefetch(stage, kind, mb, src_stage)

        def recv(self, stage, kind, mb, src_stage=None):
            log.append(("recv", kind, mb))
            return super().recv(stage, kind, mb, src_stage)

    log: list[tuple[str, str, int]] = []
    module, loss_fn, x, _ = builtin_job("mlp", 4, width=8, depth=5, in_features=8)
    plan = Plan([2, 2, 2], 2, 4, checkpoint="never", schedule="gpipe")
    schedule = build_schedule(plan)
    part = split_module(module, plan.balance)[1]
    runner = StageRunner(0, {1: part}, plan, loss_fn, torch.device("cpu"),
                         Logged(message_shapes(module, plan, x), torch.device("cpu")),
                         Recorder(0, torch.device("cpu")), skips=stage_skips(module, plan),
                         prefetch_after_inputs=after_inputs, receives_at_start=at_start)
    runner.run(tuple(a for a in schedule.order[1] if a.stage == 1), None, None)
    # the middle stage's GPipe order: F0 F1 B1 B0
    if at_start:  # every receive posted first (later posts of them change nothing)
        assert log[:4] == [("post", "F", 0), ("post", "F", 1), ("post", "B", 1), ("post", "B", 0)]
        assert [e for e in log if e[0] == "recv"] == [("recv", "F", 0), ("recv", "F", 1),
                                                      ("recv", "B", 1), ("recv", "B", 0)]
    elif after_inputs:
        assert log == [("recv", "F", 0), ("post", "F", 1), ("recv", "F", 1), ("post", "B", 1),
                       ("recv", "B", 1), ("post", "B", 0), ("recv", "B", 0)]
    else:  # before waiting for them, as until 2026-11-27
        assert log == [("post", "F", 1), ("recv", "F", 0), ("post", "B", 1), ("recv", "F", 1),
                       ("post", "B", 0), ("recv", "B", 1), ("recv", "B", 0)]


def test_send_then_compute_times_each_message_from_its_post_to_its_receipt():
    from executor.calibrate import _gather
    from executor.distributed import _free_port
    from experiments.send_then_compute import (
        CONDITIONS,
        SKIPPED,
        _exchange,
        delivery_table,
        pipeline_transits,
        summarise,
    )

    # the sender's posts and the receiver's receipts on one clock: delivery is their
    # difference, warm-up rounds left out, a receipt without its post dropped
    sender = [(SKIPPED, "waits", "compute", 10.0), (SKIPPED, "late", "sleep", 20.0),
              (SKIPPED + 1, "waits", "compute", 30.0), (0, "waits", "compute", 1.0)]
    receiver = [(SKIPPED, "waits", "compute", 10.0002, 9.99),
                (SKIPPED, "late", "sleep", 20.0012, 20.0005),  # posted 0.5 ms after the send
                (SKIPPED + 1, "waits", "compute", 30.0004, 29.99),
                (0, "waits", "compute", 1.5, 0.9), (SKIPPED + 2, "waits", "sleep", 40.0, 39.9)]
    table = delivery_table(sender, receiver).assign(bytes=8, messages=1)
    assert table.delivery_ms.to_numpy() == pytest.approx([0.2, 1.2, 0.4])
    assert table.wait_ms.to_numpy() == pytest.approx([0.2, 0.7, 0.4])
    summary = summarise(table).set_index(["receiver", "after"])
    assert summary.loc[("waits", "compute"), "rounds"] == 2
    assert summary.loc[("waits", "compute"), "mean"] == pytest.approx(0.3)
    assert summary.loc[("late", "sleep"), "median"] == pytest.approx(1.2)
    assert summary.over_1ms.to_dict() == {("waits", "compute"): 0.0, ("late", "sleep"): 1.0}
    assert summary.wait_over_1ms.to_dict() == {("waits", "compute"): 0.0, ("late", "sleep"): 0.0}
    # a real exchange between two processes: every condition of every measured round
    # delivered, after its post
    rounds = SKIPPED + 2
    items = _gather(_exchange, 2, (_free_port(), 4096, 2, rounds, 16, None), expected=2)
    by_rank = {i["rank"]: i["times"] for i in items}
    real = delivery_table(by_rank[0], by_rank[1])
    assert len(real) == 2 * len(CONDITIONS)
    assert (real.delivery_ms > 0).all()
    # the calibration pipeline's transits, GPipe: at most its 16 inputs a stage an
    # iteration that came after their receiver was ready, split by what the sender did
    pipe = pipeline_transits(("gpipe",), iterations=2, pipelines=((32, 2),))
    assert set(pipe.bytes) == {256} and 0 < pipe.inputs.sum() <= 2 * 2 * 16
    assert (pipe["median"] > 0).all() and pipe.over_1ms.between(0, 1).all()


def test_idle_costs_time_each_stages_actions_after_its_rank_slept_against_at_once():
    from executor.in_place import _stage_step, idle_costs

    job = functools.partial(builtin_job, "mlp", 8, width=32, depth=3, in_features=32)
    rows = idle_costs(job, [1, 3], [2, 4], idle_s=(0.003, 0.001), modes=("never",), rounds=2,
                      pin_cores=False, kinds=("F", "B", "FB"))
    # one row per stage, kind, size and idle (kind FB on request: a forward after a
    # backward that waited); no backward of the last stage, nor a forward after one (it
    # starts from its own loss)
    assert sorted((r.first, r.stop, r.kind, r.micro_batch, r.checkpointed, r.idle_s)
                  for r in rows) == sorted(
        [(0, 1, k, b, False, idle) for k in ("F", "B", "FB") for b in (2, 4)
         for idle in (0.001, 0.003)]
        + [(1, 4, "F", b, False, idle) for b in (2, 4) for idle in (0.001, 0.003)])
    assert all(r.hot_s > 0 and r.after_idle_s > 0 for r in rows)
    for key in {(r.first, r.kind, r.idle_s) for r in rows}:  # the median of the sizes' own
        at = [r for r in rows if (r.first, r.kind, r.idle_s) == key]
        assert all(r.seconds == pytest.approx(statistics.median(
            x.after_idle_s - x.hot_s for x in at)) for r in at)
    # every rank at once: the same rows, in a round a phase (not one a rank)
    together = idle_costs(job, [1, 3], [2], idle_s=(0.001,), modes=("never",), rounds=1,
                          pin_cores=False, at_once=True)
    assert sorted((r.first, r.kind) for r in together) == [(0, "B"), (0, "F"), (1, "F")]
    assert all(r.hot_s > 0 and r.after_idle_s > 0 for r in together)
    # the in-process executor's stages (threads): each stage in this process in turn
    threads = torch.get_num_threads()
    in_process = idle_costs(job, [1, 3], [2], idle_s=(0.001,), modes=("never",), rounds=1,
                            device="cpu")
    assert sorted((r.first, r.kind) for r in in_process) == [(0, "B"), (0, "F"), (1, "F")]
    assert all(r.hot_s > 0 and r.after_idle_s > 0 for r in in_process)
    assert torch.get_num_threads() == threads  # the caller's, kept
    # the sleep falls before the action, outside it: between F and B, or before F
    for rank, kind in ((0, "B"), (0, "F"), (1, "F")):
        step = _stage_step(job, [1, 3], rank, 2, idle=(kind, 0.05))
        step()  # (the first: autograd's and the allocator's start-up)
        t0 = time.perf_counter()
        seconds = step()
        assert time.perf_counter() - t0 >= 0.05
        assert seconds["F"] < 0.05 and seconds["B"] < 0.05
    # "FB": asleep before the backward, then a step more, whose forward it times
    step = _stage_step(job, [1, 3], 0, 2, idle=("FB", 0.05))
    step()
    t0 = time.perf_counter()
    seconds = step()
    assert time.perf_counter() - t0 >= 0.05 and seconds["F"] < 0.05 and seconds["B"] < 0.05
    # by default three of the sizes, spread over them in log2 (the curve reads between)
    spread = idle_costs(job, [1, 3], [1, 2, 4, 8], idle_s=(0.001,), modes=("never",),
                        rounds=1, pin_cores=False, kinds=("F",))
    assert sorted({r.micro_batch for r in spread}) == [1, 2, 8]
    with pytest.raises(ValueError, match="idle_s must hold positive seconds"):
        idle_costs(job, [1, 3], [2], idle_s=(0.0,))
    with pytest.raises(ValueError, match="kinds must be some of F, B, FB"):
        idle_costs(job, [1, 3], [2], kinds=("W",))
    with pytest.raises(ValueError, match="at least 2 stages"):
        idle_costs(job, [4], [2])


def test_run_on_costs_time_a_forward_after_a_forward_against_one_after_a_backward():
    from executor.in_place import RUN_ON, _stage_step, run_on_costs

    job = functools.partial(builtin_job, "mlp", 8, width=32, depth=3, in_features=32)
    rows = run_on_costs(job, [1, 3], [2, 4], modes=("never",), rounds=2, pin_cores=False)
    # one row per stage, size and kind: its scale the run-on median over the other's
    assert sorted((r.first, r.stop, r.micro_batch, r.checkpointed, r.kind) for r in rows) == [
        (first, stop, b, False, k) for first, stop in ((0, 1), (1, 4)) for b in (2, 4)
        for k in ("B", "F")]
    assert all(r.same_s > 0 and r.other_s > 0 and r.scale == pytest.approx(r.same_s / r.other_s)
               for r in rows)
    # the run-on step: two micro-batches in GPipe's order, the second forward and backward
    # timed; as many samples as two micro-batches must be in the job's batch
    step = _stage_step(job, [1, 3], 0, 4, idle=RUN_ON)
    seconds = step()
    assert seconds["F"] > 0 and seconds["B"] > 0 and seconds["between"] == 0.0
    with pytest.raises(ValueError, match="2 micro-batches of 8 samples exceed the job's batch of 8"):
        run_on_costs(job, [1, 3], [8], rounds=1, pin_cores=False)


def test_spread_sizes_keep_the_ends_and_the_nearest_to_even_steps_in_log2():
    from executor.in_place import spread_sizes

    assert spread_sizes([2, 4, 8, 16, 32], 3) == [2, 8, 32]
    assert spread_sizes([32, 2, 8, 4, 16, 2], 2) == [2, 32]
    assert spread_sizes([2, 4, 8, 16], 3) == [2, 4, 16]  # 4 and 8 tie at sqrt(32): the first
    assert spread_sizes([4, 8], 3) == [4, 8]  # no more than asked: all
    assert spread_sizes([2, 4, 8], 1) == [4]
    with pytest.raises(ValueError, match="count must be at least 1"):
        spread_sizes([2, 4], 0)


@pytest.mark.parametrize("messages", ["echo", "ring", "none"])
def test_host_contention_times_each_rank_alone_and_all_together_in_alternation(messages):
    from executor.calibrate import measure_contention

    # echo (the calibration): a message after every step, alone (to the next rank and
    # back) as together (round the ring); ring: together only; none: hot steps
    m = measure_contention(2, iterations=20, steps=5, messages=messages)
    assert m["alone_s"] > 0 and m["together_s"] > 0
    # (together / alone - 1) over the one other rank; never negative
    expected = max(m["together_s"] / m["alone_s"] - 1.0, 0.0)
    assert m["host_contention"] == pytest.approx(expected)


def test_host_contention_refuses_one_worker_and_an_unknown_protocol():
    from executor.calibrate import measure_contention

    with pytest.raises(ValueError, match="at least 2 workers"):
        measure_contention(1)
    with pytest.raises(ValueError, match="messages must be one of"):
        measure_contention(2, messages="mail")


def test_pipeline_vs_alone_pairs_each_stage_in_the_pipeline_with_itself_alone():
    """Each round runs the plan as a pipeline and every stage alone in the same order:
    one row per stage, kind and kind before, with the ratio of the two medians."""
    from experiments.pipeline_vs_alone import by_order, pair_rounds, summarise, waits

    rounds = pair_rounds("mlp", (2, 3), 4, ["gpipe", "1f1b"], rounds=1, iterations=2,
                         sizes=dict(width=32, depth=4, in_features=32))
    assert (rounds.pipeline_s > 0).all() and (rounds.alone_s > 0).all()
    table = summarise(rounds).set_index(["schedule", "stage", "kind", "before"])
    # GPipe: forwards after forwards, backwards after backwards (and the first backward
    # after the last forward) on both stages; 1F1B's last stage alternates F B F B
    assert {("gpipe", s, k, b) for s in (0, 1) for k, b in (("F", "F"), ("B", "B"), ("B", "F"))
            } <= set(table.index)
    assert ("1f1b", 1, "F", "B") in table.index and ("1f1b", 1, "B", "F") in table.index
    ratio = table.pipeline_ms / table.alone_ms
    assert ((table.ratio - ratio).abs() < 1e-9).all()  # one round: the ratio of the two

    # by_order: the first action of each stage's iteration has no kind before it
    actions = pd.DataFrame({"iteration": [0] * 4, "stage": [0, 0, 0, 1],
                            "kind": ["F", "F", "B", "F"], "microbatch": [0, 1, 0, 0],
                            "start": [0.0, 1.0, 3.0, 0.5], "end": [0.5, 2.0, 6.0, 1.5]})
    medians = by_order(actions)
    assert medians.seconds.to_dict() == {(0, "B", "F"): 3.0, (0, "F", "F"): 1.0}
    assert medians.gap_s.to_dict() == {(0, "B", "F"): 1.0, (0, "F", "F"): 0.5}
    # waits: per stage and position, the gap after the stage's previous action (none
    # before an iteration's first: 0)
    assert waits(actions) == {0: [0.0, 0.5, 1.0], 1: [0.0]}


def test_pacer_replays_a_pipelines_waits_before_each_action():
    """A stage alone, paced: each action starts its position's gap after the previous
    one ended, however soon it could have started; the gaps repeat every iteration."""
    import time

    from experiments.pipeline_vs_alone import pair_rounds
    from experiments.stage_order_alone import Pacer

    pacer = Pacer([0.0, 0.03])
    pacer.wait()  # nothing before the first: no wait
    pacer.ended()
    t = time.perf_counter()
    pacer.wait()  # position 1: 30 ms after the last ended
    assert time.perf_counter() - t >= 0.03 - 1e-3
    pacer.ended()
    t = time.perf_counter()
    pacer.wait()  # position 0 again: none
    assert pacer.position == 3 and time.perf_counter() - t < 0.03

    # sleeps that ended late shorten the next by their median lateness: 10 ms of 30
    pacer.ended()
    pacer.lateness.extend([0.01] * 15)  # sleeps have ended 10 ms late
    t = time.perf_counter()
    pacer.wait()  # position 1
    assert time.perf_counter() - t >= 0.02 - 1e-3

    # the stages alone replay the round's pipeline waits: the long ones come out about
    # as long (a short one, under a sleep's lateness, is not slept)
    rounds = pair_rounds("mlp", (2, 3), 4, ["1f1b"], rounds=1, iterations=2,
                         sizes=dict(width=32, depth=4, in_features=32), replay_waits=True)
    long = rounds[rounds.pipeline_gap_s > 2e-4]
    assert (long.alone_gap_s >= 0.7 * long.pipeline_gap_s).all()
