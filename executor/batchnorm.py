"""Deferred batch norm: running statistics of a pipelined mini-batch equal the full batch's.

With micro-batches, an ordinary BatchNorm updates its running mean and variance once per
micro-batch, with each micro-batch's statistics: not what one full-batch step does.
:class:`DeferredBatchNorm` normalises each micro-batch with its own statistics (as the
forward must) but only *accumulates* sums for the running statistics, skips that during
recomputation, and commits once per step -- after which running mean, running variance
(unbiased) and ``num_batches_tracked`` equal those of full-batch BatchNorm fed the same
inputs.  (A BatchNorm downstream of another sees activations normalised per micro-batch,
as in any micro-batched forward, so its inputs -- and statistics -- differ slightly.)

    model = DeferredBatchNorm.convert(model)     # replaces every BatchNorm{1,2,3}d
    # the pipeline runtime calls commit_deferred_batch_norm(model) after each step
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

_state = threading.local()


@contextmanager
def recomputing(flag: bool = True):
    """Mark the forwards run inside as recomputations (checkpointing) in this thread."""
    previous = getattr(_state, "recomputing", False)
    _state.recomputing = flag
    try:
        yield
    finally:
        _state.recomputing = previous


def is_recomputing() -> bool:
    return getattr(_state, "recomputing", False)


def _tensor(value: object) -> torch.Tensor:
    """A registered buffer as the tensor it is (nn.Module attributes type as Tensor | Module)."""
    assert isinstance(value, torch.Tensor)
    return value


class DeferredBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose running statistics are committed once per step (see module doc)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.register_buffer("sum", torch.zeros(num_features), persistent=False)
        self.register_buffer("sum_squares", torch.zeros(num_features), persistent=False)
        self.counter = 0

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input, got {x.dim()}D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        if not is_recomputing():
            with torch.no_grad():
                dims = [0, *range(2, x.dim())]
                total, squares = _tensor(self.sum), _tensor(self.sum_squares)
                xd = x.detach().to(total.dtype)
                total += xd.sum(dims)
                squares += (xd * xd).sum(dims)
                self.counter += x.numel() // x.shape[1]
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the accumulated mini-batch statistics into the running ones."""
        if self.counter == 0:
            return
        n = self.counter
        total, squares = _tensor(self.sum), _tensor(self.sum_squares)
        tracked = _tensor(self.num_batches_tracked)
        mean = total / n
        var = (squares / n - mean * mean) * (n / max(n - 1, 1))
        m = self.momentum if self.momentum is not None else 1.0 / float(tracked + 1)
        _tensor(self.running_mean).mul_(1 - m).add_(mean, alpha=m)
        _tensor(self.running_var).mul_(1 - m).add_(var, alpha=m)
        tracked += 1
        total.zero_()
        squares.zero_()
        self.counter = 0

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """Replace every BatchNorm of ``module`` (recursively) by a deferred one, same state."""
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, cls):
            new = cls(module.num_features, module.eps, module.momentum, module.affine)  # type: ignore[arg-type]
            mean = _tensor(module.running_mean)
            new = new.to(device=mean.device, dtype=mean.dtype)
            if module.affine:
                new.weight, new.bias = module.weight, module.bias
            _tensor(new.running_mean).copy_(mean)
            _tensor(new.running_var).copy_(_tensor(module.running_var))
            _tensor(new.num_batches_tracked).copy_(_tensor(module.num_batches_tracked))
            return new
        for name, child in module.named_children():
            module._modules[name] = cls.convert(child)
        return module


def commit_deferred_batch_norm(module: nn.Module) -> None:
    """Commit every :class:`DeferredBatchNorm` in ``module`` (once per step)."""
    for m in module.modules():
        if isinstance(m, DeferredBatchNorm):
            m.commit()
