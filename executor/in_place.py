"""Host contention measured in place: each rank runs its own stage, in the run's layout.

``executor.calibrate.host_contention`` measures how much ranks slow each other on one
generic workload (a small MLP) and the simulator applies that one figure to every action.
How much two ranks slow each other depends on *what* they run -- cache footprint, memory
traffic, kernel sizes -- so :func:`stage_contention` measures it on the stages themselves:

* one process per rank, pinned as the run pins them (:func:`executor.distributed.spawn`),
  each building the model and keeping its own stage (``split_module(module, balance)``);
* a step is that stage's forward and backward on one micro-batch, run through the
  executor's own :class:`executor.stage.StageRunner`, its neighbours' tensors synthesised
  (:class:`executor.stage_alone.SynthTransport`): the code path of a pipeline's actions;
* rounds of phases, each ``phase_s`` seconds of steps: every rank alone in turn (the
  others wait at a barrier), then all of them at once::

      rank 0   |alone: s s s s|              |together: s s s s|
      rank 1   |              |alone: S  S  S|together: S   S  S|
               ^barrier       ^barrier       ^barrier  (then the next size; rounds repeat)

  alone and together within a second of each other, so a shared machine's slow spells
  weigh on both alike;
* per stage and micro-batch size: ``slowdown = mean(together) / mean(alone)`` (at
  least 1), as :class:`pipesim.cluster.SpanSlowdown` rows for the simulator.

No plan is run (no schedule, no messages between the ranks): the measurement is of the
layout -- which layers share the host at which size -- so every schedule, chunk count and
checkpoint mode with that balance uses it, and nothing is fitted to the plans validated.

What it found on this project's 2-core VM (2026-11-24,
``experiments/in_place_contention.py``): in a quiet hour, medians of three repeats GPT
1.00-1.08, U-Net 1.00-1.07, MLP 1.00-1.18 (one reading up to 1.13, 1.09, 1.30; repeats
0.03 apart, median); the balanced layouts 1.26-1.53 half an hour before, during a grid.
The grid's own overlapping actions ran at 0.93-1.06 of their profile, and as the
simulator's host law it predicted worse than the generic figure (README, "Largest
remaining errors"): ``experiments/validate.py`` keeps it as an ablation, not the prediction.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.multiprocessing as mp

from executor.calibrate import _gather
from executor.host_allocator import retain_freed_memory
from pipesim.cluster import SpanSlowdown
from pipesim.plan import Plan


def _stage_step(job: Callable, balance: Sequence[int], rank: int, size: int,
                checkpoint: str = "never") -> Callable[[], dict[str, float]]:
    """One forward+backward of stage ``rank`` on ``size`` samples, as a pipeline runs it
    (the executor's StageRunner, its inputs and output gradients synthesised; the forward
    inside torch.utils.checkpoint with ``checkpoint="always"``).  The step returns the
    seconds of its actions as the pipeline's recorder times them: ``{"F": .., "B": ..}``."""
    from executor.microbatch import scatter
    from executor.partition import split_module
    from executor.pipeline import stage_skips
    from executor.recorder import Recorder
    from executor.stage import StageRunner
    from executor.stage_alone import SynthTransport, message_shapes
    from pipesim.schedule import build_schedule

    module, loss_fn, x, y = job()
    if x.shape[0] < size:
        raise ValueError(f"the job's batch has {x.shape[0]} samples, the step needs {size}")
    plan = Plan(list(balance), 1, size, checkpoint=checkpoint)
    shapes = message_shapes(module, plan, x[:size])
    stage = split_module(module, plan.balance)[rank]
    skips = stage_skips(module, plan)
    actions = build_schedule(plan).order[rank]
    xs, ys = scatter(x[:size].clone(), plan), scatter(y[:size].clone(), plan)
    device = torch.device("cpu")

    def step() -> dict[str, float]:
        recorder = Recorder(rank, device)
        runner = StageRunner(rank, {rank: stage}, plan, loss_fn, device,
                             SynthTransport(shapes, device), recorder, skips=skips)
        runner.run(actions, xs, ys)
        # rows: (iteration, device, stage, mb, kind, start, end, ...)
        return {r[4]: r[6] - r[5] for r in recorder.rows(0) if r[4] in ("F", "B")}

    return step


