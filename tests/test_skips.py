"""Skip connections across stages, deferred batch norm, U-Net: torchgpipe parity."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from executor.batchnorm import DeferredBatchNorm
from executor.distributed import spawn_plans
from executor.models import builtin_job
from executor.pipeline import Pipeline
from executor.profiler import profile
from executor.skip import Pop, SkipError, Stash, check_skips, pop
from pipesim import Cluster, Plan, Profile, ProfileError, simulate
from pipesim.cluster import Device, Link
from pipesim.costs import PlanCosts
from pipesim.profile import synthetic_profile
from pipesim.trace import metrics

UNET = dict(depth=2, width=4, image_size=8)  # 13 layers; skips 1 -> 10 and 3 -> 7
BATCH = 8  # 4 chunks of 2: interleaving needs a multiple of its 2 devices
PLANS = [("gpipe", [3, 4, 6], 1), ("1f1b", [3, 4, 6], 1), ("interleaved", [3, 3, 3, 4], 2)]
MODES = ["always", "except_last", "never"]


def unet_eval(**kw):
    """U-Net with batch norm in eval mode: samples independent, so micro-batching is exact."""
    module, loss_fn, x, y = builtin_job("unet", BATCH, dtype="float64", **UNET, **kw)
    return module.eval(), loss_fn, x, y


def reference():
    module, loss_fn, x, y = unet_eval()
    loss = loss_fn(module(x), y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in module.named_parameters()}


def test_check_lists_every_problem_at_once():
    model = nn.Sequential(Pop("a"), Stash("b"), Stash("c"), nn.Identity(), Stash("c"), Pop("c"))
    with pytest.raises(SkipError) as info:
        check_skips(model)
    text = str(info.value)
    assert "layer 0 pops 'a' that no earlier layer stashes" in text
    assert "layer 4 stashes 'c', a name already used" in text
    assert "layer 1 stashes 'b' that no later layer pops" in text


def test_routes_of_the_unet():
    module, *_ = unet_eval()
    assert {(r.name, r.src, r.dst) for r in check_skips(module)} == {("level0", 1, 10),
                                                                     ("level1", 3, 7)}


def test_a_model_with_bad_skips_is_refused_before_running():
    model = nn.Sequential(nn.Linear(2, 2), Stash("x"), nn.Linear(2, 2))
    with pytest.raises(SkipError, match="layer 1 stashes 'x' that no later layer pops"):
        Pipeline(model, Plan([1, 2], 1, 2))


@pytest.mark.parametrize("schedule,balance,v", PLANS)
@pytest.mark.parametrize("mode", MODES)
def test_unet_gradients_equal_unpipelined_threads(schedule, balance, v, mode):
    ref_loss, ref_grads = reference()
    module, loss_fn, x, y = unet_eval()
    plan = Plan(balance, 4, BATCH, checkpoint=mode, schedule=schedule, virtual_stages=v)
    result = Pipeline(module, plan, loss_fn=loss_fn).run(x, y, iterations=1, warmup=0)
    assert result.loss == pytest.approx(ref_loss, rel=1e-12)
    for name, p in module.named_parameters():
        assert torch.allclose(p.grad, ref_grads[name], rtol=1e-10, atol=1e-12), name


@pytest.mark.slow
@pytest.mark.parametrize("tags", [True, False], ids=["tags", "send-order (NCCL path)"])
def test_unet_gradients_equal_unpipelined_processes(tags):
    ref_loss, ref_grads = reference()
    job = functools.partial(_eval_job)
    plans = [Plan([3, 4, 6], 4, BATCH, checkpoint=mode, schedule=s) for s in ("gpipe", "1f1b")
             for mode in ("always", "never")]
    for plan, (result, ranks) in zip(plans, spawn_plans(job, plans, iterations=1, warmup=0,
                                                        return_grads=True, tags=tags),
                                     strict=True):
        assert result.loss == pytest.approx(ref_loss, rel=1e-12), plan.label()
        grads = {k: torch.from_numpy(v) for r in ranks.values() for k, v in r.grads.items()}
        for name, g in grads.items():
            assert torch.allclose(g, ref_grads[name], rtol=1e-10, atol=1e-12), (plan.label(), name)


def _eval_job():
    return unet_eval()


def test_the_intermediate_stage_never_receives_the_skip():
    module, loss_fn, x, y = unet_eval()
    pipe = Pipeline(module, Plan([3, 4, 6], 3, BATCH, checkpoint="always"), loss_fn=loss_fn)
    pipe.step(x, y)
    received = pipe.last_transport.received
    # level0 is stashed by layer 1 (stage 0) and popped by layer 10 (stage 2)
    assert not [k for k in received if k[0] == 1 and k[1].endswith("level0")]
    assert [k for k in received if k[0] == 2 and k[1] == "S:level0"]
    assert [k for k in received if k[0] == 0 and k[1] == "SB:level0"]


@pytest.mark.parametrize("mode", MODES)
def test_deferred_batch_norm_running_stats_equal_full_batch(mode):
    torch.manual_seed(0)
    # one BatchNorm: its input does not depend on micro-batch statistics.  (A second one
    # downstream sees activations normalised per micro-batch, as in any micro-batched
    # forward, and cannot match the full batch.)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(),
                          nn.Linear(4 * 8 * 8, 3)).double()
    full = copy.deepcopy(model)
    x = torch.randn(10, 3, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (10,))
    full(x)  # one full-batch step in train mode updates the running statistics once
    piped = DeferredBatchNorm.convert(model)
    Pipeline(piped, Plan([3, 3], 4, 10, checkpoint=mode)).step(x, y)
    a, b = full[1], piped[1]
    assert isinstance(b, DeferredBatchNorm)
    assert torch.allclose(a.running_mean, b.running_mean, rtol=0, atol=1e-14)
    assert torch.allclose(a.running_var, b.running_var, rtol=1e-12, atol=1e-14)
    assert int(a.num_batches_tracked) == int(b.num_batches_tracked) == 1


def test_plain_batch_norm_differs_when_micro_batched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    full = copy.deepcopy(model)
    x = torch.randn(8, 4, dtype=torch.float64) * 3 + 1
    full(x)
    Pipeline(model, Plan([2, 1], 4, 8)).step(x, torch.zeros(8, dtype=torch.long))
    assert not torch.allclose(full[1].running_mean, model[1].running_mean)


def test_profile_records_skip_bytes_and_the_simulator_sends_them_directly(tmp_path):
    module, loss_fn, x, y = builtin_job("unet", 8, **UNET)
    prof = profile(module, (x, y), [2, 4], loss_fn=loss_fn, repeats=1, warmup=0, progress=False)
    skips = {s["name"]: s for s in prof.meta["skips"]}
    assert skips["level0"]["bytes"]["2"] == 2 * 4 * 8 * 8 * 4  # [2, width, 8, 8] float32
    back = Profile.load(prof.save(tmp_path / "unet.csv"))
    assert back.skip_routes() == prof.skip_routes()
    trace = simulate(back, Plan([3, 4, 6], 2, 8, checkpoint="never"), Cluster.cpu_processes(3))
    a = trace.actions
    sends = a[a.kind == "SEND_S"]
    assert set(sends.resource) == {"dev0->dev2", "dev1->dev2"}  # level0 skips stage 1
    arrive = sends[sends.resource == "dev0->dev2"].set_index("microbatch")["end"]
    f2 = a[(a.kind == "F") & (a.stage == 2)].set_index("microbatch")["start"]
    assert (f2 >= arrive - 1e-12).all()
    grads = a[a.kind == "SEND_SB"]
    assert set(grads.resource) == {"dev2->dev0", "dev2->dev1"}


def test_malformed_skip_metadata_is_named(tmp_path):
    module, loss_fn, x, y = builtin_job("unet", 4, **UNET)
    prof = profile(module, (x, y), [2], loss_fn=loss_fn, repeats=1, warmup=0, progress=False)
    prof.meta["skips"][0]["pop_layer"] = 99
    path = prof.save(tmp_path / "bad.csv")
    with pytest.raises(ProfileError, match=r"bad\.csv: skip 'level1' goes from layer 3 to 99"):
        Profile.load(path)


class _RememberPopped(nn.Module):
    """After a Pop: remembers the popped skip weakly, and checks that every earlier
    micro-batch's skip is gone by the time the next micro-batch arrives."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        import gc
        import weakref

        gc.collect()
        assert all(ref() is None for ref in self.seen), "an earlier skip tensor is still alive"
        self.seen.append(weakref.ref(self.popped))
        return x


