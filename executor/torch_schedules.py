"""torch.distributed.pipelining's schedule classes as pipesim Schedules.

torch builds a multi-stage schedule's per-rank action order (``pipeline_order``) when
the schedule is constructed; here it is constructed on stand-in stages (the order needs
only their indices and the group's size), and the order is read into a
:class:`pipesim.schedule.Schedule` -- checked for completeness and deadlock like any
other -- so that pipesim simulates, tunes and executes what torch users run:

    schedule = from_torch("Interleaved1F1B", n_ranks=2, stages_per_rank=2, n_microbatches=4)
    simulate(profile, plan, cluster, schedule=schedule)
    Pipeline(module, plan, schedule=schedule)      # plan: 4 stages, placement s % 2

Single-stage schedules are read the same way; where torch's own order is not a valid
schedule (torch 2.13's ``Schedule1F1B.pipeline_order`` lists ``1F4`` and omits ``1F0`` on
rank 1 of 2 for 4 micro-batches) pipesim's twin of the same name is used.  Schedules that
split the backward into input and weight gradients (zero-bubble, DualPipeV) need actions
pipesim does not model yet and are refused by name.  The other way round,
:meth:`pipesim.schedule.Schedule.to_csv` writes torch's CSV layout.
"""

from __future__ import annotations

from types import SimpleNamespace

from pipesim.errors import ScheduleError
from pipesim.plan import Plan
from pipesim.schedule import BACKWARD, FORWARD, Action, Schedule, build_schedule

#: torch's single-stage schedules and pipesim's schedule of the same order
_NATIVE = {"GPipe": "gpipe", "1F1B": "1f1b"}


def from_torch(name: str, n_ranks: int, n_microbatches: int, stages_per_rank: int = 1,
               batch_size: int | None = None) -> Schedule:
    """The per-rank order of torch's schedule ``name`` (``"Interleaved1F1B"``,
    ``"LoopedBFS"``, ``"GPipe"``, ``"1F1B"``, ...), stage ``s`` on rank ``s % n_ranks``."""
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        _ComputationType,
        get_schedule_class,
    )

    key = name.removeprefix("Schedule")
    try:
        cls = get_schedule_class(key)
    except ValueError as exc:
        raise ScheduleError(f"torch has no schedule {name!r} ({exc})") from None
    multi = issubclass(cls, PipelineScheduleMulti)
    if not multi and stages_per_rank != 1:
        raise ScheduleError(f"{name} runs one stage a rank, not {stages_per_rank}")
    n_stages = n_ranks * stages_per_rank
    stages = [SimpleNamespace(stage_index=s, num_stages=n_stages, group_size=n_ranks,
                              group_rank=0, is_first=s == 0, is_last=s == n_stages - 1,
                              stage_index_to_group_rank=None)
              for s in range(0, n_stages, n_ranks)]
    try:
        torch_schedule = cls(stages if multi else stages[0], n_microbatches=n_microbatches)
    except AttributeError as exc:
        raise ScheduleError(f"{name} needs what pipesim's stand-in stages lack ({exc}): "
                            "schedules that split the backward (input and weight gradients) "
                            "are not modelled yet") from None
    kinds = {_ComputationType.FORWARD: FORWARD, _ComputationType.FULL_BACKWARD: BACKWARD}
    order: list[list[Action]] = []
    for rank in range(n_ranks):
        actions = []
        for a in torch_schedule.pipeline_order.get(rank, []):
            if a is None:
                continue  # an idle step
            if a.computation_type in kinds:
                actions.append(Action(a.stage_index, kinds[a.computation_type],
                                      int(a.microbatch_index)))
            elif a.computation_type.name in ("BACKWARD_INPUT", "BACKWARD_WEIGHT"):
                raise ScheduleError(f"{name} splits the backward ({a}): not modelled yet")
        order.append(actions)
    try:
        return Schedule.from_order(order, name=f"torch:{key}", source=f"torch {name}")
    except ScheduleError:
        if multi or key not in _NATIVE:
            raise
        plan = Plan([1] * n_ranks, n_microbatches, batch_size or n_microbatches,
                    schedule=_NATIVE[key])
        return build_schedule(plan)
