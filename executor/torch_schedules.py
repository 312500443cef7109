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
split the backward (``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``) are read
with their ``I`` and ``W`` actions; the V-shaped ones place stage ``s`` as torch does
(rank ``s`` going down, ``2n - 1 - s`` coming back).  DualPipeV's ``OVERLAP_F_B`` (a
forward of one stage and a backward of another issued together, to hide communication)
becomes its two actions one after the other: pipesim does not model that overlap.  The
other way round, :meth:`pipesim.schedule.Schedule.to_csv` writes torch's CSV layout
(``1F0``, ``1I0``, ``1W0``, ``1B0``), which ``_PipelineScheduleRuntime`` loads.
"""

from __future__ import annotations

from types import SimpleNamespace

from pipesim.errors import ScheduleError
from pipesim.plan import Plan
from pipesim.schedule import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Schedule,
    build_schedule,
)

#: torch's single-stage schedules and pipesim's schedule of the same order
_NATIVE = {"GPipe": "gpipe", "1F1B": "1f1b"}
#: torch's schedules whose stages sit in a V (rank r holds stages r and 2n - 1 - r)
_V_STYLE = ("ZBVZeroBubble", "DualPipeV")
#: torch's actions that compute nothing pipesim models: communication (pipesim derives it
#: from the schedule) and data-parallel sharding and reduction (outside one pipeline)
_NOT_COMPUTE = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD")


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
    if key in _V_STYLE and stages_per_rank != 2:
        raise ScheduleError(f"torch's {name} refuses {n_ranks} ranks x {stages_per_rank} stages: "
                            "it places 2 stages a rank, in a V")
    # rank 0's stages (the order of every rank needs only their indices and the group)
    mine = ([0, n_stages - 1] if key in _V_STYLE else range(0, n_stages, n_ranks))
    stages = [SimpleNamespace(stage_index=s, num_stages=n_stages, group_size=n_ranks,
                              group_rank=0, is_first=s == 0, is_last=s == n_stages - 1,
                              stage_index_to_group_rank=None, submod=None)
              for s in mine]
    try:
        torch_schedule = cls(stages if multi else stages[0], n_microbatches=n_microbatches)
    except (AttributeError, ValueError, AssertionError) as exc:
        raise ScheduleError(f"torch's {name} refuses {n_ranks} ranks x {stages_per_rank} stages "
                            f"x {n_microbatches} micro-batches: {exc}") from None
    kinds = {_ComputationType.FORWARD: FORWARD, _ComputationType.FULL_BACKWARD: BACKWARD,
             _ComputationType.BACKWARD_INPUT: INPUT_GRAD,
             _ComputationType.BACKWARD_WEIGHT: WEIGHT_GRAD}
    order: list[list[Action]] = []
    for rank in range(n_ranks):
        actions = []
        for a in torch_schedule.pipeline_order.get(rank, []):
            if a is None:
                continue  # an idle step
            for part in a.sub_actions or (a,):  # OVERLAP_F_B: its two, in order
                if part.computation_type.name in _NOT_COMPUTE:
                    continue
                if part.computation_type not in kinds:
                    raise ScheduleError(f"{name}: action {part} is not a computation pipesim "
                                        "models")
                actions.append(Action(part.stage_index, kinds[part.computation_type],
                                      int(part.microbatch_index)))
        order.append(actions)
    try:
        return Schedule.from_order(order, name=f"torch:{key}", source=f"torch {name}")
    except ScheduleError:
        if multi or key not in _NATIVE:
            raise
        plan = Plan([1] * n_ranks, n_microbatches, batch_size or n_microbatches,
                    schedule=_NATIVE[key])
        return build_schedule(plan)


def to_torch_runtime(schedule: Schedule, stages: list, loss_fn=None, *, scale_grads: bool = True,
                     csv_dir: str | None = None):
    """torch's ``_PipelineScheduleRuntime`` running ``schedule`` on this rank's
    ``PipelineStage``s: the Schedule goes through torch's CSV (``Schedule.to_csv``, then
    ``_load_csv``, which adds the communication), with pipesim's stage placement.

    ``scale_grads`` as torch's (gradients divided by the micro-batch count: with a mean
    loss over equal micro-batches, the full batch's gradients).  ``csv_dir`` keeps the CSV
    (default: a temporary folder); each rank writes its own file.
    """
    import tempfile
    from pathlib import Path

    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    runtime = _PipelineScheduleRuntime(stages, n_microbatches=schedule.n_microbatches,
                                       loss_fn=loss_fn, scale_grads=scale_grads)
    mapping = dict(enumerate(schedule.placement))
    runtime.stage_index_to_group_rank = mapping
    for stage in stages:
        stage.stage_index_to_group_rank = mapping
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(csv_dir or tmp)
        path = folder / f"{schedule.name.replace(':', '_')}_rank{stages[0].group_rank}.csv"
        runtime._load_csv(str(schedule.to_csv(path)))
    return runtime
