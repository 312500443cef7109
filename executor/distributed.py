"""Running a Schedule with one process per rank over torch.distributed.

Two ways in:

* ``torchrun --nproc-per-node N your_script.py`` and, in the script, :func:`run_rank`
  with the rank's model and batch (gloo on CPU, NCCL on CUDA);
* :func:`spawn` from a notebook or test: starts the ranks itself on this machine, pins
  each to its own cores if asked, gathers their traces into one measured Trace, and
  turns the first failure into one error naming the rank, stage and action, stopping
  the other ranks instead of leaving them blocked.

Clocks: every rank reads ``perf_counter`` right after a barrier at the start of each
iteration and reports times from there, so all ranks share one origin.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from executor.batchnorm import commit_deferred_batch_norm
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
from executor.pipeline import (
    TRACKED,
    TRACKED_COUNTS,
    RunResult,
    check_inputs,
    measured_meta,
    stage_skips,
)
from executor.recorder import Recorder, compute_actions, compute_spans, shift_rows
from executor.stage import StageRunner
from executor.timing import speed_reference
from executor.transport import DistTransport
from pipesim.plan import Plan
from pipesim.schedule import FORWARD, WEIGHT_GRAD, Schedule, build_schedule
from pipesim.trace import (
    CATEGORY_COLUMNS,
    MEASURED_COLUMNS,
    MEMORY_COLUMNS,
    Trace,
    frame_from_rows,
)

#: A picklable builder run in every rank: returns (model, loss_fn, inputs, targets).
Job = Callable[[], tuple[nn.Sequential, Callable, torch.Tensor, torch.Tensor]]


class RankFailed(RuntimeError):
    """A rank raised or died; the message names rank, stage and action where known."""


@dataclass
class RankResult:
    rank: int
    rows: list[tuple]
    losses: list[float]
    grads: dict[str, Any] | None  # parameter name (as in the unsplit module) -> numpy
    step_wall_s: list[float]  # per measured iteration: barrier passed -> all sends done
    messages: list[tuple] = field(default_factory=list)  # transport log, iteration-relative
    peak_memory_bytes: int = 0  # CUDA allocator peak, or the tracker's on CPU
    #: the tracked iteration's memory: (seconds from its origin, bytes), executor.memtrack
    memory: list[tuple[float, int]] = field(default_factory=list)
    #: the same by category: (seconds from its origin, category, bytes)
    memory_by_category: list[tuple[float, str, int]] = field(default_factory=list)
    #: the tracked iteration's compute actions: (stage, micro-batch, kind, start, end),
    #: seconds from its origin -- what the memory timeline's shape is read against
    memory_actions: list[tuple[int, int, str, float, float]] = field(default_factory=list)
    #: seconds of the machine's speed reference read on this rank just before the plan
    #: (:func:`executor.timing.speed_reference`; 0: not read)
    reference_s: float = 0.0
    #: the CPUs this rank's process ran on (its affinity as the plan ran)
    cores: tuple[int, ...] = ()


def send_order(schedule: Schedule, skips: tuple[tuple[str, int, int], ...],
               rank: int) -> dict[int, list[tuple[int, str, int]]]:
    """The messages every other rank sends to ``rank``, per peer, in the order it sends them.

    Mirrors :class:`executor.stage.StageRunner`: a forward sends its output, then the skip
    tensors it stashes; a backward (or an input gradient, I) sends the popped skips'
    gradients, then its input's gradient; a weight gradient (W) sends nothing.  Keys are
    ``(receiving stage, kind, micro-batch)``.  A transport without
    tags (NCCL) receives in this order (see :class:`executor.transport.DistTransport`).
    """
    last = len(schedule.placement) - 1
    place = schedule.placement
    orders: dict[int, list[tuple[int, str, int]]] = {}
    for peer, actions in enumerate(schedule.order):
        if peer == rank:
            continue
        out = []
        for a in actions:
            s, m = a.stage, a.microbatch
            if a.kind == FORWARD:
                sends = [(s + 1, "F")] if s < last else []
                sends += [(b, f"S:{name}") for name, src, b in skips if src == s]
            elif a.kind == WEIGHT_GRAD:
                sends = []  # weight gradients stay on their stage
            else:
                sends = [(src, f"SB:{name}") for name, src, b in skips if b == s]
                sends += [(s - 1, "B")] if s > 0 else []
            out += [(dst, kind, m) for dst, kind in sends if place[dst] == rank]
        orders[peer] = out
    return orders


def directional_groups() -> tuple[Any, Any]:
    """``(up, down)``: two process groups of every rank, messages to a higher rank over
    the first, to a lower rank over the second (:class:`executor.transport.DistTransport`).
    Every rank calls it, in the same order (a collective).

    Why: with gloo a group's two ranks share one TCP connection, and two messages that
    cross on it (each rank sending to the other at once, receives posted) are often held
    up to a scheduler tick.  Two pinned ranks crossing 2 x 16 KiB, 128 KiB, 2 x 128 KiB or
    1 MiB each way, 55 rounds (``experiments/crossing_messages.py``, 2-core VM): over one
    connection 17-38 rounds took over 2 ms from post to both received (p90 3.0-5.5 ms;
    median 2.3-2.8 ms for the two larger cases), over one per direction 0-6 (p90
    0.18-2.3 ms); in the CPU grid's U-Net 1F1B [8,5] m=16 such crossings held both ranks
    4 ms a few times an iteration."""
    return dist.new_group(), dist.new_group()


def run_rank(rank: int, module: nn.Sequential, loss_fn: Callable, inputs: torch.Tensor,
             targets: torch.Tensor, plan: Plan, *, schedule: Schedule | None = None,
             device: torch.device | str = "cpu", iterations: int = 5, warmup: int = 2,
             timeout_s: float = 120.0, fail_at: str | None = None,
             return_grads: bool = False, track_memory: bool = True,
             tags: bool | None = None, groups: tuple[Any, Any] = (None, None),
             prefetch_after_inputs: bool = True, receives_at_start: bool = True) -> RankResult:
    """Run this rank's part of ``schedule`` (process group already initialised).

    Every rank passes the same ``inputs``/``targets``; rank of stage 0 reads the inputs,
    the last stage's rank the targets.  Gradients are cleared before each iteration.
    ``tags`` (default: unless the backend is NCCL) tells messages apart by tag; without,
    each peer's messages are received in the order it sends them (:func:`send_order`).
    ``groups``: the process groups of messages up and down (:func:`directional_groups`;
    the default group for both unless given).
    """
    schedule = schedule or build_schedule(plan)
    check_inputs(module, plan, schedule, inputs.shape[0])
    device = torch.device(device)
    mine = {s: stage.to(device) for s, stage in enumerate(split_module(module, plan.balance))
            if schedule.placement[s] == rank}
    xs = scatter(inputs.to(device), plan)
    ys = scatter(targets.to(device), plan)
    skips = stage_skips(module, plan, schedule)
    if tags is None:
        tags = dist.get_backend() != "nccl"
    transport = DistTransport(rank, schedule.placement, plan.n_microbatches, device, timeout_s,
                              skip_names=tuple(name for name, _, _ in skips), tags=tags,
                              send_order=None if tags else send_order(schedule, skips, rank),
                              groups=groups)
    rows: list[tuple] = []
    losses: list[float] = []
    walls: list[float] = []
    messages: list[tuple] = []
    peak = 0
    offset = 0.0
    for i in range(warmup + iterations):
        for stage in mine.values():
            stage.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        recorder = Recorder(rank, device, origin=t0)
        if device.type == "cuda":
            recorder.origin_event = torch.cuda.Event(enable_timing=True)
            recorder.origin_event.record()
        runner = StageRunner(rank, mine, plan, loss_fn, device, transport, recorder,
                             fail_at=fail_at, skips=skips,
                             prefetch_after_inputs=prefetch_after_inputs,
                             receives_at_start=receives_at_start)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        runner.run(schedule.order[rank], xs, ys)
        transport.finish_iteration()
        wall = time.perf_counter() - t0
        commit_deferred_batch_norm(module)
        it_rows = recorder.rows(i - warmup)
        it_log = [(*entry[:1], i - warmup, *entry[1:]) for entry in transport.log]
        transport.log.clear()
        # one span per iteration, agreed by all ranks, lays iterations end to end
        span = torch.tensor([max((r[6] for r in it_rows), default=0.0)], dtype=torch.float64)
        dist.all_reduce(span, op=dist.ReduceOp.MAX)
        if i >= warmup:
            rows += shift_rows(it_rows, offset)
            # times from this iteration's origin, laid end to end like the rows
            for logged in it_log:
                t_index = 4 if logged[0] == "post" else 3  # ("post", it, key, src_stage, t, ...)
                entry = list(logged)
                entry[t_index] = entry[t_index] - t0 + offset
                messages.append(tuple(entry))
            offset += float(span)
            losses.append(sum(runner.losses.values()))
            walls.append(wall)
            if device.type == "cuda":
                peak = max(peak, int(torch.cuda.max_memory_allocated(device)))
    memory: list[tuple[float, int]] = []
    by_category: list[tuple[float, str, int]] = []
    memory_actions: list[tuple[int, int, str, float, float]] = []
    if track_memory:
        # one more iteration, every tensor tracked (slower: kept out of the timed ones)
        for stage in mine.values():
            stage.zero_grad(set_to_none=True)
        warm_up(device)
        timeline = Timeline(granularity_of(device))
        timeline.add_existing("rank", held_tensors(mine.values()))
        dist.barrier()
        t0 = time.perf_counter()
        runner = StageRunner(rank, mine, plan, loss_fn, device, transport,
                             Recorder(rank, device, origin=t0), skips=skips,
                             prefetch_after_inputs=prefetch_after_inputs,
                             receives_at_start=receives_at_start)
        if device.type == "cuda":
            runner.recorder.origin_event = torch.cuda.Event(enable_timing=True)
            runner.recorder.origin_event.record()
        with Tracker(timeline, "rank"):
            runner.run(schedule.order[rank], xs, ys)
        transport.finish_iteration()
        transport.log.clear()
        commit_deferred_batch_norm(module)
        memory = [(t - t0, level) for t, _, level in timeline.rows]
        tracked = runner.recorder.rows(0)
        memory_actions = compute_actions(tracked).get(rank, [])
        spans = {"rank": compute_spans(tracked, t0).get(rank, [])}
        by_category = [(t - t0, category, level) for t, _, category, level in
                       timeline.by_category(classifier(mine.values(), spans))]
        if device.type != "cuda":
            peak = timeline.peak["rank"]
        timeline.forget()
    grads = None
    if return_grads:
        # named as in the unsplit module; numpy pickles by value, while a tensor would
        # travel as a shared-memory handle that dies with this process
        my_layers = {str(i) for s in mine for i in plan.stage_layers(s)}
        grads = {name: p.grad.detach().cpu().numpy() for name, p in module.named_parameters()
                 if name.split(".")[0] in my_layers and p.grad is not None}
    return RankResult(rank, rows, losses, grads, walls, peak_memory_bytes=peak, messages=messages,
                      memory=memory, memory_by_category=by_category,
                      memory_actions=memory_actions)


_SEND_KIND = {"F": "SEND_F", "B": "SEND_B", "S": "SEND_S", "SB": "SEND_SB"}


def transfer_rows(messages: list[tuple]) -> list[tuple]:
    """Measured transfer rows: from the sender posting a message to the receiver holding it.

    The receiver takes a message only when it needs it, so a transfer that arrived
    early shows as long as the wait for its consumer.
    """
    posts = {(e[1], e[2]): e for e in messages if e[0] == "post"}
    rows = []
    for e in messages:
        if e[0] != "done" or (e[1], e[2]) not in posts:
            continue
        _, it, (stage, kind, mb), src_stage, start, nbytes, src, dst = posts[(e[1], e[2])]
        rows.append((it, src, src_stage if src_stage is not None else stage, mb,
                     _SEND_KIND[kind.split(":")[0]], start, max(e[3], start), nbytes,
                     f"dev{src}->dev{dst}"))
    return rows


def rank_cores(world: int) -> dict[int, set[int]]:
    """Each of ``world`` ranks' own share of this process's CPUs (``pin_cores``): equal
    consecutive slices, a CPU each at least (ranks share CPUs round robin beyond them).

    Unpinned on a 2-core VM, the operating system places a rank's threads where it likes,
    and in some iterations every message lands 2-5 ms after its post instead of 0.2-0.6 ms
    (a woken receiver or gloo's I/O thread behind the other rank's compute, presumably);
    pinned, that mode is rare: ``experiments/executor_options.py`` (median message 0.27-2.6 ms
    unpinned, 0.14-0.60 ms pinned; U-Net 1F1B [8,5] at 16 micro-batches 94.6 -> 81.1 ms
    an iteration, 2026-11-24).
    """
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // world)
    return {r: set(cpus[r * per:(r + 1) * per]) or {cpus[r % len(cpus)]} for r in range(world)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, job: Job, runs: list[tuple[Plan, Schedule]],
            options: dict, results: mp.Queue) -> None:
    try:
        retain_freed_memory()  # before the model exists: every tensor under one policy
        threads = options.get("threads_per_rank")
        if threads:
            torch.set_num_threads(threads)
        cores = options.get("cores")
        if cores:
            os.sched_setaffinity(0, cores[rank])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world,
                                timeout=timedelta(seconds=options.get("timeout_s", 120)))
        groups = (directional_groups() if options.get("directional_groups", True)
                  else (None, None))
        module, loss_fn, inputs, targets = job()
        for index, (plan, schedule) in enumerate(runs):
            reference = (_reference_in_turn(rank, world, module, inputs[:REFERENCE_SAMPLES])
                         if options.get("reference") else 0.0)
            result = run_rank(rank, module, loss_fn, inputs[: plan.batch_size],
                              targets[: plan.batch_size], plan, schedule=schedule,
                              iterations=options["iterations"][index],
                              warmup=options.get("warmup", 2),
                              timeout_s=options.get("timeout_s", 120),
                              fail_at=options.get("fail_at", {}).get(rank),
                              return_grads=options.get("return_grads", False),
                              track_memory=options.get("track_memory", True),
                              tags=options.get("tags"), groups=groups,
                              prefetch_after_inputs=options.get("prefetch_after_inputs", True),
                              receives_at_start=options.get("receives_at_start", True))
            result.reference_s = reference
            if cores:
                result.cores = tuple(sorted(os.sched_getaffinity(0)))
            results.put(("ok", rank, (index, result)))
        dist.destroy_process_group()
    except BaseException as exc:
        results.put(("error", rank, f"rank {rank}: {type(exc).__name__}: {exc}\n"
                                    f"{traceback.format_exc(limit=4)}"))


#: samples of the job's batch the speed reference runs on (spawn_plans(reference=True))
REFERENCE_SAMPLES = 4


def _reference_in_turn(rank: int, world: int, module: nn.Module, x: torch.Tensor) -> float:
    """:func:`executor.timing.speed_reference` of the whole ``module`` on this rank, the
    ranks one at a time (the others waiting at a barrier), so that no rank's reading
    holds another's work."""
    seconds = 0.0
    for turn in range(world):
        dist.barrier()
        if turn == rank:
            seconds = speed_reference(module, x)
    dist.barrier()
    return seconds


