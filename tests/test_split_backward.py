"""The backward split in autograd's graph: I forms no weight gradient, I + W = B."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from executor.models import builtin_job
from executor.split_backward import input_grad, weight_grad


def _full(stage: nn.Module, x: torch.Tensor, g: torch.Tensor):
    x = x.detach().requires_grad_(x.is_floating_point())
    stage(x).backward(g)
    return (x.grad.clone() if x.grad is not None else None,
            [p.grad.clone() for p in stage.parameters()])


@pytest.mark.parametrize(("model", "first", "stop"), [("mlp", 1, 5), ("gpt", 1, 4), ("gpt", 0, 2),
                                                        ("mlp", 0, 3)])
def test_input_then_weights_equals_the_full_backward(model, first, stop):
    torch.manual_seed(0)
    module, _, x, _ = builtin_job(model, 6, dtype="float64")
    stage = module[first:stop]
    h = module[:first](x).detach() if first else x
    g = torch.randn_like(stage(h))
    ref_x, ref_w = _full(stage, h, g)
    stage.zero_grad(set_to_none=True)
    h = h.detach().requires_grad_(h.is_floating_point())
    inputs = [h] if h.requires_grad else []
    params = list(stage.parameters())
    grads, work = input_grad(stage(h), g, inputs, params)
    assert all(p.grad is None for p in params), "I formed a weight gradient"
    if inputs:
        assert torch.allclose(grads[0], ref_x, rtol=1e-12, atol=1e-12)
    else:  # a first stage: its whole backward is W
        assert grads == []
    weight_grad(work)
    for p, ref in zip(params, ref_w, strict=True):
        assert torch.allclose(p.grad, ref, rtol=1e-12, atol=1e-12)
    assert work.joins == []  # what W needed is gone


def test_shared_weights_are_formed_by_i_and_never_twice():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).double()
    stage = nn.Sequential(lin, nn.Tanh(), lin)  # one weight used twice
    x = torch.randn(3, 4, dtype=torch.float64)
    g = torch.randn(3, 4, dtype=torch.float64)
    ref_x, ref_w = _full(stage, x, g)
    stage.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    params = list(stage.parameters())
    grads, work = input_grad(stage(x), g, [x], params)
    assert all(p.grad is not None for p in params) and work.joins == []  # I did it all
    weight_grad(work)
    assert torch.allclose(grads[0], ref_x)
    for p, ref in zip(params, ref_w, strict=True):
        assert torch.allclose(p.grad, ref)