def _in_place_loop(rank: int, barrier, job: Callable, balance: Sequence[int],
                   sizes: Sequence[int], rounds: int, phase_s: float, threads: int,
                   out) -> None:
    """Rank ``rank``'s side of :func:`stage_contention`: puts ``(rank, {size: (alone
    seconds, together seconds)})``, the means of its steps (a pipeline's iteration adds
    up its actions, slow ones included: their mean is what it pays)."""
    torch.set_num_threads(threads)
    retain_freed_memory()  # the pipelines' allocator policy
    world = len(balance)
    steps = {b: _stage_step(job, balance, rank, b) for b in sizes}
    for step in steps.values():  # warm-up: allocator, caches, autograd's first graphs
        for _ in range(3):
            step()
    alone: dict[int, list[float]] = {b: [] for b in sizes}
    together: dict[int, list[float]] = {b: [] for b in sizes}
    for _ in range(rounds):
        for b in sizes:
            for phase in range(world + 1):  # phase r < world: rank r alone; world: all
                barrier.wait()
                if phase not in (rank, world):
                    continue
                times = together[b] if phase == world else alone[b]
                end = time.perf_counter() + phase_s
                while True:  # at least one step, then until the phase's time is up
                    t0 = time.perf_counter()
                    steps[b]()
                    t1 = time.perf_counter()
                    times.append(t1 - t0)
                    if t1 >= end:
                        break
    out.put((rank, {b: (statistics.fmean(alone[b]), statistics.fmean(together[b]))
                    for b in sizes}))


def _check_layout(what: str, job: Callable, balance: Sequence[int], sizes: Sequence[int],
                  rounds: int, phase_s: float) -> None:
    """Raise ValueError, in the caller's process, for a layout the ranks cannot run (a
    rank's error would only say it died)."""
    if len(balance) < 2:
        raise ValueError(f"{what} needs at least 2 stages, got balance {list(balance)}")
    if rounds < 1 or phase_s <= 0:
        raise ValueError(f"rounds must be >= 1 and phase_s > 0, got {rounds} and {phase_s}")
    module, _, inputs, _ = job()
    if sum(balance) != len(module):
        raise ValueError(f"balance {list(balance)} sums to {sum(balance)} layers, the model "
                         f"has {len(module)}")
    if max(sizes) > inputs.shape[0]:
        raise ValueError(f"micro-batch size {max(sizes)} exceeds the job's batch of "
                         f"{inputs.shape[0]} samples")


def stage_contention(job: Callable, balance: Sequence[int], sizes: Sequence[int], *,
                     rounds: int = 20, phase_s: float = 0.02, threads: int = 1,
                     pin_cores: bool = True) -> list[SpanSlowdown]:
    """Each stage's slowdown beside the other ranks, per micro-batch size (see the module
    doc): one :class:`pipesim.cluster.SpanSlowdown` per stage and size.

    ``job`` gives ``(module, loss_fn, inputs, targets)`` with at least ``max(sizes)``
    samples (picklable: a ``functools.partial`` of :func:`executor.models.builtin_job`);
    ``balance`` the layers of each stage, one process each (``threads`` torch threads,
    each on its own cores with ``pin_cores``, as the runs are placed).  Seconds spent:
    about ``rounds * len(sizes) * (len(balance) + 1) * phase_s`` plus start-up.
    """
    _check_layout("contention", job, balance, sizes, rounds, phase_s)
    world = len(balance)
    barrier = mp.get_context("spawn").Barrier(world)
    results = dict(_gather(_in_place_loop, world,
                           (barrier, job, list(balance), list(sizes), rounds, phase_s, threads),
                           expected=world, pin_cores=pin_cores))
    out = []
    first = 0
    for rank, layers in enumerate(balance):
        for b in sizes:
            alone, together = results[rank][b]
            out.append(SpanSlowdown(first, first + layers, int(b),
                                    max(together / alone, 1.0) if alone > 0 else 1.0))
        first += layers
    return out


