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

      rank 0   |alone: w s s s|              |together: w s s s s x|
      rank 1   |              |alone: w S  S|together: w  S    S  |
               ^barrier       ^barrier       ^barrier  (then the next size; rounds repeat)

  alone and together within a second of each other, so a shared machine's slow spells
  weigh on both alike.  Each phase opens with an untimed step ``w``: a rank that waited
  at the barrier runs its next step cold (what a wait costs is the idle costs' to
  measure), and untimed the order of the phases would read as contention.  Together, a
  step counts only if it ended while every rank was still stepping (``x``, after the
  phase ended, does not), and the phase lasts until every rank has counted one: a stage
  whose step is longer than the others' has them beside it all through;
* per stage and micro-batch size: ``slowdown = mean(together) / mean(alone)`` (at
  least 1), as :class:`pipesim.readings.SpanSlowdown` rows for the simulator; by default
  the median of three such readings, each with its own ranks, one after the other.

No plan is run (no schedule, no messages between the ranks): the measurement is of the
layout -- which layers share the host at which size -- so every schedule, chunk count and
checkpoint mode with that balance uses it, and nothing is fitted to the plans validated.

What it found on this project's 2-core VM (2026-11-24,
``experiments/in_place_contention.py``): in a quiet hour, medians of three repeats GPT
1.00-1.08, U-Net 1.00-1.07, MLP 1.00-1.18 (one reading up to 1.13, 1.09, 1.30; repeats
0.03 apart, median); the balanced layouts 1.26-1.53 half an hour before, during a grid.
The grid's own overlapping actions ran at 0.93-1.06 of their profile, and *in place of*
the generic figure it predicted worse (``experiments/README.md``, "Largest remaining
errors"): the generic figure holds what a neighbour that computes and exchanges messages
costs, which this measurement (no message) does not.  What this one holds and the generic
one does not is the neighbour's memory traffic: MLP [4,4]'s first stage ran 1.13-1.20x
beside a neighbour streaming 8 MiB, 0.98-1.06x beside one spinning on registers, 1.23x
beside the real second stage (2026-11-30, ``experiments/neighbour_standin.py
--continuous 4``).  Each reading is a floor of what a computing, exchanging neighbour
costs the layout, so since then the simulator slows each action by the larger of the
two (:attr:`pipesim.cluster.Cluster.host_slowdowns`), and ``experiments/validate.py``
predicts so (its ablation ``no_in_place_contention``: the host law alone).
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.multiprocessing as mp

from executor.calibrate import _gather
from executor.host_allocator import retain_freed_memory
from executor.stage_alone import SynthTransport
from pipesim.plan import Plan
from pipesim.readings import (
    IDLE_KINDS,
    CheckpointExtra,
    ExecutorGap,
    IdleCost,
    RunOnCost,
    SpanSlowdown,
    median_slowdowns,
)


class _Made(SynthTransport):
    """A synthesised transport whose messages are copies of one random tensor per shape:
    a copy costs what filling a posted receive buffer costs, where drawing random numbers
    (SynthTransport's own) would take a large message's stage milliseconds between its
    actions and read as the executor's (:class:`pipesim.readings.ExecutorGap`)."""

    def __init__(self, shapes, device: torch.device,
                 made: dict[tuple[int, str, int], torch.Tensor] | None = None):
        super().__init__(shapes, device)
        self._made = {} if made is None else made  # shared: the tensors made once

    def _make(self, stage: int, kind: str, mb: int) -> torch.Tensor:
        key = (stage, kind, mb)
        if key not in self._made:
            self._made[key] = super()._make(stage, kind, mb)
        return self._made[key].clone()


class _Late(_Made):
    """A synthesised transport whose messages of ``kind`` (``"F"``: the stage's input,
    ``"B"``: its output gradient) arrive ``idle_s`` seconds after the stage asks for them:
    the rank sleeps before that action, as a pipeline's rank blocks on a message that is
    not there yet."""

    def __init__(self, shapes, device: torch.device, kind: str, idle_s: float,
                 made: dict[tuple[int, str, int], torch.Tensor] | None = None):
        super().__init__(shapes, device, made)
        self.kind, self.idle_s = kind, idle_s

    def recv(self, stage: int, kind: str, mb: int, src_stage: int | None = None) -> torch.Tensor:
        if kind == self.kind:
            time.sleep(self.idle_s)
        return super().recv(stage, kind, mb, src_stage)


#: an in-place step with no idle: each message there when asked for
HOT = ("", 0.0)
#: an in-place step of up to :data:`RUN_ON_CHUNKS` micro-batches in GPipe's order
#: (:func:`run_on_costs`): its forwards but the first run after a forward, its backwards
#: but the first after a backward
RUN_ON = ("run", 0.0)
#: micro-batches of a run-on step, where the job's batch holds them (two at least): a run
#: reaches its pace after a forward or two (MLP [4,4]'s first stage alone at 2 samples,
#: GPipe's order, 2026-11-30: 0.65, 0.37, then 0.25-0.28 ms; 1F1B's forwards 0.49-0.57),
#: so runs of 2 read MLP's scale at 0.83-0.96 where runs of 8 read 0.56-0.81
RUN_ON_CHUNKS = 8
#: seconds of untimed steps before each timed one of :func:`idle_costs` (two at least):
#: what it takes a rank to run at its steady pace again after a wait
SETTLE_S = 0.01


def _stage_step(job: Callable, balance: Sequence[int], rank: int, size: int,
                checkpoint: str = "never", idle: tuple[str, float] = HOT,
                device: str | torch.device = "cpu") -> Callable[[], dict[str, float]]:
    """One forward+backward of stage ``rank`` on ``size`` samples, as a pipeline runs it
    (the executor's StageRunner, its inputs and output gradients synthesised; the forward
    inside torch.utils.checkpoint with ``checkpoint="always"``).  With ``idle = (kind,
    seconds)`` the rank sleeps that long before the action ``kind``: ``"F"`` for its input
    (on a first stage, before the step), ``"B"`` for its output gradient, between the two
    (a last stage starts its backward from its own loss, never waiting).  The step returns
    the seconds of its actions as the pipeline's recorder times them, and the executor's
    own seconds around each of them (:class:`pipesim.readings.ExecutorGap`; 0 with an
    idle): ``{"F": .., "B": .., "between": ..}``.  With ``idle = ("FB", seconds)`` the
    rank sleeps before its backward, and ``"F"`` is the forward of one more step run at
    once after it: a 1F1B rank's forward, which follows a backward that waited for its
    gradient (:attr:`pipesim.readings.IdleCost.kind`).  With ``idle = RUN_ON`` the step is
    :data:`RUN_ON_CHUNKS` micro-batches of ``size`` in GPipe's order (as many as the job's
    batch holds, two at least), and ``"F"`` and ``"B"`` the medians of each kind but its
    first: forwards after a forward, backwards after a backward
    (:class:`pipesim.readings.RunOnCost`).  On a CUDA ``device`` the actions are
    timed by the recorder's events (device seconds), the step's wall time between two
    synchronisations."""
    from executor.microbatch import scatter
    from executor.partition import split_module
    from executor.pipeline import stage_skips
    from executor.recorder import Recorder
    from executor.stage import StageRunner
    from executor.stage_alone import message_shapes
    from pipesim.schedule import build_schedule

    device = torch.device(device)
    module, loss_fn, x, y = job()
    # (RUN_ON: micro-batches of ``size`` in GPipe's order, as many as the batch holds)
    chunks = min(RUN_ON_CHUNKS, max(x.shape[0] // size, 2)) if idle == RUN_ON else 1
    if x.shape[0] < chunks * size:
        raise ValueError(f"the job's batch has {x.shape[0]} samples, the step needs "
                         f"{chunks * size}")
    module, x, y = module.to(device), x.to(device), y.to(device)
    plan = Plan(list(balance), chunks, chunks * size, checkpoint=checkpoint, schedule="gpipe")
    shapes = message_shapes(module, plan, x[:chunks * size])
    stage = split_module(module, plan.balance)[rank]
    skips = stage_skips(module, plan)
    actions = build_schedule(plan).order[rank]
    xs = scatter(x[:chunks * size].clone(), plan)
    ys = scatter(y[:chunks * size].clone(), plan)
    cuda = device.type == "cuda"

    made: dict[tuple[int, str, int], torch.Tensor] = {}  # each message made once

    def step() -> dict[str, float]:
        kind, seconds = idle
        if kind == "FB":
            # the backward after the wait, then the forward right after it
            waited = run("B", seconds)
            return {"F": run("", 0.0)["F"], "B": waited["B"], "between": 0.0}
        return run(kind, seconds)

    def run(kind: str, seconds: float) -> dict[str, float]:
        recorder = Recorder(rank, device)
        transport = (_Late(shapes, device, kind, seconds, made) if seconds > 0
                     else _Made(shapes, device, made))
        if kind == "F" and rank == 0:  # its input is data: the wait comes before the step
            time.sleep(seconds)
        runner = StageRunner(rank, {rank: stage}, plan, loss_fn, device, transport, recorder,
                             skips=skips)
        if cuda:  # the events' origin, and the wall time from an idle device
            torch.cuda.synchronize(device)
            recorder.origin_event = torch.cuda.Event(enable_timing=True)
            recorder.origin_event.record()
        began = time.perf_counter()
        runner.run(actions, xs, ys)
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - began
        # rows: (iteration, device, stage, mb, kind, start, end, ...), in the order run:
        # each kind's (RUN_ON: the median of each kind's but the first, after its kind)
        rows = sorted((r for r in recorder.rows(0) if r[4] in ("F", "B")), key=lambda r: r[5])
        out = {kind: statistics.median([r[6] - r[5] for r in rows if r[4] == kind][chunks > 1:])
               for kind in ("F", "B")}
        # the executor's own seconds around each action (no idle: none slept in them)
        out["between"] = ((wall - out["F"] - out["B"]) / 2 if seconds <= 0 and chunks == 1
                          else 0.0)
        return out

    return step


def _in_place_loop(rank: int, barrier, stopped, counts, job: Callable,
                   balance: Sequence[int], sizes: Sequence[int], rounds: int, phase_s: float,
                   threads: int, out) -> None:
    """Rank ``rank``'s side of :func:`stage_contention`: puts ``(rank, {size: (alone
    seconds, together seconds)})``, the means of its timed steps (a pipeline's iteration
    adds up its actions, slow ones included: their mean is what it pays).  Each phase
    opens with an untimed step; ``stopped`` (shared) holds the number of the last
    together phase to have ended, ``counts`` each rank's counted steps in this one (the
    module doc's protocol).  Before the untimed step (2026-11-30), the first rank's
    together phase followed a wait and the last rank's alone phase did: the first stage
    read up to 1.16 where its neighbour read 1.00 (MLP [4,4]'s last stage 1.00-1.12,
    1.11-1.30 since; ``experiments/README.md``, session 53)."""
    torch.set_num_threads(threads)
    retain_freed_memory()  # the pipelines' allocator policy
    world = len(balance)
    steps = {b: _stage_step(job, balance, rank, b) for b in sizes}
    for step in steps.values():  # warm-up: allocator, caches, autograd's first graphs
        for _ in range(3):
            step()
    alone: dict[int, list[float]] = {b: [] for b in sizes}
    together: dict[int, list[float]] = {b: [] for b in sizes}
    number = 0  # together phases so far
    for _ in range(rounds):
        for b in sizes:
            for phase in range(world + 1):  # phase r < world: rank r alone; world: all
                if phase == world:
                    number += 1
                    counts[rank] = 0  # (before the barrier: every rank's is 0 past it)
                barrier.wait()
                if phase not in (rank, world):
                    continue
                steps[b]()  # untimed: the first step after a wait runs cold
                end = time.perf_counter() + phase_s
                while True:
                    t0 = time.perf_counter()
                    steps[b]()
                    t1 = time.perf_counter()
                    if phase < world:  # alone: at least one step, then until time is up
                        alone[b].append(t1 - t0)
                        if t1 >= end:
                            break
                        continue
                    with stopped.get_lock():
                        if stopped.value == number:  # a rank had left: partly alone
                            break
                        together[b].append(t1 - t0)
                        counts[rank] += 1
                        if t1 >= end and min(counts[:]) >= 1:
                            stopped.value = number
                            break
    out.put((rank, {b: (statistics.fmean(alone[b]), statistics.fmean(together[b]))
                    for b in sizes}))


def _check_layout(what: str, job: Callable, balance: Sequence[int], sizes: Sequence[int],
                  rounds: int, phase_s: float, chunks: int = 1) -> None:
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
    if chunks * max(sizes) > inputs.shape[0]:
        steps = (f"micro-batch size {max(sizes)} exceeds" if chunks == 1 else
                 f"{chunks} micro-batches of {max(sizes)} samples exceed")
        raise ValueError(f"{what}: {steps} the job's batch of {inputs.shape[0]} samples")


def stage_contention(job: Callable, balance: Sequence[int], sizes: Sequence[int], *,
                     repeats: int = 3, rounds: int = 20, phase_s: float = 0.02,
                     threads: int = 1, pin_cores: bool = True) -> list[SpanSlowdown]:
    """Each stage's slowdown beside the other ranks, per micro-batch size (see the module
    doc): one :class:`pipesim.readings.SpanSlowdown` per stage and size, the median of
    ``repeats`` readings taken one after the other (:func:`stage_contention_readings`,
    :func:`pipesim.readings.median_slowdowns`: one reading in a slow spell reads the
    whole layout high).

    ``job`` gives ``(module, loss_fn, inputs, targets)`` with at least ``max(sizes)``
    samples (picklable: a ``functools.partial`` of :func:`executor.models.builtin_job`);
    ``balance`` the layers of each stage, one process each (``threads`` torch threads,
    each on its own cores with ``pin_cores``, as the runs are placed).  Seconds spent:
    about ``repeats * (rounds * len(sizes) * (len(balance) + 1) * phase_s + start-up)``.
    """
    return median_slowdowns(stage_contention_readings(
        job, balance, sizes, repeats=repeats, rounds=rounds, phase_s=phase_s,
        threads=threads, pin_cores=pin_cores))


def stage_contention_readings(job: Callable, balance: Sequence[int], sizes: Sequence[int],
                              *, repeats: int = 1, rounds: int = 20, phase_s: float = 0.02,
                              threads: int = 1,
                              pin_cores: bool = True) -> list[list[SpanSlowdown]]:
    """``repeats`` readings of :func:`stage_contention`, each its own set of ranks
    (spawned afresh), one after the other: each reading's rows, stage by stage and size
    by size."""
    _check_layout("contention", job, balance, sizes, rounds, phase_s)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    world = len(balance)
    ctx = mp.get_context("spawn")
    readings = []
    for _ in range(repeats):
        barrier, stopped, counts = ctx.Barrier(world), ctx.Value("i", 0), ctx.Array("i", world)
        results = dict(_gather(_in_place_loop, world,
                               (barrier, stopped, counts, job, list(balance), list(sizes),
                                rounds, phase_s, threads),
                               expected=world, pin_cores=pin_cores))
        reading = []
        first = 0
        for rank, layers in enumerate(balance):
            for b in sizes:
                alone, together = results[rank][b]
                reading.append(SpanSlowdown(first, first + layers, int(b),
                                            max(together / alone, 1.0) if alone > 0 else 1.0))
            first += layers
        readings.append(reading)
    return readings


def _costs_loop(rank: int, barrier, job: Callable, balance: Sequence[int],
                sizes: Sequence[int], modes: Sequence[str], idles: Sequence[tuple[str, float]],
                rounds: int, phase_s: float, threads: int, settle_s: float, at_once: bool,
                out, device: str = "cpu") -> None:
    """Rank ``rank``'s side of :func:`stage_costs` and :func:`idle_costs`: puts ``(rank,
    {(mode, size, idle): (forward seconds, backward seconds)})``, the medians of its steps
    run alone (``idle``: ``(action, seconds)`` it sleeps before, see :func:`_stage_step`),
    or with ``at_once`` every rank's phase at the same time.
    With ``settle_s``, each phase starts with untimed steps without the idle, two at least
    and ``settle_s`` seconds of them: the rank has just waited at the barrier for the
    other ranks' phases, and after a wait its steps run slow for a few milliseconds
    (2026-11-25, MLP [4,4] stage 0 at 2 samples after 20 ms: forward 0.99, 0.53, 0.50,
    then 0.36-0.39 ms)."""
    torch.set_num_threads(threads)
    retain_freed_memory()  # the pipelines' allocator policy
    steps = {(mode, b, idle): _stage_step(job, balance, rank, b, mode, idle, device)
             for mode in modes for b in sizes for idle in idles}
    for step in steps.values():  # warm-up: allocator, caches, autograd's first graphs
        for _ in range(3):
            step()
    times: dict[tuple[str, int, tuple[str, float]], dict[str, list[float]]] = {
        key: {"F": [], "B": [], "between": []} for key in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            # one rank at a time, the others waiting; or all at once
            for turn in range(1 if at_once else len(balance)):
                barrier.wait()
                if not at_once and turn != rank:
                    continue
                if settle_s > 0:
                    settled, end = 0, time.perf_counter() + settle_s
                    while settled < 2 or time.perf_counter() < end:
                        steps[(key[0], key[1], HOT)]()
                        settled += 1
                end = time.perf_counter() + phase_s
                while True:  # at least one step, then until the phase's time is up
                    for kind, seconds in step().items():
                        times[key][kind].append(seconds)
                    if time.perf_counter() >= end:
                        break
    out.put((rank, {key: (statistics.median(t["F"]), statistics.median(t["B"]),
                          statistics.median(t["between"]))
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
    "checkpointed", "fwd_s", "bwd_s", "between_s"}``, the last the executor's own
    seconds around each action (:class:`pipesim.readings.ExecutorGap`).  What a profile
    adds up layer by layer, measured on the stage whole: the executor's per-action work,
    the stage's own cache footprint, torch.utils.checkpoint entered once.  Seconds spent:
    about ``rounds * len(modes) * len(sizes) * len(balance) * phase_s`` plus start-up.
    """
    return _cost_rows(_alone(job, balance, sizes, modes, (HOT,), rounds, phase_s, threads,
                             pin_cores, "stage costs"))


def _cost_rows(stages: list[tuple[tuple[int, int, int], dict]]) -> list[dict]:
    """:func:`stage_costs`' rows from :func:`_alone`'s results (each stage's hot steps)."""
    return [{"first": first, "stop": stop, "micro_batch": int(b),
             "checkpointed": mode == "always", "fwd_s": fwd, "bwd_s": bwd,
             "between_s": between}
            for (first, stop, _), results in stages
            for (mode, b, _), (fwd, bwd, between) in sorted(results.items())]


class _Turns:
    """The barrier of :func:`_costs_loop` for stages that take turns in one process: every
    wait returns at once (a stage's loop runs whole before the next stage's)."""

    def wait(self) -> None:
        pass


class _Collected(list):
    """The result queue of :func:`_costs_loop` in one process: what it puts, kept."""

    def put(self, item) -> None:
        self.append(item)


def device_stage_costs(job: Callable, balance: Sequence[int], sizes: Sequence[int], *,
                       device: str = "cuda:0", modes: Sequence[str] = ("never", "always"),
                       rounds: int = 5, phase_s: float = 0.05) -> list[dict]:
    """:func:`stage_costs` for the in-process executor on one ``device`` (its workers are
    threads of this process, every stage on that device): each stage alone in this
    process, one after the other, its forward and backward through the executor's
    StageRunner as the pipeline's recorder times them (CUDA events on a GPU), plain and
    checkpointed (``modes``), at each micro-batch size; rows as :func:`stage_costs`'.

    What a profile adds up layer by layer, measured on the stage whole: the executor's
    per-action work (its recorder, the checkpoint's wrapper), torch.utils.checkpoint
    entered once, the launches of a stage issued back to back.  Nothing of a plan is in
    it, so every schedule and chunk count with that balance uses it.  Seconds spent: about
    ``rounds * len(modes) * len(sizes) * len(balance) * phase_s`` plus three warm-up steps
    of each."""
    return _cost_rows(_alone(job, balance, sizes, modes, (HOT,), rounds, phase_s,
                             torch.get_num_threads(), False, "stage costs", device=device))


def checkpoint_extras(job: Callable, balance: Sequence[int], sizes: Sequence[int], *,
                      rounds: int = 10, threads: int = 1,
                      pin_cores: bool = True) -> list[CheckpointExtra]:
    """What checkpointing adds to each stage's backward at each size, in place: its
    checkpointed backward (recomputing) less its plain one, both timed by
    :func:`stage_costs` (the stage alone on its rank's cores, the same steps).  The
    simulator charges it where a checkpointed backward has no idle cost to read
    (:attr:`pipesim.cluster.Cluster.checkpoint_extras`).  MLP's last stage
    (2026-11-26): 1.54-2.17x the plain backward in place, 1.56-1.64x by the profile."""
    return checkpoint_extras_of(stage_costs(job, balance, sizes, rounds=rounds,
                                            threads=threads, pin_cores=pin_cores))


def checkpoint_extras_of(rows: Sequence[dict]) -> list[CheckpointExtra]:
    """:func:`checkpoint_extras` from :func:`stage_costs`' rows (both modes)."""
    plain = {(r["first"], r["stop"], r["micro_batch"]): r["bwd_s"]
             for r in rows if not r["checkpointed"]}
    return [CheckpointExtra(r["first"], r["stop"], r["micro_batch"],
                            r["bwd_s"] - plain[(r["first"], r["stop"], r["micro_batch"])])
            for r in rows if r["checkpointed"]]


def executor_gaps_of(rows: Sequence[dict]) -> list[ExecutorGap]:
    """The executor's own seconds around each action, per stage, size and checkpoint mode
    (:class:`pipesim.readings.ExecutorGap`), from :func:`stage_costs`' rows."""
    return [ExecutorGap(r["first"], r["stop"], r["micro_batch"], r["checkpointed"],
                        max(r["between_s"], 0.0)) for r in rows]


def _alone(job: Callable, balance: Sequence[int], sizes: Sequence[int], modes: Sequence[str],
           idles: Sequence[tuple[str, float]], rounds: int, phase_s: float, threads: int,
           pin_cores: bool, what: str, settle_s: float = 0.0, at_once: bool = False,
           device: str | None = None, chunks: int = 1) -> list[tuple[tuple[int, int, int], dict]]:
    """:func:`_costs_loop` on every rank of ``balance``, each alone in turn (or all
    ``at_once``): per stage ``((first, stop, rank), {(mode, size, idle): (forward s,
    backward s)})``.  With a ``device``, the stages of the in-process executor (threads of
    this process, every stage on that device): each stage's loop in this process, one
    after the other (``pin_cores`` and ``at_once`` do not apply)."""
    unknown = sorted(set(modes) - {"never", "always"})
    if unknown:
        raise ValueError(f"checkpoint modes must be 'never' or 'always', got {unknown}")
    if device is not None:
        # one model for every step (building a large one takes seconds each time): the
        # stages of the in-process executor share it too
        job = functools.cache(job)
    _check_layout(what, job, balance, sizes, rounds, phase_s, chunks)
    world = len(balance)
    args = (list(balance), list(sizes), list(modes), list(idles), rounds, phase_s, threads,
            settle_s)
    if device is not None:
        before = torch.get_num_threads()  # (the loop sets it: keep the caller's)
        results = {}
        try:
            for rank in range(world):
                collected = _Collected()
                _costs_loop(rank, _Turns(), job, *args, True, collected, device)
                (_, results[rank]), = collected
        finally:
            torch.set_num_threads(before)
    else:
        barrier = mp.get_context("spawn").Barrier(world)
        results = dict(_gather(_costs_loop, world, (barrier, job, *args, at_once),
                               expected=world, pin_cores=pin_cores))
    out, first = [], 0
    for rank, layers in enumerate(balance):
        out.append(((first, first + layers, rank), results[rank]))
        first += layers
    return out


#: the idles (seconds) :func:`idle_costs` measures by default; 2 ms, once measured too,
#: reads as well between 0.5 and 5 (``experiments/idle_subsets.py``)
IDLE_S = (0.0005, 0.005, 0.02)

#: how many of a grid's sizes :func:`idle_costs` measures by default (:func:`spread_sizes`)
IDLE_SIZES = 3


def spread_sizes(sizes: Sequence[int], count: int) -> list[int]:
    """``count`` of ``sizes`` spread over their range in log2: the smallest, the largest
    and those nearest evenly spaced points between (all of them where there are no more
    than ``count``), ascending::

        spread_sizes([2, 4, 8, 16, 32], 3) == [2, 8, 32]
    """
    ordered = sorted({int(b) for b in sizes})
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    if len(ordered) <= count:
        return ordered
    if count == 1:
        return [ordered[len(ordered) // 2]]
    low, high = math.log2(ordered[0]), math.log2(ordered[-1])
    targets = [low + (high - low) * i / (count - 1) for i in range(count)]
    return sorted({min(ordered, key=lambda b: abs(math.log2(b) - t)) for t in targets})


def idle_costs(job: Callable, balance: Sequence[int], sizes: Sequence[int], *,
               idle_s: Sequence[float] = IDLE_S, size_points: int | None = IDLE_SIZES,
               kinds: Sequence[str] = ("F", "B"), modes: Sequence[str] = ("never", "always"),
               rounds: int = 15, threads: int = 1, pin_cores: bool = True,
               at_once: bool = False, device: str | None = None) -> list[IdleCost]:
    """What an action costs more when its rank has slept before it, measured in place.

    Each stage alone on its rank's cores (as :func:`stage_costs`), its step run with every
    message there at once and with the rank sleeping ``idle`` seconds before its forward
    (for its input) or its backward (for its output gradient), for each ``idle`` in
    ``idle_s``, in turn within each round so that the machine's drift weighs on all
    alike::

        hot        |F|B|            |F|B|
        before B   |F|---- idle ----|B.....|        B.....: slower by `seconds`
        before F   |---- idle ----|F.....|B|
        after B    |F|---- idle ----|B|F.....|B|    kind "FB": the forward after it

    On this project's shared VM what a rank touched fades from its caches while it waits
    (other tenants' work: spinning instead of sleeping fades it as much), and the action
    after a wait pays the misses: a backward 0.1-0.3 ms more after 2 ms, 0.3-0.9 ms after
    20 ms, 0.6-1.2 ms checkpointed (2026-11-25, ``experiments/idle_costs.py``), nearly the
    same at every micro-batch size.  What a forward touches is not all a backward touches:
    in a 1F1B pipeline a rank's forward comes right after a backward that waited for its
    gradient, and pays for that wait too (kind ``"FB"``, on request: on this project's VM a
    lone MLP stage's forward at 2 samples took 0.24 ms after a forward, 0.31 after a
    backward, 0.37 and 0.43 after a backward that followed 1 and 3 ms asleep -- 0.46 and
    0.50 right after the sleep, ``experiments/idle_kinds.py``; in place MLP [4,4]'s first
    stage 0.50-0.72 ms after 0.5-20 ms against 0.44 hot, so little at a 1F1B rank's
    0.1-0.3 ms waits that three grids predicted within 0.03 points of without it,
    2026-11-29/30: not measured by default).  On a stage whose actions take milliseconds
    one step's own noise is larger than that, so ``seconds`` is the median over the sizes
    of (the median action after the idle less the median hot one); ``after_idle_s`` keeps
    each size's own median and ``hot_s`` the hot one.  One
    :class:`pipesim.readings.IdleCost` per stage, action kind, size, checkpoint mode and
    idle (no backward of the last stage, nor a forward after one: it starts from its own
    loss, never waiting).  Each timed step follows :data:`SETTLE_S` of untimed ones (two
    at least), so that "at once" is the rank's steady pace.  Seconds spent: about
    ``rounds * len(modes) * len(sizes) * len(balance) * (len(kinds) * len(idle_s) + 1)``
    times (two steps or 10 ms, the step, the idle; an ``"FB"`` one step more): 5-10
    minutes for the CPU grid's six layouts by default.

    ``size_points``: measure only that many of ``sizes``, spread over them
    (:func:`spread_sizes`; None: all); :meth:`pipesim.cluster.Cluster.idle_cost` reads
    the others between them, linear in log2 size.  By default 3 sizes and 3 idles, about
    half the steps of all five sizes and four idles (0.5, 2, 5, 20 ms): on the 27 committed
    CPU grids that measured all, predicted again from the readings kept, each run's median
    |error| moved -0.03 points (median; +0.8 at worst) and the runs pooled 2.93% -> 2.78%
    (``experiments/idle_subsets.py``, 2026-11-26).

    ``at_once``: every rank measures at the same time, each on its own cores (``len(balance)``
    times faster).  For a machine with a core per rank and more (16 cores, 4-8 pinned
    ranks), where the ranks barely slow each other (in place 1.00-1.11, H200 host
    2026-11-26) but a wait costs far more than on the 2-core VM: in that 4-rank grid an
    action after 3-10 ms idle ran 1.2-1.3x its profile, after 10-30 ms 1.3-1.4x, and one
    with its input there at once 0.97-1.04x (GPT).  Not on a machine whose ranks share
    cores: there the ranks' steps would slow each other and the idles overlap.

    ``device``: the stages of the in-process executor on that device instead (threads of
    this process: each stage's steps in this process in turn with ``threads`` torch
    threads, the caller's setting restored after; ``pin_cores`` and ``at_once`` not
    applying).  A worker thread blocked on its queue
    sleeps as a rank does: on this project's VM a small MLP stage's forward at 2 samples
    took 0.13 ms hot and 0.21-0.29 after 5 ms asleep (2026-11-26).
    """
    idles = sorted({float(d) for d in idle_s})
    if not idles or idles[0] <= 0:
        raise ValueError(f"idle_s must hold positive seconds, got {list(idle_s)}")
    if not kinds or set(kinds) - set(IDLE_KINDS):
        raise ValueError(f"kinds must be some of {', '.join(IDLE_KINDS)}, got {list(kinds)}")
    if size_points is not None:
        sizes = spread_sizes(sizes, size_points)
    keys = [HOT, *((kind, idle) for kind in kinds for idle in idles)]
    out = []
    # phase_s 0: one step a phase, each idle of a round beside the hot step
    for (first, stop, rank), results in _alone(job, balance, sizes, modes, keys, rounds, 1e-9,
                                               threads, pin_cores, "idle costs",
                                               settle_s=SETTLE_S, at_once=at_once,
                                               device=device):
        for mode in modes:
            for kind in kinds:
                if kind != "F" and rank == len(balance) - 1:
                    continue  # (a last stage's backward starts from its loss: no wait)
                k = 1 if kind == "B" else 0
                hot = {b: results[(mode, b, HOT)][k] for b in sizes}
                for idle in idles:
                    after = {b: results[(mode, b, (kind, idle))][k] for b in sizes}
                    seconds = statistics.median(after[b] - hot[b] for b in sizes)
                    out += [IdleCost(first, stop, int(b), mode == "always", idle, seconds,
                                     kind, hot[b], after[b]) for b in sizes]
    return out


def run_on_costs(job: Callable, balance: Sequence[int], sizes: Sequence[int], *,
                 modes: Sequence[str] = ("never", "always"), rounds: int = 20,
                 threads: int = 1, pin_cores: bool = True,
                 device: str | None = None) -> list[RunOnCost]:
    """What a forward costs right after a forward, and a backward right after a backward,
    against the other order, each stage alone on its rank's cores (as :func:`stage_costs`).

    Within each round a stage's plain step (forward, backward: the forward after the
    last step's backward, the backward after its forward) and its step of
    :data:`RUN_ON_CHUNKS` micro-batches in GPipe's order (as many as the batch holds, two
    at least), whose forwards but the first follow a forward and backwards but the first a
    backward, each after :data:`SETTLE_S` of plain steps::

        plain    ..|F|B|  |F|B|                  F after B, B after F     (other_s)
        run-on   ..|F|B|  |F|F|F|F|B|B|B|B|      the median of the Fs and of the Bs
                                                 but each kind's first     (same_s)

    ``scale = median(same) / median(other)`` per stage, size, checkpoint mode and kind: a
    :class:`pipesim.readings.RunOnCost` (the simulator's ``Cluster.run_on_costs``).  A
    profile times each layer's forward after its backward, and a stage's in-place costs
    the plain step, so they price the other order; GPipe's ranks run theirs in runs.
    ``sizes`` at most half the job's batch (a run-on step takes two micro-batches at
    least).  On this project's VM (2026-11-30) a lone MLP stage's forwards in GPipe's
    order ran at half its forwards after a backward at 2 samples (MLP [4,4]'s first
    stage: 0.25-0.28 ms from the third forward of a run on, 0.49-0.57 in 1F1B's order),
    as they did in the grids' pipelines; GPT's and U-Net's 5-15% faster.
    ``device``: the in-process executor's stages on that device, as :func:`idle_costs`'.
    Seconds spent: about ``rounds * len(modes) * len(sizes) * len(balance) * 2`` times
    (10 ms of plain steps and the step).
    """
    out = []
    for (first, stop, _), results in _alone(job, balance, sizes, modes, [HOT, RUN_ON],
                                            rounds, 1e-9, threads, pin_cores, "run-on costs",
                                            settle_s=SETTLE_S, device=device, chunks=2):
        for mode in modes:
            for b in sizes:
                for k, kind in enumerate(("F", "B")):
                    same, other = results[(mode, b, RUN_ON)][k], results[(mode, b, HOT)][k]
                    if same > 0 and other > 0:
                        out.append(RunOnCost(first, stop, int(b), mode == "always", kind,
                                             same / other, same, other))
    return out


__all__ = ["checkpoint_extras", "checkpoint_extras_of", "device_stage_costs",
           "executor_gaps_of", "idle_costs", "run_on_costs", "spread_sizes",
           "stage_contention", "stage_costs"]
