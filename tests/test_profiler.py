"""The layer profiler on real torch layers and on every built-in model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from executor.models import BUILTIN_MODELS, build_model
from executor.profiler import profile, profile_layer, time_whole_model

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
