"""Schedules: per-device action lists built from a Plan, checked before anything runs."""

from __future__ import annotations

from collections.abc import Callable

from pipesim.errors import PlanError
from pipesim.plan import Plan
from pipesim.schedule.action import (
    BACKWARD,
    BACKWARD_KINDS,
    FORWARD,
    GRADIENT_KINDS,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Schedule,
)
from pipesim.schedule.check import check_schedule, dependencies
from pipesim.schedule.gpipe import gpipe_order
from pipesim.schedule.interleaved import interleaved_order
from pipesim.schedule.one_f_one_b import one_f_one_b_order
from pipesim.schedule.zero_bubble import zb_h1_order, zb_h2_order, zbv_order, zero_bubble_order

#: schedule name -> function(plan) -> per-device action lists
SCHEDULES: dict[str, Callable[[Plan], list[list[Action]]]] = {
    "gpipe": gpipe_order,
    "1f1b": one_f_one_b_order,
    "interleaved": interleaved_order,
    "zb-h1": zb_h1_order,
    "zb-h2": zb_h2_order,
    "zbv": zbv_order,
}


def build_schedule(plan: Plan) -> Schedule:
    """The Schedule ``plan`` names, for its stages, placement and micro-batch count."""
    if plan.schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {plan.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    order = SCHEDULES[plan.schedule](plan)
    return Schedule(plan.schedule, plan.n_stages, plan.n_microbatches, plan.stage_devices,
                    tuple(tuple(acts) for acts in order))


#: what :func:`program` returns: the stages' layer counts, each stage's device, the optimizer
#: state per parameter byte, and per device its actions in order, each as
#: ``(stage, kind, micro-batch, its size in samples, checkpointed)``
Program = tuple[tuple[int, ...], tuple[int, ...], float,
                tuple[tuple[tuple[int, str, int, int, bool], ...], ...]]


def program(plan: Plan) -> Program:
    """What ``plan`` runs, as a hashable value.

    Two plans with equal programs run the same actions, on the same stages, in the same
    order on every device, so they are one choice under two names, and what sets their
    measured times apart is noise: GPipe and 1F1B at one micro-batch, ``except_last`` and
    ``never`` at one micro-batch::

        gpipe [3,3] m=1 ckpt=never        dev0: 0F0 0B0          dev1: 1F0 1B0
        1f1b  [3,3] m=1 ckpt=except_last  dev0: 0F0 0B0          dev1: 1F0 1B0   (the same)
        gpipe [3,3] m=2 ckpt=never        dev0: 0F0 0F1 0B1 0B0  dev1: 1F0 1F1 1B1 1B0
        1f1b  [3,3] m=2 ckpt=never        dev0: 0F0 0F1 0B0 0B1  dev1: 1F0 1B0 1F1 1B1
    """
    sizes = plan.micro_batch_sizes
    order = build_schedule(plan).order
    return (tuple(plan.balance), tuple(plan.stage_devices), plan.optimizer_state_factor,
            tuple(tuple((a.stage, a.kind, a.microbatch, sizes[a.microbatch],
                         plan.checkpointed(a.microbatch)) for a in acts) for acts in order))


__all__ = ["BACKWARD", "BACKWARD_KINDS", "FORWARD", "GRADIENT_KINDS", "INPUT_GRAD", "SCHEDULES",
           "WEIGHT_GRAD", "Action", "Program", "Schedule", "build_schedule", "check_schedule",
           "dependencies", "program", "zero_bubble_order"]