class _Pop(Pop):
    """Pop by addition that hands the popped tensor to a _RememberPopped."""

    def __init__(self, name, remember):
        super().__init__(name, "add")
        self._remember = [remember]  # a list: not registered as a submodule

    def forward(self, x):
        self._remember[0].popped = skip = pop(self.name)
        return x + skip


def test_a_received_skip_is_freed_as_soon_as_it_is_used():
    remember = _RememberPopped()
    model = nn.Sequential(nn.Linear(4, 4), Stash("s"), nn.Linear(4, 4), nn.Linear(4, 4),
                          _Pop("s", remember), remember, nn.Linear(4, 2)).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    # GPipe: stage 2 runs F0, F1, F2, F3 before any backward; the skip of micro-batch m
    # must be gone when micro-batch m+1 arrives, although its backward has not run yet
    Pipeline(model, Plan([2, 2, 3], 4, 8, checkpoint="never")).step(x, torch.zeros(8).long())
    assert len(remember.seen) == 4


# ------------------------------------------------------------ the memory of skips
def _with_skip(prof: Profile, stash: int, pop: int, per_sample: int = 50) -> Profile:
    """``prof`` with one skip from layer ``stash`` to ``pop`` of ``per_sample`` bytes."""
    sizes = {str(b): per_sample * b for b in prof.micro_batch_sizes}
    skip = {"name": "s", "stash_layer": stash, "pop_layer": pop, "bytes": sizes}
    return Profile(prof.table, {**prof.meta, "skips": [skip]})