def _costs_loop(rank: int, barrier, job: Callable, balance: Sequence[int],
                sizes: Sequence[int], modes: Sequence[str], rounds: int, phase_s: float,
                threads: int, out) -> None:
    """Rank ``rank``'s side of :func:`stage_costs`: puts ``(rank, {(mode, size): (forward
    seconds, backward seconds)})``, the medians of its steps run alone."""
    torch.set_num_threads(threads)
    retain_freed_memory()  # the pipelines' allocator policy
    steps = {(mode, b): _stage_step(job, balance, rank, b, mode) for mode in modes for b in sizes}
    for step in steps.values():  # warm-up: allocator, caches, autograd's first graphs
        for _ in range(3):
            step()
    times: dict[tuple[str, int], dict[str, list[float]]] = {
        key: {"F": [], "B": []} for key in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            for turn in range(len(balance)):  # one rank at a time, the others waiting
                barrier.wait()
                if turn != rank:
                    continue
                end = time.perf_counter() + phase_s
                while True:  # at least one step, then until the phase's time is up
                    for kind, seconds in step().items():
                        times[key][kind].append(seconds)
                    if time.perf_counter() >= end:
                        break
    out.put((rank, {key: (statistics.median(t["F"]), statistics.median(t["B"]))
                    for key, t in times.items()}))


def stage_costs(job: Callable, balance: Sequence[int], sizes: Sequence[int], *,
                modes: Sequence[str] = ("never", "always"), rounds: int = 10,
                phase_s: float = 0.02, threads: int = 1,
                pin_cores: bool = True) -> list[dict]:
    """What each stage's actions cost in the run's own code path and layout: per stage,
    micro-batch size and checkpoint mode (``"never"``, ``"always"``: the forward inside
    torch.utils.checkpoint, the backward recomputing), the median seconds of its forward
    and backward as the pipeline's recorder times them, the stage alone on its rank's
    cores (the other ranks waiting at a barrier, so no contention is in them).

    The same processes and steps as :func:`stage_contention` (``job``, ``balance``,
    ``threads``, ``pin_cores`` alike); rows ``{"first", "stop", "micro_batch",
    "checkpointed", "fwd_s", "bwd_s"}``.  What a profile adds up layer by layer, measured
    on the stage whole: the executor's per-action work, the stage's own cache footprint,
    torch.utils.checkpoint entered once.  Seconds spent: about ``rounds * len(modes) *
    len(sizes) * len(balance) * phase_s`` plus start-up.
    """
    unknown = sorted(set(modes) - {"never", "always"})
    if unknown:
        raise ValueError(f"checkpoint modes must be 'never' or 'always', got {unknown}")
    _check_layout("stage costs", job, balance, sizes, rounds, phase_s)
    world = len(balance)
    barrier = mp.get_context("spawn").Barrier(world)
    results = dict(_gather(_costs_loop, world,
                           (barrier, job, list(balance), list(sizes), list(modes), rounds,
                            phase_s, threads),
                           expected=world, pin_cores=pin_cores))
    out = []
    first = 0
    for rank, layers in enumerate(balance):
        for (mode, b), (fwd, bwd) in sorted(results[rank].items()):
            out.append({"first": first, "stop": first + layers, "micro_batch": int(b),
                        "checkpointed": mode == "always", "fwd_s": fwd, "bwd_s": bwd})
        first += layers
    return out


__all__ = ["stage_contention", "stage_costs"]
