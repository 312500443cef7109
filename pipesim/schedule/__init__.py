"""Schedules: per-device action lists built from a Plan, checked before anything runs."""

from __future__ import annotations

from collections.abc import Callable

from pipesim.errors import PlanError
from pipesim.plan import Plan
from pipesim.schedule.action import BACKWARD, FORWARD, Action, Schedule
from pipesim.schedule.check import check_schedule, dependencies
from pipesim.schedule.gpipe import gpipe_order
from pipesim.schedule.interleaved import interleaved_order
from pipesim.schedule.one_f_one_b import one_f_one_b_order

#: schedule name -> function(plan) -> per-device action lists
SCHEDULES: dict[str, Callable[[Plan], list[list[Action]]]] = {
    "gpipe": gpipe_order,
    "1f1b": one_f_one_b_order,
    "interleaved": interleaved_order,
}


def build_schedule(plan: Plan) -> Schedule:
    """The Schedule ``plan`` names, for its stages, placement and micro-batch count."""
    if plan.schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {plan.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    order = SCHEDULES[plan.schedule](plan)
    return Schedule(plan.schedule, plan.n_stages, plan.n_microbatches, plan.stage_devices,
                    tuple(tuple(acts) for acts in order))


__all__ = ["BACKWARD", "FORWARD", "SCHEDULES", "Action", "Schedule", "build_schedule",
           "check_schedule", "dependencies"]