def dead_ranks(procs: Sequence[Any], finished: set[int] | frozenset[int] = frozenset()
               ) -> list[tuple[int, int]]:
    """``(rank, exit code)`` of each process of ``procs`` (index = rank) that ended with a
    non-zero exit code, ranks in ``finished`` (all their results in) left out: what a
    parent waiting on its ranks' results checks so that it raises instead of waiting."""
    return [(r, p.exitcode) for r, p in enumerate(procs)
            if p.exitcode not in (None, 0) and r not in finished]


def spawn(job: Job, plan: Plan, *, schedule: Schedule | None = None,
          **options) -> tuple[RunResult, dict[int, RankResult]]:
    """Start one process per rank on this machine (gloo, CPU), run ``plan``, gather a Trace.

    ``job`` must be picklable (a module-level function or ``functools.partial``): each
    rank calls it to build its model and batch.  Options as :func:`spawn_plans`.
    Raises :class:`RankFailed` within about ``timeout_s`` if any rank fails.
    """
    return spawn_plans(job, [plan], schedules=[schedule], **options)[0]


def spawn_plans(job: Job, plans: list[Plan], *, schedules: list[Schedule | None] | None = None,
                iterations: int | Sequence[int] = 5, warmup: int = 2, threads_per_rank: int = 1,
                pin_cores: bool | Mapping[int, set[int]] = False, timeout_s: float = 120.0,
                fail_at: dict[int, str] | None = None, return_grads: bool = False,
                track_memory: bool = True, tags: bool = True, directional: bool = True,
                reference: bool = False, prefetch_after_inputs: bool = True,
                receives_at_start: bool = True
                ) -> list[tuple[RunResult, dict[int, RankResult]]]:
    """Run several plans (same number of ranks) in one set of processes, one after another.

    Starting processes and the process group costs seconds, so grids share them.  Each
    plan may use the first ``plan.batch_size`` samples of the job's batch.
    ``fail_at={rank: "1F0"}`` injects a failure; ``pin_cores`` gives each rank its own
    share of this process's CPUs (:func:`rank_cores`), or, as ``{rank: cores}``, the
    cores named (``experiments/core_swap.py`` swaps them); ``tags=False`` receives in
    send order as on NCCL (the same code path, testable on gloo).  ``iterations`` is one
    count for every plan or one per plan (a short plan measured over more iterations: the
    same seconds of the run).
    ``directional`` sends messages up and down over groups of their own
    (:func:`directional_groups`; ``False``: every message over the default group).
    ``prefetch_after_inputs`` posts the receives of a rank's next action once its current
    action's inputs are in (``False``: before waiting for them; see
    :meth:`executor.stage.StageRunner._inputs_in`); ``receives_at_start`` posts every
    receive of a rank's step as the step starts (``False``: action by action; see
    :meth:`executor.stage.StageRunner.run`).
    ``reference`` reads the machine's speed before each plan, every rank in turn timing
    the whole model's forward on :data:`REFERENCE_SAMPLES` samples
    (:func:`executor.timing.speed_reference`): ``meta["reference_s"]``, the ranks' mean.
    """
    schedules = schedules or [None] * len(plans)
    counts = [iterations] * len(plans) if isinstance(iterations, int) else list(iterations)
    if len(counts) != len(plans) or min(counts, default=1) < 1:
        raise ValueError(f"iterations: {iterations!r} is not a count >= 1 or one per plan "
                         f"({len(plans)} plans)")
    runs = [(p, s or build_schedule(p)) for p, s in zip(plans, schedules, strict=True)]
    worlds = {s.n_devices for _, s in runs}
    if len(worlds) != 1:
        raise ValueError(f"plans need different numbers of ranks {sorted(worlds)}; spawn them apart")
    world = worlds.pop()
    options = {"iterations": counts, "warmup": warmup, "threads_per_rank": threads_per_rank,
               "timeout_s": timeout_s, "fail_at": fail_at or {}, "return_grads": return_grads,
               "track_memory": track_memory, "tags": tags, "directional_groups": directional,
               "reference": reference, "prefetch_after_inputs": prefetch_after_inputs,
               "receives_at_start": receives_at_start}
    if isinstance(pin_cores, Mapping):
        if sorted(pin_cores) != list(range(world)) or not all(pin_cores.values()):
            raise ValueError(f"pin_cores: {dict(pin_cores)!r} does not name cores for each of "
                             f"ranks 0..{world - 1}")
        options["cores"] = {r: set(c) for r, c in pin_cores.items()}
    elif pin_cores:
        options["cores"] = rank_cores(world)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, job, runs, options, results),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    done: dict[tuple[int, int], RankResult] = {}
    expected = world * len(runs)
    # start-up, then each plan's work: the ranks' own receive timeouts bound every wait
    deadline = time.monotonic() + 60 + timeout_s * len(runs)
    try:
        while len(done) < expected:
            try:
                status, rank, payload = results.get(timeout=0.2)
            except queue.Empty:
                finished = {r for r, _ in done if sum(1 for q, _ in done if q == r) == len(runs)}
                dead = dead_ranks(procs, finished)
                if dead:
                    raise RankFailed(f"rank {dead[0][0]} died with exit code "
                                     f"{dead[0][1]}") from None
                if time.monotonic() > deadline:
                    raise RankFailed("ranks did not finish in time; still waiting for "
                                     f"{expected - len(done)} results") from None
                continue
            if status == "error":
                raise RankFailed(payload.strip())
            index, result = payload
            done[(rank, index)] = result
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
    out = []
    for index, (plan, schedule) in enumerate(runs):
        ranks = {r: done[(r, index)] for r in range(world)}
        rows = [row for r in sorted(ranks) for row in ranks[r].rows]
        rows += shift_rows(transfer_rows([m for r in ranks.values() for m in r.messages]), 0.0)
        losses = ranks[schedule.placement[-1]].losses
        peaks = {f"rank{r}": ranks[r].peak_memory_bytes for r in ranks} if track_memory else None
        memory = frame_from_rows([(0, f"rank{r}", t, b) for r in sorted(ranks)
                                  for t, b in ranks[r].memory], MEMORY_COLUMNS)
        by_category = frame_from_rows([(0, f"rank{r}", c, t, b) for r in sorted(ranks)
                                       for t, c, b in ranks[r].memory_by_category],
                                      CATEGORY_COLUMNS) if track_memory else None
        meta = measured_meta(plan, schedule, "torch.distributed/gloo",
                             {r: f"rank{r}" for r in range(world)}, counts[index], warmup, losses,
                             peaks, TRACKED, memory_counted=TRACKED_COUNTS,
                             threads_per_rank=threads_per_rank, pinned=bool(pin_cores))
        if pin_cores:  # where each rank ran: which core a stage had can change its pace
            meta["cores"] = {f"rank{r}": list(ranks[r].cores) for r in sorted(ranks)}
        if reference:  # the machine's speed just before the plan, the ranks' mean
            meta["reference_s"] = sum(r.reference_s for r in ranks.values()) / len(ranks)
        if track_memory:  # the tracked step's actions, beside its memory timeline
            meta["memory_actions"] = {f"rank{r}": [list(a) for a in ranks[r].memory_actions]
                                      for r in sorted(ranks)}
        out.append((RunResult(Trace(frame_from_rows(rows, MEASURED_COLUMNS), memory, meta,
                                    by_category), losses), ranks))
    return out