def _level_before_backward(prof: Profile, plan: Plan, device: str = "dev0") -> float:
    trace = simulate(prof, plan)
    first_b = trace.actions.query("kind == 'B'")["start"].min()
    mem = trace.memory[(trace.memory.device == device) & (trace.memory.time < first_b)]
    return float(mem["bytes"].iloc[-1])


@pytest.mark.parametrize(("mode", "kept"), [("always", 1), ("never", 0)])
def test_a_checkpointed_micro_batch_keeps_the_skips_stashed_inside_its_stage(mode, kept):
    # layers 1 -> 2 of stage 0: a checkpointed forward saves nothing, but the skip tracker
    # keeps the stashed tensor for the recomputation; a plain forward's layers save it
    prof = synthetic_profile(4, sizes=(1, 4))
    plan = Plan([3, 1], 4, 4, checkpoint=mode)
    extra = _level_before_backward(_with_skip(prof, 1, 2), plan) - _level_before_backward(prof, plan)
    assert extra == pytest.approx(kept * 4 * 50)  # m micro-batches x 50 bytes (1 sample)


def test_a_checkpointed_stash_does_not_hold_a_skip_sent_to_another_stage():
    # stage 0 stashes at layer 1 for stage 1: plain, the next layer saves that tensor as its
    # input (one storage); checkpointed, only the stage's input and output are kept
    prof = synthetic_profile(4, sizes=(1, 4), act_bytes=50)
    skipped = _with_skip(prof, 1, 3)
    for mode, kept in (("never", 0), ("always", 1)):
        plan = Plan([3, 1], 4, 4, checkpoint=mode)
        extra = _level_before_backward(skipped, plan) - _level_before_backward(prof, plan)
        assert extra == pytest.approx(kept * 4 * 50), mode


def test_a_stash_layer_passes_one_storage_on():
    # layer 0 saves its output, layer 2 its input: through the Stash layer 1 (which saves
    # nothing) they are the same tensor, counted once in the stage's stash
    prof = synthetic_profile(3, sizes=(1, 2))
    t = prof.table.copy()
    t.loc[t.layer == 0, ["saved_output_bytes", "saved_bytes"]] = [[40, 340], [80, 680]]
    t.loc[t.layer == 1, ["saved_bytes", "saved_input_bytes", "saved_output_bytes"]] = 0
    plain = Profile(t, prof.meta)
    skipped = _with_skip(plain, 1, 2, per_sample=40)
    assert plain.span_cost(0, 3, 2).stash_bytes - skipped.span_cost(0, 3, 2).stash_bytes == 80


