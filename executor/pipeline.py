"""Running a Schedule for real in one process: one worker thread per device.

    pipe = Pipeline(model, plan, devices=["cpu", "cpu"], loss_fn=F.cross_entropy)
    result = pipe.run(inputs, targets, iterations=5, warmup=2)
    metrics(result.trace)            # the same function the simulator's traces go through

Each iteration: gradients are cleared, every worker thread runs its device's action list
(:class:`executor.stage.StageRunner`), and their timings become one measured
:class:`pipesim.trace.Trace`.  The worker threads live as long as the Pipeline
(:mod:`executor.workers`; ``close()``, a ``with`` block or garbage collection ends them).
A worker that fails stops the others (they are blocked at most one wait slice) and the
error names its worker, stage and action; a step that outlives ``timeout_s`` ends with a
``TimeoutError`` naming the workers still running.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from torch import nn

from executor.batchnorm import commit_deferred_batch_norm
from executor.cuda_peaks import CUDA_PEAK_COUNTS, cuda_peaks, plan_bytes, reset_cuda_peaks
from executor.host_allocator import retain_freed_memory
from executor.memtrack import (
    Timeline,
    Tracker,
    classifier,
    granularity_of,
    held_tensors,
    warm_up,
)
from executor.microbatch import scatter
from executor.partition import split_module
from executor.recorder import Recorder, compute_actions, compute_spans, shift_rows
from executor.skip import check_skips
from executor.stage import ActionFailed, StageRunner
from executor.transport import PipelineAborted, ThreadTransport
from executor.workers import WorkerPool
from pipesim.errors import PlanError
from pipesim.plan import Plan
from pipesim.schedule import Schedule, build_schedule
from pipesim.trace import (
    CATEGORY_COLUMNS,
    MEASURED_COLUMNS,
    MEMORY_COLUMNS,
    Trace,
    frame_from_rows,
)

#: the memory source and what it counts, for a measured trace's metadata
TRACKED = "executor.memtrack (every tensor torch allocates; one extra, tracked iteration)"
TRACKED_COUNTS = ("every storage alive on the worker: parameters, gradients, saved and received "
                  "tensors, temporaries and recomputation; not the batch, not allocator caching")


def timeline_frame(timeline: Timeline, origin: float, iteration: int = 0) -> pd.DataFrame:
    """A tracker's timeline as a Trace memory frame (times from ``origin``, seconds)."""
    rows = [(iteration, device, t - origin, level) for t, device, level in timeline.rows]
    return frame_from_rows(rows, MEMORY_COLUMNS)


def category_frame(timeline: Timeline, origin: float, classify, iteration: int = 0
                   ) -> pd.DataFrame:
    """The timeline by category (:func:`executor.memtrack.classifier`) as a Trace's
    ``memory_by_category`` frame (times from ``origin``, seconds)."""
    rows = [(iteration, device, category, t - origin, level)
            for t, device, category, level in timeline.by_category(classify)]
    return frame_from_rows(rows, CATEGORY_COLUMNS)


@dataclass
class RunResult:
    """A measured run: the Trace of the measured iterations and each one's loss."""

    trace: Trace
    losses: list[float] = field(default_factory=list)

    @property
    def loss(self) -> float:
        return self.losses[-1]


def measured_meta(plan: Plan, schedule: Schedule, transport: str, devices: dict,
                  iterations: int, warmup: int, losses: list[float], peaks: dict | None,
                  memory_source: str, **extra) -> dict:
    """The metadata of a measured Trace (both transports)."""
    meta = {"source": "measured", "transport": transport, "batch_size": plan.batch_size,
            "plan": plan.to_dict(), "schedule": schedule.name, "devices": devices,
            "iterations": iterations, "warmup": warmup, **extra, "torch": torch.__version__,
            "host_allocator": retain_freed_memory(),
            "median_loss": statistics.median(losses) if losses else None}
    if peaks:
        meta["peak_memory"] = peaks
        meta["memory_source"] = memory_source
    return meta


