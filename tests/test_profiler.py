"""The layer profiler on real torch layers and on every built-in model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from executor.models import BUILTIN_MODELS, build_model, builtin_job
from executor.profiler import profile, profile_layer, time_whole_model
from pipesim.profile import Profile, synthetic_profile

SMALL = {"mlp": dict(width=32, depth=3, in_features=16),
         "resnet": dict(width=4, blocks=(1, 1), image_size=8),
         "gpt": dict(vocab=64, d_model=16, n_layers=2, n_heads=2, seq_len=8),
         "unet": dict(depth=1, width=4, image_size=8),
         "resnet_skip": dict(width=4, blocks=1, image_size=8)}


def test_linear_saves_exactly_its_input():
    x = torch.randn(8, 16)
    row = profile_layer(nn.Linear(16, 32), x, repeats=1, warmup=0)
    assert row["saved_bytes"] == x.numel() * 4
    assert row["saved_input_bytes"] == x.numel() * 4
    assert row["saved_output_bytes"] == 0
    assert row["output_bytes"] == 8 * 32 * 4
    assert row["param_bytes"] == (16 * 32 + 32) * 4


def test_linear_relu_saves_input_plus_what_relu_keeps():
    x = torch.randn(8, 16)
    row = profile_layer(nn.Sequential(nn.Linear(16, 32), nn.ReLU()), x, repeats=1, warmup=0)
    # Linear keeps its input; ReLU keeps its output (the layer's output)
    assert row["saved_bytes"] == x.numel() * 4 + 8 * 32 * 4
    assert row["saved_output_bytes"] == 8 * 32 * 4


def test_autograd_nodes_count_each_layers_backward_functions_and_the_loss():
    # Linear+ReLU on a 2-D input: addmm, the weight's transpose, relu (the parameters'
    # accumulators are not counted); the last Linear with the cross-entropy: addmm, the
    # transpose, log-softmax, nll-loss
    built = build_model("mlp", width=16, depth=3, in_features=8)
    batch = built.make_batch(4)
    prof = profile(built.module, batch, [2], loss_fn=built.loss_fn, repeats=1, warmup=0,
                   progress=False, checkpointed=False, split=False)
    assert prof.table.sort_values("layer").autograd_nodes.tolist() == [3, 3, 3, 4]
    assert prof.autograd_nodes(0, 2) == 6
    row = profile_layer(nn.Linear(16, 32, bias=False), torch.randn(8, 16), repeats=1, warmup=0)
    assert row["autograd_nodes"] == 2  # mm and the transpose


def test_times_are_positive_medians():
    row = profile_layer(nn.Linear(64, 64), torch.randn(32, 64), repeats=3, warmup=1)
    assert row["fwd_s"] > 0 and row["bwd_s"] > 0


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_every_builtin_model_profiles_at_two_sizes(name):
    built = build_model(name, **SMALL[name])
    prof = profile(built.module, built.make_batch(4), [2, 4], loss_fn=built.loss_fn,
                   repeats=1, warmup=0, progress=False, meta={"model": name})
    assert prof.n_layers == len(built.module)
    assert prof.micro_batch_sizes == (2, 4)
    t = prof.table
    assert (t["fwd_s"] > 0).all() and (t["bwd_s"] >= 0).all()
    # activations grow with the micro-batch; parameters do not
    two, four = (t[t.micro_batch == b].set_index("layer") for b in (2, 4))
    assert (four["output_bytes"] == 2 * two["output_bytes"]).all()
    assert (four["param_bytes"] == two["param_bytes"]).all()
    for key in ("device", "device_name", "dtype", "torch_version", "threads", "repeats", "date"):
        assert key in prof.meta
    assert prof.meta["model"] == name
    assert time_whole_model(built.module, built.make_batch(2), built.loss_fn, repeats=1, warmup=0) > 0


def test_profile_rejects_non_sequential_and_small_batches():
    with pytest.raises(TypeError, match=r"nn\.Sequential"):
        profile(nn.Linear(2, 2), (torch.randn(2, 2), torch.zeros(2)), [1])
    built = build_model("mlp", **SMALL["mlp"])
    with pytest.raises(ValueError, match="fewer than the largest micro-batch size 8"):
        profile(built.module, built.make_batch(4), [2, 8])


def test_noisy_repetitions_and_inverted_sizes_are_flagged():
    from executor.profiler import _noisy, _not_monotone

    steady = _noisy(0, 4, [(1e-3, 2e-3)] * 5)
    assert steady == []
    burst = _noisy(3, 4, [(1e-3, 2e-3), (1e-3, 2e-3), (8e-3, 2e-3), (9e-3, 2e-3), (8e-3, 2e-3)])
    assert [(f["layer"], f["column"]) for f in burst] == [(3, "fwd_s")]
    rows = [{"layer": 0, "micro_batch": 2, "fwd_s": 8e-3, "bwd_s": 1e-3},
            {"layer": 0, "micro_batch": 4, "fwd_s": 0.3e-3, "bwd_s": 1.5e-3}]
    flags = _not_monotone(rows)
    assert [(f["micro_batch"], f["column"]) for f in flags] == [(2, "fwd_s")]
    assert "8.000 ms at 2 samples" in flags[0]["why"]


def test_a_whole_model_checkpoint_saving_beyond_half_a_forward_is_noise_read_as_none():
    from executor.profiler import _implausible_saving
    from pipesim.profile import MAX_CHECKPOINT_SAVING

    # a saving within the bound (10% of the forward, a GPT on a GPU) stays, unflagged
    real = {"fwd_s": 10e-3, "bwd_s": 20e-3, "ckpt_fwd_s": 9e-3, "ckpt_bwd_s": 29e-3}
    assert _implausible_saving(real, 8) == [] and real["ckpt_bwd_s"] == 29e-3
    # a checkpointed forward in negative seconds (a tiny model, one repetition, a busy
    # machine) and a backward saving beyond the bound read as no saving, flagged
    noise = {"fwd_s": 0.1e-3, "bwd_s": 0.2e-3, "ckpt_fwd_s": -0.08e-3,
             "ckpt_bwd_s": 0.3e-3 - (MAX_CHECKPOINT_SAVING + 0.1) * 0.1e-3}
    flags = _implausible_saving(noise, 2)
    assert [(f["layer"], f["micro_batch"], f["column"]) for f in flags] == [
        ("whole model", 2, "ckpt_fwd_s"), ("whole model", 2, "ckpt_bwd_s")]
    assert noise["ckpt_fwd_s"] == 0.1e-3 and noise["ckpt_bwd_s"] == pytest.approx(0.3e-3)
    # and the profile it makes loads (a negative reading was a ProfileError at load)
    table = synthetic_profile(2, sizes=(2, 4)).table
    Profile(table, {"whole_model": {"2": noise, "4": real}})


def test_profile_measures_host_time_and_checkpoint_costs():
    module, loss_fn, x, y = builtin_job("mlp", 4, width=16, depth=3, in_features=8)
    prof = profile(module, (x, y), [2, 4], loss_fn=loss_fn, repeats=2, warmup=1, progress=False)
    t = prof.table
    for column in ("host_fwd_s", "host_bwd_s", "ckpt_fwd_s", "ckpt_bwd_s"):
        assert column in prof.optional_columns and (t[column] >= 0).all()
    # on CPU the host issues the work and does it: the same clock, the same region
    assert (t["host_fwd_s"] == t["fwd_s"]).all()
    assert {"ckpt_fwd_s", "ckpt_bwd_s"} <= set(prof.meta["whole_model"]["2"])
    span = prof.span_cost(0, prof.n_layers, 2)
    # what the checkpoint adds; a saving only as far as the whole model measured one
    saving = prof.checkpoint_saving(2)
    assert span.ckpt_fwd_extra_s >= -min(saving[0], 0.5) * span.fwd_s - 1e-12
    assert span.ckpt_bwd_extra_s >= -min(saving[1], 0.5) * span.fwd_s - 1e-12


def test_the_whole_models_checkpoint_extra_is_read_against_the_plain_pass_right_after_it(
        monkeypatch):
    import executor.profiler as profiler

    # scripted whole-model passes, in the order a profiling pass times them: the plain
    # pass (right after the layer-by-layer one: colder), the checkpointed one, the plain
    # one again
    script = {False: [(1.0, 2.0), (0.9, 1.8)], True: [(1.5, 3.5)]}
    calls: list[bool] = []

    def scripted(model, x, loss_fn, target, grad, device, checkpointed=False):
        calls.append(checkpointed)
        runs = script[checkpointed]
        return runs[(calls.count(checkpointed) - 1) % len(runs)]

    monkeypatch.setattr(profiler, "_time_whole", scripted)
    module, loss_fn, x, y = builtin_job("mlp", 2, width=16, depth=3, in_features=8)
    prof = profile(module, (x, y), [2], loss_fn=loss_fn, repeats=1, warmup=0, progress=False)
    assert calls == [False, True, False]
    whole = prof.meta["whole_model"]["2"]
    assert (whole["fwd_s"], whole["bwd_s"]) == (1.0, 2.0)  # the first plain pass's
    # what the checkpoint adds (1.5 - 0.9 forward, 3.5 - 0.9 - 1.8 backward) on top of it
    assert whole["ckpt_fwd_s"] == pytest.approx(1.0 + 0.6)
    assert whole["ckpt_bwd_s"] == pytest.approx(1.0 + 2.0 + 0.8)


def test_profile_with_streams_measures_the_concurrency_law_at_each_size(tmp_path):
    module, loss_fn, x, y = builtin_job("mlp", 4, width=16, depth=3, in_features=8)
    prof = profile(module, (x, y), [2, 4], loss_fn=loss_fn, repeats=1, warmup=0,
                   progress=False, checkpointed=False, split=False, streams=2)
    law = prof.meta["stream_speedup"]
    assert set(law) == {"2", "4"}
    for speedup in law.values():
        assert speedup[0] == 1.0 and 1.0 <= speedup[1] <= 2.0
    back = Profile.load(prof.save(tmp_path / "p.csv"))
    assert back.stream_speedup(3) == pytest.approx(
        [1.0, (law["2"][1] + law["4"][1]) / 2])


def test_hook_share_reads_what_a_checkpointed_backward_loses_beside_forwards():
    from executor.profiler import hook_share

    # forwards holding the interpreter wholly (g = 1); a plain backward beside them slows
    # 1.2x (its device shared); the checkpointed one's recomputation is 40% of it and
    # holds the interpreter wholly, its hooks half of the rest: 1.2 (1 + 0.4 + 0.3)
    assert hook_share(1.2, 1.2 * 1.7, 0.4, 1.0, 1.0) == pytest.approx(0.5)
    # forwards holding half of it: every hold costs half as much
    assert hook_share(1.0, 1.0 + 0.5 * (0.4 + 0.6), 0.4, 0.5, 1.0) == pytest.approx(1.0)
    assert hook_share(1.0, 0.9, 0.4, 1.0, 1.0) == 0.0  # noise under the plain: none
    assert hook_share(1.0, 5.0, 0.4, 1.0, 1.0) == 1.0  # at most all of it
    assert hook_share(1.0, 1.5, 0.4, 0.1, 1.0) is None  # forwards too free to tell


def test_engine_interpreter_share_is_measured_beside_another_threads_forwards():
    from executor.profiler import measure_engine_interpreter_share, measure_interpreter_share

    module, loss_fn, x, y = builtin_job("mlp", 4, width=16, depth=3, in_features=8)
    shares, _ = measure_interpreter_share(module, loss_fn, x, y, "cpu", iterations=5, trials=1)
    got = measure_engine_interpreter_share(module, loss_fn, x, y, "cpu",
                                           {**shares, "F": max(shares["F"], 0.5)},
                                           iterations=5, trials=1, min_seconds=0.01)
    assert got is not None and got["B"] == 0.0 and 0.0 <= got["Bc"] <= 1.0
    # forwards that hold too little of the interpreter cannot tell a hook's hold
    assert measure_engine_interpreter_share(module, loss_fn, x, y, "cpu", {"F": 0.1},
                                            iterations=5, trials=1, min_seconds=0.01) is None


def test_profile_with_interpreter_measures_each_kinds_share_at_each_size(tmp_path):
    module, loss_fn, x, y = builtin_job("mlp", 4, width=16, depth=3, in_features=8)
    prof = profile(module, (x, y), [2, 4], loss_fn=loss_fn, repeats=1, warmup=0,
                   progress=False, checkpointed=False, split=False, interpreter=True)
    shares = prof.meta["interpreter_share"]
    assert set(shares) == {"2", "4"}
    for share in shares.values():  # plain and checkpointed forward and backward
        assert set(share) == {"F", "B", "Fc", "Bc"}
        assert all(0.0 <= g <= 1.0 for g in share.values())
    for slowdown in prof.meta["interpreter_slowdown"].values():  # beyond taking turns
        assert set(slowdown) == {"F", "B", "Fc", "Bc"} and min(slowdown.values()) >= 1.0
    back = Profile.load(prof.save(tmp_path / "p.csv"))
    assert back.interpreter_share(4) == pytest.approx((shares["4"]["F"], shares["4"]["B"]))
    assert back.checkpointed_interpreter_share(4) == pytest.approx(
        (shares["4"]["Fc"], shares["4"]["Bc"]))


def test_pairs_time_each_pass_beside_each_other_pass_and_a_profile_keeps_them(tmp_path,
                                                                            monkeypatch):
    from executor import profiler
    from pipesim.profile import PAIRS

    module, loss_fn, x, y = builtin_job("mlp", 4, width=16, depth=3, in_features=8)
    # (each timing long against the interpreter's 5 ms switch interval: a 0.1 ms pass timed
    # for 5 ms beside a looping thread once read over 50x, one hand-over in the window)
    row = profiler.measure_pair_slowdown(module, loss_fn, x[:2], y[:2], "cpu", iterations=3,
                                         trials=1, min_seconds=0.05)
    # every pass beside every pass, each direction its own figure
    assert set(row) == set(PAIRS) and len(PAIRS) == 16
    assert all(0.0 < r < 50.0 for r in row.values())
    # profile(..., pairs=True) measures them at each size (here stubbed: timed above)
    sizes_seen = []

    def measured(model, loss, xb, yb, device):
        sizes_seen.append(xb.shape[0])
        return row

    monkeypatch.setattr(profiler, "measure_pair_slowdown", measured)
    prof = profile(module, (x, y), [2, 4], loss_fn=loss_fn, repeats=1, warmup=0,
                   progress=False, checkpointed=False, split=False, pairs=True)
    assert sizes_seen == [2, 4] and set(prof.meta["pair_slowdown"]) == {"2", "4"}
    back = Profile.load(prof.save(tmp_path / "p.csv"))
    assert back.pair_slowdown(3) == pytest.approx(row)


def test_a_layers_backward_rise_holds_its_output_gradient_while_fed():
    # a ReLU makes its input gradient (8 x 64 floats) from its output gradient: with that
    # gradient held (a stage's received one) the rise is the input gradient alone; made
    # by the layer after, both are alive while the ReLU's backward runs.  The rise less
    # the input gradient reads 0 either way (what older profiles carry)
    row = profile_layer(nn.ReLU(), torch.randn(8, 64), repeats=1, warmup=0)
    assert row["bwd_rise_bytes"] == 8 * 64 * 4
    assert row["bwd_fed_rise_bytes"] == 2 * 8 * 64 * 4
    assert row["bwd_transient_bytes"] == 0
