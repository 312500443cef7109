"""Splitting a batch into micro-batches exactly as the Plan (and ``tensor.chunk``) does."""

from __future__ import annotations

import torch

from pipesim.plan import Plan


def scatter(tensor: torch.Tensor, plan: Plan) -> list[torch.Tensor]:
    """``tensor.chunk(plan.chunks)`` along dim 0, checked against the plan's sizes."""
    if tensor.shape[0] != plan.batch_size:
        raise ValueError(f"batch has {tensor.shape[0]} samples but the plan's batch size is "
                         f"{plan.batch_size}")
    parts = list(tensor.chunk(plan.chunks))
    sizes = tuple(p.shape[0] for p in parts)
    if sizes != plan.micro_batch_sizes:  # cannot happen: both follow tensor.chunk
        raise AssertionError(f"micro-batch sizes {sizes} differ from the plan's "
                             f"{plan.micro_batch_sizes}")
    return parts


def loss_weight(plan: Plan, microbatch: int) -> float:
    """Weight of a micro-batch's mean loss so that the weighted sum is the batch mean."""
    return plan.micro_batch_sizes[microbatch] / plan.batch_size
