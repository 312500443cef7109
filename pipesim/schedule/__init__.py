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


__all__ = ["BACKWARD", "BACKWARD_KINDS", "FORWARD", "GRADIENT_KINDS", "INPUT_GRAD", "SCHEDULES",
           "WEIGHT_GRAD", "Action", "Schedule", "build_schedule", "check_schedule", "dependencies",
           "zero_bubble_order"]