def test_a_stage_ending_in_a_stash_layer_outputs_a_tensor_its_stash_holds_already():
    # layer 0 saves its output (40 a sample), the Stash layer 1 passes it on as the stage
    # output: one storage, counted once -- not again as an output no layer saved (the
    # U-Net's first stage of [4, 4, 2, 3] was 0.5 MiB over for it)
    prof = synthetic_profile(3, sizes=(1, 2), act_bytes=40)
    t = prof.table.copy()
    t.loc[t.layer == 0, ["saved_output_bytes", "saved_bytes"]] = [[40, 340], [80, 680]]
    t.loc[t.layer == 1, ["saved_bytes", "saved_input_bytes", "saved_output_bytes"]] = 0
    plain = Profile(t, prof.meta)
    skipped = _with_skip(plain, 1, 2, per_sample=40)
    # without the skip, layer 1 is an ordinary layer that saves nothing: its output counts
    assert plain.span_cost(0, 2, 2).stash_bytes == 680 + 80
    assert skipped.span_cost(0, 2, 2).stash_bytes == 680


def test_a_skip_gradient_holds_its_buffer_until_the_backward_ends():
    prof = _with_skip(synthetic_profile(4, sizes=(1, 2)), 1, 3)
    plan = Plan([2, 2], 1, 1, checkpoint="never")
    trace = simulate(prof, plan, Cluster.cpu_processes(2))
    received = trace.memory_by_category.query("device == 'cpu0' and category == 'received'")
    b0 = trace.actions.query("kind == 'B' and stage == 0").iloc[0]
    held = received[received.time <= b0.start]["bytes"].iloc[-1]
    # the output's gradient (100 bytes) and the skip's (50), posted ahead, both held
    assert held == pytest.approx(150)
    assert received[received.time >= b0.end]["bytes"].iloc[-1] == 0  # freed by its end


def test_a_skip_that_is_the_stage_output_is_kept_once_by_a_sender_that_keeps_its_sends():
    # the Stash is stage 0's last layer: the skip it sends to stage 2 is stage 0's output,
    # sent to stage 1 too -- one storage: keeping sends costs the same with the skip or not
    prof = synthetic_profile(6, sizes=(1, 4), act_bytes=50)
    plan = Plan([2, 2, 2], 4, 4, checkpoint="never")
    devices = [Device(f"d{i}") for i in range(3)]

    def peak(profile: Profile, keeps: bool) -> float:
        cluster = Cluster(devices, link=Link(0.0, 1e30), sender_keeps_sends=keeps)
        return metrics(simulate(profile, plan, cluster)).peak_memory_bytes["d0"]

    skipped = _with_skip(prof, 1, 5)
    assert peak(skipped, True) - peak(skipped, False) == pytest.approx(
        peak(prof, True) - peak(prof, False))


def _with_transients(prof: Profile, fwd: int, bwd: int = 0) -> Profile:
    """``prof`` with every layer's forward and backward holding ``fwd`` and ``bwd`` bytes
    of temporaries a sample."""
    b = prof.table.micro_batch
    return Profile(prof.table.assign(fwd_transient_bytes=fwd * b, bwd_transient_bytes=bwd * b),
                   prof.meta)


def test_a_forwards_peak_holds_the_running_layers_input_output_and_temporaries():
    # each layer saves its input (100 a sample) and 200 more, makes a 100-byte output and
    # 10 bytes of temporaries; the span's input is the received buffer, held apart
    prof = _with_transients(synthetic_profile(3, sizes=(1, 2), act_bytes=100), 10)
    # layer 2 runs on layer 0's 200 and layer 1's 300 kept, its own input 100 (alive
    # until it is saved), what it makes: its output 100 and its 200 saved, and 10
    assert prof.span_cost(0, 3, 1).fwd_transient_bytes == 200 + 300 + 100 + 300 + 10
    # a stage of layers 1..2: layer 1's input is the received buffer, not counted again
    assert prof.span_cost(1, 3, 1).fwd_transient_bytes == 200 + 100 + 300 + 10
    # never below what the forward keeps at its end (its stash but the received input)
    for first, stop in ((0, 1), (0, 2), (0, 3), (1, 3), (2, 3)):
        cost = prof.span_cost(first, stop, 2)
        kept = cost.stash_bytes - prof.at(first, 2)["saved_input_bytes"]
        assert cost.fwd_transient_bytes >= kept


