"""One stage's action list run alone, its neighbours' tensors synthesised.

To measure a stage's memory without the rest of the pipeline (and without the devices
the other stages would need), a :class:`SynthTransport` stands in for every other stage:
a receive returns a fresh random tensor of the shape and dtype that stage would have
sent, a send is dropped.  Shapes come from one unpipelined forward per micro-batch
(:func:`message_shapes`).  The stage runs its actions in schedule order on its device:

    peak = run_stage_alone(module, plan, stage=1, inputs=x, targets=y, device="cuda:0")
    peak["allocated"], peak["reserved"]      # CUDA allocator peaks (bytes); "tracked" on CPU
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from executor.memtrack import Storage, Timeline, Tracker, held_tensors
from executor.microbatch import scatter
from executor.partition import split_module
from executor.pipeline import stage_skips
from executor.recorder import Recorder
from executor.skip import SkipTracker, use_tracker
from executor.stage import StageRunner
from executor.transport import Transport
from pipesim.plan import Plan
from pipesim.schedule import Schedule, build_schedule

Shape = tuple[tuple[int, ...], torch.dtype]


@torch.no_grad()
def message_shapes(module: nn.Sequential, plan: Plan,
                   inputs: torch.Tensor) -> dict[tuple[int, str, int], Shape]:
    """Shape and dtype of every message a stage receives: ``(stage, kind, mb) -> ...``.

    Kinds as the transports use them: ``F`` input, ``B`` gradient of the output, ``S:x`` a
    skip, ``SB:x`` a skip's gradient.
    """
    stages = split_module(module, plan.balance)
    skips = stage_skips(module, plan)
    shapes: dict[tuple[int, str, int], Shape] = {}
    # the batch goes where the model is (token ids included: an embedding on CUDA
    # refuses CPU indices)
    first = next(module.parameters(), None)
    if first is not None:
        inputs = inputs.to(first.device)
    for m, x in enumerate(scatter(inputs, plan)):
        with use_tracker(SkipTracker(retain=True)) as tracker:
            for s, stage in enumerate(stages):
                if s > 0:
                    shapes[(s, "F", m)] = (tuple(x.shape), x.dtype)
                x = stage(x)
                if s < plan.n_stages - 1:
                    shapes[(s, "B", m)] = (tuple(x.shape), x.dtype)
        for name, a, b in skips:
            t = tracker.stashed[name]
            shapes[(b, f"S:{name}", m)] = shapes[(a, f"SB:{name}", m)] = (tuple(t.shape), t.dtype)
    return shapes


class SynthTransport(Transport):
    """Receives synthesised tensors of the recorded shapes; drops what is sent.  A
    prefetched message is made when prefetched, as the process transport posts its
    receive buffer then (:meth:`executor.transport.DistTransport.prefetch`)."""

    def __init__(self, shapes: dict[tuple[int, str, int], Shape], device: torch.device):
        self.shapes, self.device = shapes, device
        self._early: dict[tuple[int, str, int], torch.Tensor] = {}

    def prefetch(self, stage: int, kind: str, mb: int, src_stage: int | None = None) -> None:
        self._early[(stage, kind, mb)] = self._make(stage, kind, mb)

    def send(self, tensor: torch.Tensor, dst_stage: int, kind: str, mb: int,
             src_stage: int | None = None) -> None:
        del tensor, dst_stage, kind, mb, src_stage

    def recv(self, stage: int, kind: str, mb: int, src_stage: int | None = None) -> torch.Tensor:
        del src_stage
        early = self._early.pop((stage, kind, mb), None)
        return early if early is not None else self._make(stage, kind, mb)

    def _make(self, stage: int, kind: str, mb: int) -> torch.Tensor:
        shape, dtype = self.shapes[(stage, kind, mb)]
        if dtype.is_floating_point:
            return torch.randn(shape, dtype=dtype, device=self.device)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def finish_iteration(self) -> None:
        self._early.clear()


def run_stage_alone(module: nn.Sequential, plan: Plan, stage: int, inputs: torch.Tensor,
                    targets: torch.Tensor, *, device: str | torch.device = "cpu",
                    loss_fn: Callable | None = None, schedule: Schedule | None = None,
                    iterations: int = 2, keep: list[list[Storage]] | None = None) -> dict[str, int]:
    """Peak bytes of ``stage`` run alone: ``allocated``/``reserved`` (CUDA allocator) or
    ``tracked`` (CPU: every tensor, :mod:`executor.memtrack`, parameters included).

    The stage's actions keep the order its device has in ``schedule``; the last iteration
    is measured after the first warms the allocator up.  With ``keep`` (CPU), the last
    iteration's storages are appended to it, each labelled with the operator that made it
    (:meth:`executor.memtrack.Timeline.storages`).
    """
    schedule = schedule or build_schedule(plan)
    device = torch.device(device)
    shapes = message_shapes(module, plan, inputs)
    part = split_module(module, plan.balance)[stage]
    # the stage's layers are the caller's: they go back where they were afterwards, so the
    # next stage's shape pass finds the whole model on one device again
    home = next((p.device for p in part.parameters()), device)
    part.to(device)
    try:
        return _measure_alone(module, plan, stage, part, schedule, shapes, inputs, targets,
                              device, loss_fn, iterations, keep)
    finally:
        part.zero_grad(set_to_none=True)
        part.to(home)


def _measure_alone(module: nn.Sequential, plan: Plan, stage: int, part: nn.Sequential,
                   schedule: Schedule, shapes: dict[tuple[int, str, int], Shape],
                   inputs: torch.Tensor, targets: torch.Tensor, device: torch.device,
                   loss_fn: Callable | None, iterations: int,
                   keep: list[list[Storage]] | None = None) -> dict[str, int]:
    actions = tuple(a for a in schedule.order[schedule.placement[stage]] if a.stage == stage)
    xs = scatter(inputs.to(device), plan)
    ys = scatter(targets.to(device), plan)
    peaks: dict[str, int] = {}
    for i in range(iterations):
        part.zero_grad(set_to_none=True)
        timeline = Timeline()
        timeline.add_existing("stage", held_tensors([part]))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        runner = StageRunner(0, {stage: part}, plan, loss_fn or nn.functional.cross_entropy,
                             device, SynthTransport(shapes, device), Recorder(0, device),
                             skips=stage_skips(module, plan))
        if device.type == "cuda":
            runner.recorder.origin_event = torch.cuda.Event(enable_timing=True)
            runner.recorder.origin_event.record()
        if device.type == "cuda":
            runner.run(actions, xs, ys)
            torch.cuda.synchronize(device)
            peaks = {"allocated": int(torch.cuda.max_memory_allocated(device)),
                     "reserved": int(torch.cuda.max_memory_reserved(device))}
        else:
            with Tracker(timeline, "stage", label=keep is not None):
                runner.run(actions, xs, ys)
            peaks = {"tracked": timeline.peak["stage"]}
        if keep is not None and device.type != "cuda" and i == iterations - 1:
            keep.append(timeline.storages())
        timeline.forget()
    return peaks