def stage_skips(module: nn.Sequential, plan: Plan, schedule: Schedule | None = None
                ) -> tuple[tuple[str, int, int], ...]:
    """Skips that cross stages: ``(name, stashing stage, popping stage)``; checks them all,
    and refuses them under a ``schedule`` that splits the backward (not supported yet)."""
    stage_of = {layer: s for s in range(plan.n_stages) for layer in plan.stage_layers(s)}
    skips = tuple((r.name, stage_of[r.src], stage_of[r.dst]) for r in check_skips(module)
                  if stage_of[r.src] != stage_of[r.dst])
    if skips and schedule is not None and schedule.splits_backward:
        raise PlanError(f"schedule {schedule.name!r} splits the backward, and skip connections "
                        f"cross stages ({', '.join(n for n, *_ in skips)}): not supported yet; "
                        "use a schedule with a full backward or keep each skip in one stage")
    return skips


def check_inputs(module: nn.Module, plan: Plan, schedule: Schedule, batch: int) -> None:
    """Refuse, before anything starts, a schedule that does not fit the model or batch."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"pipelines need an nn.Sequential, got {type(module).__name__}")
    plan.check_layers(len(module))
    if schedule.n_stages != plan.n_stages:
        raise PlanError(f"schedule has {schedule.n_stages} stages but the plan has {plan.n_stages}")
    if schedule.n_microbatches != plan.n_microbatches:
        raise PlanError(f"schedule has {schedule.n_microbatches} micro-batches but the batch of "
                        f"{plan.batch_size} in {plan.chunks} chunks makes {plan.n_microbatches}")
    if batch != plan.batch_size:
        raise PlanError(f"batch has {batch} samples but the plan's batch size is {plan.batch_size}")


class Pipeline:
    """One process, one worker thread per device, running ``schedule`` on ``module``."""

    def __init__(self, module: nn.Sequential, plan: Plan,
                 devices: Sequence[str | torch.device] | None = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 schedule: Schedule | None = None, timeout_s: float = 300.0,
                 track_memory: bool = True):
        retain_freed_memory()  # the policy the profile was taken under (host_allocator)
        self.plan = plan
        self.track_memory = track_memory
        self.schedule = schedule or build_schedule(plan)
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"pipelines need an nn.Sequential, got {type(module).__name__}")
        plan.check_layers(len(module))
        devs = [torch.device(d) for d in (devices or ["cpu"] * self.schedule.n_devices)]
        if len(devs) < self.schedule.n_devices:
            raise IndexError(f"{self.schedule.n_devices} devices needed, {len(devs)} given")
        self.devices: list[torch.device] = devs[: self.schedule.n_devices]
        self.module = module
        self.loss_fn = loss_fn or nn.functional.cross_entropy
        self.stages = split_module(module, plan.balance)
        for s, stage in enumerate(self.stages):
            stage.to(self.devices[self.schedule.placement[s]])
        self.timeout_s = timeout_s
        self.rng_lock = threading.Lock()
        self.skips = stage_skips(module, plan, self.schedule)
        self._streams: dict[int, torch.cuda.Stream] = {}  # one compute stream per CUDA worker
        self.last_transport: ThreadTransport | None = None
        self._workers: WorkerPool | None = None  # started by the first step

    @property
    def worker_threads(self) -> list[threading.Thread]:
        """The worker threads (the same objects for every step); empty before the first."""
        return list(self._workers.threads) if self._workers is not None else []

    def close(self) -> None:
        """Stop the worker threads; the Pipeline can still step (new threads then)."""
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _stream(self, worker: int) -> torch.cuda.Stream:
        if worker not in self._streams:
            self._streams[worker] = torch.cuda.Stream(self.devices[worker])
        return self._streams[worker]

    def _stages_of(self, worker: int) -> dict[int, nn.Module]:
        return {s: self.stages[s] for s in range(self.plan.n_stages)
                if self.schedule.placement[s] == worker}

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *, iteration: int = 0,
             fail_at: tuple[int, str] | None = None, timeline: Timeline | None = None,
             origin: float | None = None) -> tuple[list[tuple], float, dict[str, int]]:
        """One iteration (gradients accumulate into ``.grad``; clear them yourself).

        Returns the trace rows, the batch's mean loss, and peak bytes per CUDA device
        (:mod:`executor.cuda_peaks`).  With a ``timeline``, every tensor each worker
        allocates is counted there under ``dev{worker}`` (:mod:`executor.memtrack`; ops
        run slower under it).  ``fail_at=(worker, "1F0")`` injects a failure (for tests).
        """
        check_inputs(self.module, self.plan, self.schedule, inputs.shape[0])
        first, last = self.devices[self.schedule.placement[0]], self.devices[
            self.schedule.placement[-1]]
        xs = scatter(inputs.to(first), self.plan)
        ys = scatter(targets.to(last), self.plan)
        transport = ThreadTransport(self.devices, self.schedule.placement, self.timeout_s)
        cuda = [d for d in self.devices if d.type == "cuda"]
        own = plan_bytes({d: [self.stages[s] for s in range(self.plan.n_stages)
                              if self.devices[self.schedule.placement[s]] == d] for d in set(cuda)})
        base = reset_cuda_peaks(self.devices)
        origin = time.perf_counter() if origin is None else origin  # rows count from it
        recorders = []
        for w, dev in enumerate(self.devices):
            rec = Recorder(w, dev, origin=origin)
            if dev.type == "cuda":
                rec.origin_event = torch.cuda.Event(enable_timing=True)
                rec.origin_event.record(torch.cuda.current_stream(dev))
            recorders.append(rec)
        runners = [StageRunner(w, self._stages_of(w), self.plan, self.loss_fn, dev, transport,
                               recorders[w], self.rng_lock,
                               fail_at=fail_at[1] if fail_at and fail_at[0] == w else None,
                               skips=self.skips)
                   for w, dev in enumerate(self.devices)]
        if timeline is not None:
            for w in range(len(self.devices)):
                timeline.add_existing(f"dev{w}", held_tensors(self._stages_of(w).values()))
        errors: list[BaseException] = []

        def work(w: int) -> None:
            dev = self.devices[w]
            try:
                ctx = (torch.cuda.stream(self._stream(w)) if dev.type == "cuda"
                       else contextlib.nullcontext())
                tracking = (Tracker(timeline, f"dev{w}") if timeline is not None
                            else contextlib.nullcontext())
                with ctx, tracking:
                    origin_event = recorders[w].origin_event
                    if origin_event is not None:
                        torch.cuda.current_stream(dev).wait_event(origin_event)
                    runners[w].run(self.schedule.order[w], xs, ys)
            except PipelineAborted:
                pass
            except BaseException as exc:
                errors.append(exc)
                transport.abort(exc)

        if self._workers is None:
            self._workers = WorkerPool([f"pipesim-worker-{w}" for w in range(len(self.devices))])
        done = [self._workers.submit(w, functools.partial(work, w)) for w in range(len(self.devices))]
        # Bounded: transport waits time out after timeout_s, so a step that has not ended
        # well after that has a worker stuck outside the transport (in a kernel, a hook).
        deadline = time.monotonic() + self.timeout_s + 30.0
        for w, d in enumerate(done):
            if not d.wait(max(deadline - time.monotonic(), 0.0)):
                transport.abort(TimeoutError(f"worker {w} still running"))
                stuck = [i for i, x in enumerate(done) if not x.wait(0)]
                raise TimeoutError(f"pipeline step did not end within {self.timeout_s + 30:.0f} s: "
                                   f"workers {stuck} still running")
        if errors:
            first_error = errors[0]
            if isinstance(first_error, ActionFailed):
                raise ActionFailed(str(first_error)) from first_error.__cause__
            raise first_error
        transport.finish_iteration()
        self.last_transport = transport
        commit_deferred_batch_norm(self.module)
        rows = [row for rec in recorders for row in rec.rows(iteration)]
        loss = sum(runners[self.schedule.placement[-1]].losses.values())
        return rows, loss, cuda_peaks(self.devices, base, own)

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, *, iterations: int = 5,
            warmup: int = 2, memory_snapshot: str | Path | None = None) -> RunResult:
        """``warmup`` unrecorded iterations, then ``iterations`` measured ones.

        Gradients are cleared (set to None) before every iteration, so after the call
        ``.grad`` holds the last iteration's gradients.  Times in the Trace are seconds
        from the first measured iteration's origin, iterations laid end to end.  With
        ``track_memory``, one more iteration runs under the memory tracker: its timeline
        (every tensor, per worker) becomes the Trace's memory, its peaks the CPU peaks;
        the timed iterations run untracked (tracking slows every op).  On CUDA,
        ``memory_snapshot`` also records the caching allocator's history during that
        iteration and saves it there (a pickle that https://pytorch.org/memory_viz opens),
        and the trace meta gets the allocator's reserved peak beside the allocated one.
        """
        on_cuda = any(d.type == "cuda" for d in self.devices)
        if memory_snapshot is not None and not (on_cuda and self.track_memory):
            raise ValueError("a memory snapshot is the CUDA allocator's: it needs CUDA devices "
                             "and track_memory=True")
        rows: list[tuple] = []
        losses: list[float] = []
        peaks: dict[str, int] = {}
        offset = 0.0
        for i in range(warmup + iterations):
            self.module.zero_grad(set_to_none=True)
            it_rows, loss, it_peaks = self.step(inputs, targets, iteration=i - warmup)
            if i < warmup:
                continue
            span = max(r[6] for r in it_rows)
            rows += shift_rows(it_rows, offset)
            offset += span
            losses.append(loss)
            for d, p in it_peaks.items():
                peaks[d] = max(peaks.get(d, 0), p)
        actions = frame_from_rows(rows, MEASURED_COLUMNS)
        memory = by_category = None
        extra: dict = {}
        if self.track_memory:
            self.module.zero_grad(set_to_none=True)
            warm_up(self.devices[0])
            timeline = Timeline(granularity_of(self.devices[0]))
            if memory_snapshot is not None:
                torch.cuda.memory._record_memory_history(max_entries=200_000)
            origin = time.perf_counter()
            tracked, _, _ = self.step(inputs, targets, iteration=0, timeline=timeline,
                                      origin=origin)
            memory = timeline_frame(timeline, origin)
            # the tracked step's actions per worker (seconds from its origin), which the
            # memory timeline's shape is read against (pipesim.compare.memory_shape)
            extra["memory_actions"] = {f"dev{w}": [list(a) for a in acts]
                                       for w, acts in sorted(compute_actions(tracked).items())}
            spans = {f"dev{w}": s for w, s in compute_spans(tracked, origin).items()}
            by_category = category_frame(timeline, origin, classifier(self.stages, spans))
            timeline.forget()
            if memory_snapshot is not None:
                Path(memory_snapshot).parent.mkdir(parents=True, exist_ok=True)
                torch.cuda.memory._dump_snapshot(str(memory_snapshot))
                torch.cuda.memory._record_memory_history(enabled=None)
                extra["memory_snapshot"] = str(memory_snapshot)
            if not on_cuda:
                peaks = {d: int(v) for d, v in timeline.peak.items()}
        if on_cuda:
            extra["peak_reserved"] = {str(d): int(torch.cuda.max_memory_reserved(d))
                                      for d in set(self.devices) if d.type == "cuda"}
        meta = measured_meta(self.plan, self.schedule, "threads",
                             {w: str(d) for w, d in enumerate(self.devices)}, iterations, warmup,
                             losses, peaks, "torch.cuda.max_memory_allocated" if on_cuda
                             else TRACKED, memory_counted=CUDA_PEAK_COUNTS if on_cuda else
                             TRACKED_COUNTS, **extra)
        return RunResult(Trace(actions, memory if memory is not None else
                               frame_from_rows([], MEMORY_COLUMNS), meta, by_category), losses)