def test_a_stage_opening_with_a_pop_holds_the_joined_tensor_beside_its_received_parts():
    # U-Net [7, 6]: stage 1 opens with the Pop of skip 3 -> 7; the tensor it joins is new,
    # and the next layer saves it, beside the received input and skip (measured: the model
    # counted it as if it were the received buffer, 9% under at one micro-batch)
    # (the grid's size: at a few kB a tensor, the allocator's rounding is of the same size)
    job = functools.partial(builtin_job, "unet", 32, depth=2, width=16, image_size=32)
    module, loss_fn, x, y = job()
    prof = profile(module, (x, y), [32], loss_fn=loss_fn, repeats=1, warmup=0, progress=False,
                   checkpointed=False)
    plans = [Plan(b, 1, 32, checkpoint="never") for b in ([7, 6], [6, 7], [8, 5])]
    runs = spawn_plans(job, plans, iterations=1, warmup=1, track_memory=True)
    cluster = Cluster.cpu_processes(2)
    for plan, (result, _) in zip(plans, runs, strict=True):
        predicted = metrics(simulate(prof, plan, cluster)).peak_memory_bytes["cpu1"]
        measured = result.trace.meta["peak_memory"]["rank1"]
        assert predicted == pytest.approx(measured, rel=0.01), plan.label()


def _with_raw_rises(prof: Profile, temporaries: int = 10, loss_rise: int | None = None
                    ) -> Profile:
    """``prof`` (synthetic, 100-byte activations a sample) with measured backward rises:
    each layer makes its input gradient and ``temporaries`` a sample, its output gradient
    alive beside them while fed (``bwd_fed_rise_bytes``); the last layer ends in the loss
    with a rise of ``loss_rise`` a sample where given."""
    t = prof.table.copy()
    b = t.micro_batch
    t["bwd_rise_bytes"] = (100 + temporaries) * b
    t["bwd_fed_rise_bytes"] = (200 + temporaries) * b
    t["fwd_transient_bytes"] = 0
    meta = dict(prof.meta)
    if loss_rise is not None:
        last = t.layer == t.layer.max()
        t.loc[last, "bwd_rise_bytes"] = loss_rise * b[last]
        t.loc[last, "bwd_fed_rise_bytes"] = loss_rise * b[last]
        meta["loss_in_last_layer"] = True
    # what the older profiles carry: the rise less the input gradient (and the logits')
    counted = 100 * b + (100 * b * (t.layer == t.layer.max()) if loss_rise is not None else 0)
    t["bwd_transient_bytes"] = (t.bwd_rise_bytes - counted).clip(lower=0)
    return Profile(t, meta)


def test_a_loss_layer_whose_rise_is_its_input_gradient_holds_it():
    # U-Net's head, a 1x1 convolution under the loss: its backward rises by the logits'
    # gradient and its input gradient, nothing more, so the rise less both reads 0 and
    # the older estimate counted no input gradient there (measured: the loss stage 4% under)
    raw = _with_raw_rises(synthetic_profile(2, sizes=(1,), act_bytes=100), loss_rise=200)
    assert raw.span_cost(0, 2, 1).bwd_transient_bytes == 100
    older = Profile(raw.table.drop(columns=["bwd_rise_bytes", "bwd_fed_rise_bytes"]), raw.meta)
    assert older.span_cost(0, 2, 1).bwd_transient_bytes == 0


def test_a_first_backward_peaking_in_its_loss_holds_no_other_layers_gradients():
    # a stage's first backward makes its weight gradients, which stay, layer by layer.
    # Its loss layer, walked first, peaks with its loss's gradients (6000 a sample) beside
    # its own 50 bytes of gradients, before the layer before it makes any: two such stages
    # whose first layers differ only in parameters (3000 or 50, the rise forming them as
    # temporaries alike) peak that far apart, the parameters alone.  (Taking the largest
    # layer's gradients off the transient, the model was GPT's loss stage 2% under.)
    def first_backward_peak(inner: int) -> float:
        prof = _with_raw_rises(synthetic_profile(2, sizes=(1,), act_bytes=100), loss_rise=6000)
        t = prof.table.copy()
        t["param_bytes"] = [inner, 50]
        t.loc[0, ["bwd_rise_bytes", "bwd_fed_rise_bytes", "bwd_transient_bytes"]] += inner
        trace = simulate(Profile(t, prof.meta), Plan([2], 1, 1, checkpoint="never"))
        return metrics(trace).peak_memory_bytes["dev0"]

    assert first_backward_peak(3000) - first_backward_peak(50) == 2950


def test_an_inner_layer_holds_its_output_gradient_and_not_yet_the_stages_input_gradient():
    prof = _with_raw_rises(synthetic_profile(3, sizes=(1,), act_bytes=100))
    # layers 1..2 after a stage boundary: layer 2 (walked first) holds its input gradient
    # and 10; the stage's input gradient (100, layer 1's, which the simulator holds from
    # the backward's start) does not exist yet, so beside it only 10 more
    assert prof.span_cost(1, 3, 1).bwd_transient_bytes == 10
    # (layer 1 then holds layer 2's gradient while it makes its own, 210, after layer 2
    # freed the 300 it saved.)  The first stage has no input gradient to hold: layer 2's
    # 110 is the peak
    assert prof.span_cost(0, 3, 1).bwd_transient_bytes == 110


def test_a_checkpointed_backward_holds_its_recomputations_temporaries_only_while_it_runs():
    # the first layer's forward holds 1000 bytes a sample of temporaries beside the 300 it
    # makes (its output, and the 200 it saves beyond its input): the recomputation peaks
    # there, 1300 above the backward's start, before the other layers' activations exist
    prof = _with_raw_rises(synthetic_profile(3, sizes=(1,), act_bytes=100))
    t = prof.table.assign(fwd_transient_bytes=1000 * (prof.table.layer == 0))
    prof = Profile(t, prof.meta)
    span = prof.span_cost(0, 3, 1)
    assert span.recompute_rise_bytes == 1300
    cost = PlanCosts(prof, Plan([3], 1, 1, checkpoint="always")).cost(0, 0)
    # held beside the recomputed activations from the start, as much as makes the
    # backward's peak the larger of the recomputation's and the backward proper's
    assert cost.recompute_bytes + cost.bwd_transient_bytes == max(
        1300, cost.recompute_bytes + span.bwd_transient_bytes)
    # (the older estimate held the largest temporaries, 1000, through the whole backward)
    assert cost.bwd_transient_bytes < 1000
    # torch.utils.checkpoint stops once the last saved tensor is made again: a last layer
    # that saves nothing is not re-run, whatever its forward holds
    t.loc[t.layer == 2, ["saved_bytes", "saved_input_bytes", "fwd_transient_bytes"]] = (
        0, 0, 5000)
    assert Profile(t, prof.meta).span_cost(0, 3, 1).recompute_rise_bytes == 1300


def test_checkpointed_unet_stages_peak_as_measured():
    # the recomputation's temporaries (and where it stops), the loss layer's input
    # gradient, the stage's input gradient made at the end, the recomputed output freed
    # in the last layer's backward: each stage's peak, where the recomputation ends and
    # the backward proper begins (measured: first stages up to 8% over, loss stages 4% under)
    job = functools.partial(builtin_job, "unet", 32, depth=2, width=16, image_size=32)
    module, loss_fn, x, y = job()
    prof = profile(module, (x, y), [32], loss_fn=loss_fn, repeats=1, warmup=0, progress=False,
                   checkpointed=False)
    plans = [Plan(b, 1, 32, checkpoint="always") for b in ([6, 7], [8, 5])]
    runs = spawn_plans(job, plans, iterations=1, warmup=1, track_memory=True)
    cluster = Cluster.cpu_processes(2)
    for plan, (result, _) in zip(plans, runs, strict=True):
        predicted = metrics(simulate(prof, plan, cluster)).peak_memory_bytes
        measured = result.trace.meta["peak_memory"]
        for d in range(2):
            assert predicted[f"cpu{d}"] == pytest.approx(measured[f"rank{d}"], rel=0.02), (
                plan.label(), d)


def test_a_backward_holds_its_inner_input_gradients_and_a_stash_sums_its_skips():
    # each layer's backward forms 10 bytes a sample of temporaries beside the input
    # gradient (100) it makes; the first layer's is the stage's (the simulator's own)
    prof = synthetic_profile(4, sizes=(1, 2), act_bytes=100)
    # layer 2, walked first, holds its 10 and the 100 it makes: nothing freed yet
    assert _with_transients(prof, 0, 10).span_cost(0, 3, 1).bwd_transient_bytes == 10 + 100
    # a Stash ending the stage, its skip going on: the skip's gradient and the stage
    # output's are summed into a new tensor as the backward starts
    t = _with_transients(prof, 0).table
    t.loc[t.layer == 2, ["saved_bytes", "saved_input_bytes", "saved_output_bytes"]] = 0
    plain = Profile(t, prof.meta)
    assert plain.span_cost(0, 3, 1).bwd_transient_bytes == 0
    assert _with_skip(plain, 2, 3).span_cost(0, 3, 1).bwd_transient_bytes == 100

