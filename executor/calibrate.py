"""Calibration: measure what a profile cannot see, and write a Cluster file.

1. **Links** -- two ranks (gloo, this machine) bounce tensors of several sizes; one-way
   seconds = round trip / 2 (lower quartile of repetitions), and ``latency + bytes /
   bandwidth`` through the smallest and largest size.
2. **Per-action overhead** -- a pipeline of tiny layers (so nearly all of an action's
   time is the executor's own) runs through the multi-process executor; the overhead is
   the median of (measured action seconds - profiled seconds of the same layers).  The
   idle gaps the schedule does not explain, on a pipeline whose actions last as long as
   a pipeline's usually do: between actions whose input was there, and after a blocked
   worker's input arrives (:func:`measure_overhead`).

3. **Contention** -- one forward+backward loop alone, then in two processes at once: how
   much co-located ranks slow each other (memory bandwidth, caches, gloo's threads).
4. **Landing** -- a message arriving while its receiver computes, against between its
   steps: what gloo's receiving thread costs the step on that core, by message size
   (:func:`measure_landing`).

No step runs the plans being validated: nothing is fitted to validation runs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import statistics
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from executor.host_allocator import retain_freed_memory
from executor.models import builtin_job
from executor.transport import _work, message_group
from pipesim.cluster import Cluster, Device, Link
from pipesim.plan import Plan

SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)  # bytes
#: the workload of the host-contention calibration unless one is given: a small MLP
CALIBRATION_JOB = functools.partial(builtin_job, "mlp", 8, width=256, depth=5, in_features=256)


def _gather(target, n: int, args: tuple, expected: int, pin_cores: bool = False) -> list:
    """Run ``target(rank, *args, out)`` in ``n`` spawned processes (each on its own cores
    with ``pin_cores``, as :func:`executor.distributed.spawn` pins ranks); the first
    ``expected`` items they put on ``out``."""
    from executor.distributed import rank_cores

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    cores = rank_cores(n) if pin_cores else None
    procs = [ctx.Process(target=_on_cores, args=(cores, target, r, *args, out))
             for r in range(n)]
    for p in procs:
        p.start()
    try:
        items = [_next_item(out, procs) for _ in range(expected)]
    finally:  # bounded: a process that does not end is stopped, never waited on forever
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return items


def _next_item(out, procs: list, timeout_s: float = 300.0, poll_s: float = 0.5):
    """The next item on ``out``; raises RuntimeError as soon as one of ``procs`` has died
    (a non-zero exit code: its traceback is on stderr) rather than waiting out the
    timeout for items it will never put, and TimeoutError after ``timeout_s``."""
    from executor.distributed import dead_ranks

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return out.get(timeout=poll_s)
        except queue.Empty:
            dead = dead_ranks(procs)
            if dead:
                raise RuntimeError("calibration process(es) died: " + ", ".join(
                    f"rank {r} (exit code {code})" for r, code in dead)) from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no result from the calibration processes in "
                                   f"{timeout_s:.0f} s") from None


def _on_cores(cores: dict[int, set[int]] | None, target, rank: int, *args) -> None:
    """``target(rank, *args)`` in a spawned process, on ``cores[rank]`` if given."""
    if cores:
        os.sched_setaffinity(0, cores[rank])
    target(rank, *args)


def _posted_sends(rank: int, port: int, sizes: tuple[int, ...], repeats: int, out) -> None:
    """Rank 0 times ``isend`` to its wait of messages whose receive rank 1 has posted and
    which arrive while rank 1 computes, as a pipeline's do (receives posted ahead, the
    receiver busy with the action before): gloo writes such a message from the calling
    thread, so this is both what a send costs its sender and when it has arrived."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    result: dict[int, float] = {}
    a = torch.randn(128, 128)
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4, dtype=torch.float32)
        times = []
        for i in range(repeats + 3):  # the first ones also warm gloo up
            if rank == 1:
                work = _work(dist.irecv(buf, 0, tag=i))
                dist.barrier()  # posted before rank 0 sends
                busy = time.perf_counter() + 0.005  # computing meanwhile, 5 ms
                while time.perf_counter() < busy:
                    a = torch.tanh(a @ a)
                work.wait()
            else:
                dist.barrier()
                t0 = time.perf_counter()
                _work(dist.isend(buf, 1, tag=i)).wait()
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            dist.barrier()
        if rank == 0:
            result[nbytes] = statistics.median(times)
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def _blocked_receives(rank: int, port: int, idles: tuple[float, ...], repeats: int,
                      out) -> None:
    """Rank 1 computes for 2 ms, then blocks on a message whose receive it posted first;
    rank 0 sends it ``idle`` seconds after that computation ends (a sleep as long as the
    computation, then ``idle``).  Rank 1 puts ``{idle: seconds}``, the median from the
    send's post to its wait returning (both ``perf_counter``: one clock for every process
    on a machine; the post's time follows as a second message)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    buf, stamp = torch.zeros(1024), torch.zeros(1, dtype=torch.float64)
    a = torch.randn(128, 128)
    woken: dict[float, list[float]] = {idle: [] for idle in idles}
    tag = 0
    for i in range(repeats + 2):  # the first rounds warm gloo up
        for idle in idles:
            tag += 2
            if rank == 1:
                work = _work(dist.irecv(buf, 0, tag=tag))
                dist.barrier()
                busy = time.perf_counter() + 0.002
                while time.perf_counter() < busy:
                    a = torch.tanh(a @ a)
                work.wait()
                back = time.perf_counter()
                _work(dist.irecv(stamp, 0, tag=tag + 1)).wait()
                if i >= 2:
                    woken[idle].append(back - float(stamp[0]))
            else:
                dist.barrier()
                time.sleep(0.002 + idle)
                posted = time.perf_counter()
                _work(dist.isend(buf, 1, tag=tag)).wait()
                _work(dist.isend(torch.tensor([posted], dtype=torch.float64), 1,
                                 tag=tag + 1)).wait()
    if rank == 1:
        out.put({idle: statistics.median(t) for idle, t in woken.items()})
    dist.destroy_process_group()


#: waits (seconds) before a blocked receive whose wake-up :func:`measure_wakeups` times
WAKEUP_IDLES = (0.001, 0.003, 0.01, 0.03)


def measure_wakeups(idles: tuple[float, ...] = WAKEUP_IDLES, repeats: int = 20,
                    pin_cores: bool = False) -> tuple[tuple[float, float], ...]:
    """How much longer a blocked receiver takes to wake the longer it waited
    (:attr:`pipesim.cluster.Cluster.wakeup_curve`): two processes, one blocked on a
    4 KiB message the other sends ``idle`` seconds after the first's computation ended
    (:func:`_blocked_receives`); ``((idle, seconds beyond the shortest idle's), ...)``,
    from ``(0, 0)``, never below 0.  On this project's VM (2026-11-26, pinned, two runs):
    from the send's post to the wait's return 0.13-0.16 ms after 1 ms, 0.21-0.24 after
    3 ms, 0.30-0.36 after 10-30 ms -- an idle core sleeps deeper; the grids' own blocked
    actions alike (0.16-0.29, 0.24-0.29, 0.29-0.45 ms)."""
    idles = tuple(sorted({float(i) for i in idles}))
    if not idles or idles[0] <= 0:
        raise ValueError(f"idles must be positive seconds, got {list(idles)}")
    from executor.distributed import _free_port

    (woken,) = _gather(_blocked_receives, 2, (_free_port(), idles, repeats), expected=1,
                       pin_cores=pin_cores)
    first = woken[idles[0]]
    return ((0.0, 0.0), *((idle, max(woken[idle] - first, 0.0)) for idle in idles))


#: message sizes (bytes) :func:`measure_landing` lands in a step: a small MLP's activation,
#: a GPT block's, a U-Net's largest
LANDING_SIZES = (1 << 12, 1 << 15, 1 << 18)


def _landing_loop(rank: int, port: int, job: Callable, sizes: tuple[int, ...], rounds: int,
                  steps: int, out) -> None:
    """Rank 0 steps ``job`` (forward+backward) once a period of three steps' length; each
    step it posts the receive of a ``size``-byte message and signals rank 1, which sends it
    at once (``"landing"``: it arrives while the step computes) or after one and a half
    steps (``"between"``: while rank 0 idles after its step); rank 0 takes it after the
    step and sleeps to the period's end.  Both modes send and receive the same messages
    and idle alike; only where the message lands differs::

        landing   rank 0  |sig|== step =+=|..wait..|sleep   |sig|== step ==|...
                  rank 1       |send|                    (+: the message lands)
        between   rank 0  |sig|== step ==|   ^msg  |sleep   |sig|== step ==|...
                  rank 1                |send|

    Rank 0 puts ``{size: {"landing": [[s, ...], ...], "between": ...}}``: its steps'
    seconds, a list per round, the modes alternating every ``steps`` steps for ``rounds``
    rounds."""
    torch.set_num_threads(1)
    retain_freed_memory()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    period = torch.zeros(1, dtype=torch.float64)  # a step's seconds, rank 0's warm-up
    if rank == 0:
        module, loss_fn, x, y = job()

        def step() -> None:
            loss_fn(module(x), y).backward()

        warm = []
        for _ in range(20):
            t0 = time.perf_counter()
            step()
            warm.append(time.perf_counter() - t0)
        period[0] = statistics.median(warm[5:])
    dist.broadcast(period, 0)
    step_s = float(period[0])
    signal = torch.zeros(1)
    times: dict[int, dict[str, list[list[float]]]] = {n: {"landing": [], "between": []}
                                                      for n in sizes}
    tag = 0
    for r in range(rounds + 1):  # the first round warms gloo's connections up
        for nbytes in sizes:
            buf = torch.zeros(max(nbytes // 4, 1))
            for mode in ("landing", "between"):
                block: list[float] = []
                for _ in range(steps):
                    tag += 1
                    if rank == 1:
                        _work(dist.irecv(signal, 0, tag=tag)).wait()
                        if mode == "between":
                            time.sleep(1.5 * step_s)
                        _work(dist.isend(buf, 0, tag=tag)).wait()
                        continue
                    work = _work(dist.irecv(buf, 1, tag=tag))
                    _work(dist.isend(signal, 1, tag=tag)).wait()
                    t0 = time.perf_counter()
                    step()
                    t1 = time.perf_counter()
                    work.wait()
                    block.append(t1 - t0)
                    rest = t0 + 3 * step_s - time.perf_counter()
                    if rest > 0:
                        time.sleep(rest)
                if r and rank == 0:
                    times[nbytes][mode].append(block)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def measure_landing(sizes: tuple[int, ...] = LANDING_SIZES, rounds: int = 20, steps: int = 10,
                    job: Callable = CALIBRATION_JOB, pin_cores: bool = False
                    ) -> dict[str, Any]:
    """What a message costs the step it lands in (:attr:`pipesim.cluster.Cluster.landing_s`,
    ``landing_byte_s``): two processes, one stepping ``job`` while the other's message of
    each of ``sizes`` bytes lands mid-step or between steps (:func:`_landing_loop`).  Per
    size the median over rounds of each round's median step landing less its median
    between (seconds, ``"by_size"``: paired within seconds, so the machine's drift
    cancels), and ``landing_s + landing_byte_s * bytes`` through them (the least-squares
    slope, the intercept the residuals' median), neither below 0.  A micro-benchmark on
    the calibration pipeline's workload, never the plans validated."""
    sizes = tuple(sorted({int(n) for n in sizes}))
    if not sizes or sizes[0] < 4:
        raise ValueError(f"sizes must be at least 4 bytes, got {list(sizes)}")
    from executor.distributed import _free_port

    (times,) = _gather(_landing_loop, 2, (_free_port(), job, sizes, rounds, steps),
                       expected=1, pin_cores=pin_cores)
    by_size = {n: statistics.median(statistics.median(a) - statistics.median(b)
                                    for a, b in zip(t["landing"], t["between"], strict=True))
               for n, t in times.items()}
    if len(sizes) > 1:
        slope, intercept = np.polyfit(np.array(sizes, dtype=float),
                                      np.array([by_size[n] for n in sizes]), 1)
        slope = max(float(slope), 0.0)
        intercept = max(float(np.median([by_size[n] - slope * n for n in sizes])), 0.0)
    else:
        slope, intercept = 0.0, max(by_size[sizes[0]], 0.0)
    return {"landing_s": intercept, "landing_byte_s": slope, "by_size": by_size,
            "step_s": statistics.median(t for n in sizes for block in times[n]["between"]
                                        for t in block)}


def measure_link(sizes: tuple[int, ...] = SIZES, repeats: int = 20,
                 pin_cores: bool = False) -> tuple[Link, dict[int, float]]:
    """Fit a gloo loopback link between two processes; returns it and the raw medians.

    Timed as the pipeline's sends meet it, their receive posted (:func:`_posted_sends`):
    the median seconds a message takes its sender, which is when it has arrived.  (A
    ping-pong's best quartile, used until 2026-11-23, read 5.7 GB/s where a posted send
    occupies its sender at about 2 GB/s on this project's VM.)"""
    from executor.distributed import _free_port

    (one_way,) = _gather(_posted_sends, 2, (_free_port(), sizes, repeats), expected=1,
                         pin_cores=pin_cores)
    # Two points, robust to one noisy size: latency from the smallest message, bandwidth
    # from the growth between the smallest and the largest.
    small, large = min(one_way), max(one_way)
    latency = min(one_way[b] for b in sorted(one_way)[:2])
    growth = one_way[large] - one_way[small]
    bandwidth = (large - small) / growth if growth > 0 else float("inf")
    return Link(float(latency), float(bandwidth)), one_way


def unexplained_gaps(actions, latency_s: float = 0.0) -> list[tuple[float, bool]]:
    """``(seconds, blocked)`` for each compute action: how much later it started than it
    could have, and whether its worker was blocked on its input by then.

    An action could start at ``max(end of the previous action on its device, arrival of
    its input)``; arrival is the producing action's end plus ``latency_s``.  What is left
    is the executor's own time between actions (posting sends, bookkeeping), the
    operating system's preemptions and, where the input came after the previous action
    ended (``blocked``), the time to wake the thread that waited for it.
    """
    out = []
    for _, it in actions[actions.kind.isin(["F", "B"])].groupby("iteration"):
        end = {(r.stage, r.kind, r.microbatch): r.end for r in it.itertuples()}
        n = int(it.stage.max()) + 1
        for _, part in it.groupby("device"):
            prev = None
            for r in part.sort_values("start").itertuples():
                arrival = None
                if r.kind == "F" and r.stage > 0:
                    arrival = end[(r.stage - 1, "F", r.microbatch)] + latency_s
                if r.kind == "B" and r.stage < n - 1:
                    arrival = end[(r.stage + 1, "B", r.microbatch)] + latency_s
                ready = [t for t in (prev, arrival) if t is not None]
                if ready:
                    blocked = arrival is not None and (prev is None or arrival > prev)
                    out.append((max(0.0, r.start - max(ready)), blocked))
                prev = r.end
    return out


def measure_overhead(iterations: int = 24, latency_s: float = 0.0,
                     pin_cores: bool = False) -> dict[str, Any]:
    """Per-action executor overhead (seconds), from two calibration pipelines on 2 ranks.

    Both are small MLPs, 1F1B over 8 micro-batches, unrelated to the plans being
    validated.  In-action overhead: measured action seconds over the profiled seconds of
    the same layers (median), on the *tiny* one (width 256, micro-batches of 4: actions of
    0.2-0.3 ms, so that what the executor adds is not lost in the compute or mixed with
    the ranks slowing each other, which ``host_contention`` measures).  Between actions:
    the *mean* unexplained wait (:func:`unexplained_gaps`) on the *paced* one (width 512,
    micro-batches of 8: actions of 0.5-0.7 ms, the order of a pipeline's), apart for
    actions whose input was there when their worker reached them (``between_actions_s``,
    the cluster's ``action_gap_s``) and for those whose worker blocked on the input first
    (``wakeup_s``, ``wakeup_gap_s``).

    On a loaded 2-core machine the mean is several times the median, because rare
    preemptions of milliseconds land between actions; they are real time lost, and with
    the median even replaying a run's own durations fell 17% short (experiments/validate.py),
    with the mean within 7%.  A woken thread waits longest, and the longer the shorter
    the wait before (2026-11-24, three runs each, medians 0.1-0.3 ms throughout):

        actions of    woken (mean)    input there (mean)
        0.2-0.3 ms    0.79-0.89 ms    0.32-0.36 ms     (the tiny pipeline, which
        0.5-0.7 ms    0.42-0.62 ms    0.21-0.35 ms      measured the gaps until
        2.5-2.8 ms    0.47-0.58 ms    0.35-0.42 ms      2026-11-24)

    The grid's own blocked actions (GPT, MLP) waited 0.42-0.50 ms, the others 0.23-0.26 ms.
    One mean for both over-charged plans whose inputs queue up (GPipe's later stages) and
    under-charged those that wait at every step.  The median of all is reported too.
    """
    return {**measure_gaps(iterations, latency_s, pin_cores),
            "in_action_s": measure_in_action(iterations, pin_cores)}


def measure_in_action(iterations: int = 24, pin_cores: bool = False) -> float:
    """The in-action overhead of :func:`measure_overhead` alone (seconds): its *tiny*
    pipeline profiled, then run.  One reading is one moment's: on this project's VM ten
    grids' calibrations read 0.0-0.20 ms, most 0.035-0.065 ms (2026-11-24)."""
    from executor.profiler import profile

    job, plan = _calibration_pipeline(256, 4)  # tiny: the in-action overhead
    module, loss_fn, x, y = job()
    prof = profile(module, (x, y), list(plan.micro_batch_sizes[:1]), loss_fn=loss_fn,
                   repeats=20, warmup=5, progress=False)
    return _in_action(_run(job, plan, iterations, pin_cores), prof, plan)


def measure_gaps(iterations: int = 24, latency_s: float = 0.0, pin_cores: bool = False,
                 width: int = 512, micro_batch: int = 8) -> dict[str, Any]:
    """The gaps of :func:`measure_overhead` alone (its *paced* pipeline: no profile needed),
    seconds: ``between_actions_s``, ``wakeup_s``, ``between_actions_all_s`` (means) and
    ``between_actions_median_s``; and ``action_s``, the median compute action.  ``width``
    and ``micro_batch`` change the pipeline (messages of ``width * micro_batch`` floats;
    the calibration's own is 512 x 8: 16 KiB)."""
    job, plan = _calibration_pipeline(width, micro_batch)
    actions = _run(job, plan, iterations, pin_cores)
    compute = actions[actions.kind.isin(["F", "B"])]
    return {**_gap_means(actions, latency_s),
            "action_s": float((compute.end - compute.start).median()),
            "executor_gap_s": calibration_executor_gap(pin_cores, width, micro_batch),
            "wakeup_curve": measure_wakeups(pin_cores=pin_cores)}


def calibration_executor_gap(pin_cores: bool = False, width: int = 512,
                             micro_batch: int = 8) -> float:
    """The executor's own seconds around each action of the calibration pipeline
    (:func:`measure_gaps`'), its stages in place (:func:`executor.in_place.stage_costs`,
    mean of the two): how much of the gaps measured on it is the executor's Python, which
    a stage measured in place replaces with its own
    (:attr:`pipesim.cluster.Cluster.executor_gap_base_s`).  0.04 ms on this project's VM
    (2026-11-26), against gaps of 0.15 ms."""
    from executor.in_place import stage_costs

    job, plan = _calibration_pipeline(width, micro_batch)
    rows = stage_costs(job, plan.balance, [micro_batch], modes=("never",), pin_cores=pin_cores)
    return statistics.fmean(r["between_s"] for r in rows)


def _calibration_pipeline(width: int, micro_batch: int) -> tuple[Callable, Plan]:
    """The job and Plan of a 2-rank 1F1B pipeline of an MLP ``width`` wide (6 layers, 3 a
    stage) over 8 micro-batches of ``micro_batch`` samples."""
    torch.set_num_threads(1)
    batch = 8 * micro_batch
    job = functools.partial(builtin_job, "mlp", batch, width=width, depth=5, in_features=width)
    return job, Plan([3, 3], 8, batch, checkpoint="never", schedule="1f1b")


def _run(job: Callable, plan: Plan, iterations: int, pin_cores: bool = False):
    """The measured actions of ``plan`` run through the multi-process executor."""
    from executor.distributed import spawn

    result, _ = spawn(job, plan, iterations=iterations, warmup=2, pin_cores=pin_cores)
    return result.trace.actions


def _in_action(actions, prof, plan) -> float:
    """Median excess (seconds) of the measured compute actions over the profiled seconds
    of the same layers, at least 0."""
    size = plan.micro_batch_sizes[0]
    excess = []
    for r in actions[actions.kind.isin(["F", "B"])].itertuples():
        cost = prof.span_cost(plan.stage_layers(r.stage).start, plan.stage_layers(r.stage).stop,
                              size)
        excess.append((r.end - r.start) - (cost.fwd_s if r.kind == "F" else cost.bwd_s))
    return max(statistics.median(excess), 0.0)


def _gap_means(actions, latency_s: float = 0.0) -> dict[str, float]:
    """Means of the gaps between actions (:func:`unexplained_gaps`): where the input was
    there, after a wake-up, all of them; and the median of all."""
    gaps = unexplained_gaps(actions, latency_s)
    every = [g for g, _ in gaps]
    ready = [g for g, blocked in gaps if not blocked] or every
    woken = [g for g, blocked in gaps if blocked] or every
    return {"between_actions_all_s": float(np.mean(every)) if every else 0.0,
            "between_actions_s": float(np.mean(ready)) if ready else 0.0,
            "wakeup_s": float(np.mean(woken)) if woken else 0.0,
            "between_actions_median_s": float(np.median(every)) if every else 0.0}


def _overheads(actions, prof, plan, latency_s: float = 0.0) -> dict[str, float]:
    """In-action overhead (median excess over the profile) and gaps between actions."""
    return {"in_action_s": _in_action(actions, prof, plan), **_gap_means(actions, latency_s)}


def calibrate_cpu(n_devices: int = 2, *, threads_per_rank: int = 1,
                  name: str = "calibrated_cpu_processes",
                  overheads: dict[str, Any] | None = None,
                  pin_cores: bool = False) -> Cluster:
    """A Cluster for ``n_devices`` CPU processes on this machine, measured (seconds, B/s).

    The host runs ``cores // threads_per_rank`` ranks' compute at once (``host_cores``);
    the contention between ranks is measured with no more ranks than that, so that it
    says what sharing memory, caches and communication threads costs, and the time
    slicing of more ranks than cores is the host law's (:func:`pipesim.contention.host_law`).
    ``overheads``, if given, receives :func:`measure_overhead`'s figures (the gaps'
    medians and their mean over all actions beside what the cluster keeps) and
    :func:`measure_landing`'s (``"landing"``: what a message costs the step it lands in).
    ``pin_cores``: every measurement with each rank on its own cores, as a run spawned
    with ``pin_cores`` places them (:func:`executor.distributed.rank_cores`).
    """
    link, _ = measure_link(pin_cores=pin_cores)
    over = measure_overhead(latency_s=link.latency_s, pin_cores=pin_cores)
    landing = measure_landing(pin_cores=pin_cores)
    if overheads is not None:
        overheads.update(over)
        overheads["landing"] = landing
    slots = _slots(threads_per_rank)
    return Cluster([Device(f"rank{i}", host="localhost") for i in range(n_devices)], link=link,
                   compute_overhead_s=over["in_action_s"], action_gap_s=over["between_actions_s"],
                   wakeup_gap_s=over["wakeup_s"], executor_gap_base_s=over["executor_gap_s"],
                   wakeup_curve=over["wakeup_curve"],
                   host_contention=host_contention(n_devices, threads_per_rank,
                                                   pin_cores=pin_cores), host_cores=slots,
                   landing_s=landing["landing_s"], landing_byte_s=landing["landing_byte_s"],
                   # the gloo transport (executor.transport): sends kept, every receive
                   # posted as the step starts (StageRunner), and a send written from the
                   # sender's own thread
                   sender_keeps_sends=True, receives_ahead=True, receives_after_inputs=True,
                   receives_at_start=True, blocking_sends=True,
                   name=name)


def host_contention(n_devices: int, threads_per_rank: int = 1, steps: int = 10,
                    job: Callable = CALIBRATION_JOB, iterations: int = 200,
                    pin_cores: bool = False, messages: str = "echo") -> float:
    """``host_contention`` for ``n_devices`` ranks here: :func:`measure_contention` with as
    many ranks as the run has (up to the host's slots, at least 2), in a ring, alone and
    together alternating every ``steps`` steps (10 of the calibration MLP: phases of a few
    ms, as long as a pipeline's actions), every step followed by a message alone and
    together (``messages``), on ``job``'s workload; the median of three."""
    ranks = max(min(n_devices, _slots(threads_per_rank)), 2)
    return statistics.median(
        measure_contention(ranks, iterations, steps, job, pin_cores,
                           messages)["host_contention"]
        for _ in range(3))


def _slots(threads_per_rank: int) -> int:
    """Ranks this host computes for at once: its cores over the threads each rank uses."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, threads_per_rank))


def measure_thread_overhead(device: str = "cuda:0", n_workers: int = 2,
                            iterations: int = 10, readings: int = 3) -> dict:
    """Per-action overhead of the in-process executor on ``device`` (all workers on it).

    Same method as :func:`measure_overhead`, on a pipeline of tiny layers whose compute
    is negligible, so measured action time beyond the profile and unexplained waits are
    the executor's (kernel launches from Python, stream waits, thread hand-over).

    One reading is one moment's: the tiny pipeline's actions last a fraction of a
    millisecond, and the in-action figure is their excess over a profile of the same
    tiny layers, a difference of two noisy things.  Four readings taken in one H100 run
    (2026-11-22, ``traces/*/cluster.json`` of the recorded evidence, one per model) read
    0.0, 0.001, 0.064 and 0.185 ms; the gaps between actions agreed within 10%.  So the
    tiny pipeline is profiled and run ``readings`` times and each figure is the median of
    its readings (seconds); ``in_action_readings`` keeps them all.
    """
    from executor.pipeline import Pipeline
    from executor.profiler import profile
    from pipesim.balance import even_balance

    if readings < 1:
        raise ValueError(f"readings must be at least 1, got {readings}")
    module, loss_fn, x, y = builtin_job("mlp", 32, width=64, depth=2 * n_workers + 1,
                                        in_features=64)
    plan = Plan(even_balance(len(module), n_workers), 8, 32, checkpoint="never", schedule="1f1b")
    taken = []
    for _ in range(readings):
        with warnings.catch_warnings():
            # tiny layers' repetitions spread widely on any host; the readings' median is
            # what the noise is answered with, not a warning to the user
            warnings.filterwarnings("ignore", message="profile: .* noisy measurement")
            prof = profile(module, (x, y), [4], device, loss_fn=loss_fn, repeats=20,
                           warmup=5, progress=False)
        with Pipeline(module, plan, devices=[device] * n_workers, loss_fn=loss_fn,
                      track_memory=False) as pipe:
            actions = pipe.run(x, y, iterations=iterations, warmup=3).trace.actions
        taken.append(_overheads(actions, prof, plan))
    return {**{key: statistics.median(r[key] for r in taken) for key in taken[0]},
            "in_action_readings": [r["in_action_s"] for r in taken]}


def calibrate_threads(device: str = "cuda:0", n_workers: int = 2, readings: int = 3) -> Cluster:
    """The cluster of the in-process executor (:class:`executor.pipeline.Pipeline`):
    ``n_workers`` stage threads of this process, every stage on ``device``, with the
    executor's overheads measured there (:func:`measure_thread_overhead`; seconds).

    * On an accelerator the workers share its compute, their kernels running at once
      (:meth:`pipesim.cluster.Cluster.shared_gpu`, by the device's concurrency law: the one
      a profile measured with ``streams=n_workers``, which folds the threads' shared
      interpreter in, else the one its size scaling implies).
    * On the CPU each worker computes on a core of its own (workers beyond this process's
      cores share them in turn) and the workers hold one interpreter, for the shares a
      profile measured with ``interpreter=True`` (:attr:`pipesim.cluster.Device.process`).

    What ``gpu_validate.py`` and ``validate_threads.py`` predict their grids with; the
    costs of each stage in place (:func:`executor.in_place.device_stage_costs`) add to it.
    """
    dev = torch.device(device)
    over = measure_thread_overhead(device, n_workers, readings=readings)
    if dev.type == "cpu":
        cluster = Cluster.cpu_threads(n_workers, cores=len(os.sched_getaffinity(0)))
    else:
        cluster = Cluster.shared_gpu(n_workers)
        memory = (torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda"
                  else cluster.devices[0].memory_bytes)
        cluster = dataclasses.replace(cluster, devices=[
            dataclasses.replace(d, physical=str(dev), memory_bytes=memory)
            for d in cluster.devices])
    return dataclasses.replace(cluster, compute_overhead_s=over["in_action_s"],
                               action_gap_s=over["between_actions_s"],
                               wakeup_gap_s=over["wakeup_s"])


def overheads_text(cluster: Cluster) -> str:
    """The executor's overheads of ``cluster`` in one line, in milliseconds."""
    text = (f"overhead {cluster.compute_overhead_s * 1e3:.3f} ms in an action, "
            f"{cluster.action_gap_s * 1e3:.3f} ms between actions, "
            f"{cluster.wakeup_s * 1e3:.3f} ms after a wake-up")
    if cluster.landing_s or cluster.landing_byte_s:
        text += (f", {cluster.landing_s * 1e3:.3f} ms + {cluster.landing_byte_s * 1e9:.3f} "
                 "ms/MB a message landing in an action")
    return text


#: how the host-contention calibration's steps meet messages (see :func:`_contention_loop`)
MESSAGES = ("echo", "ring", "none")


def _contention_loop(rank: int, barrier, rounds: int, steps: int, world: int, port: int,
                     job: Callable, messages: str, out) -> None:
    """Time forward+backward of ``job``'s model alone and beside the other ranks, in
    alternation: each round has a phase per rank in which that rank computes ``steps``
    steps while the others wait at the barrier, then one in which all compute.  Only the
    compute is timed.  ``messages`` (:data:`MESSAGES`) says what a step is followed by::

        "ring"  alone     |step|step|step|          after a step, the next step
                together  |step|msg|step|msg|      after a wait for a message
        "echo"  alone     |step|msg|step|msg|      the next rank, idle, sends it back
                together  |step|msg|step|msg|      both wait alike
        "none"  alone     |step|step|step|
                together  |step|step|step|          the neighbour's compute alone

    ``msg``: an activation-sized tensor passed round a ring over gloo (together) or to the
    next rank and back (alone), messages up and down over a group each, as the pipelines
    send them (their communication threads share the cores too).  ``"ring"`` was the
    calibration until 2026-11-29; it reads the cost of the wait before a step as well,
    which the model holds apart (idle costs, the wake-up) -- on the project's 2-core VM
    ``ring`` 0.237-0.239, ``echo`` 0.107-0.151, ``none`` 0.017-0.027
    (``experiments/contention_waits.py``, two runs of 20 rounds, medians)."""
    from executor.distributed import directional_groups

    torch.set_num_threads(1)
    retain_freed_memory()
    groups = (None, None)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        groups = directional_groups()
    module, loss_fn, x, y = job()
    message, inbox = torch.randn(8, 256), torch.empty(8, 256)
    peer, source = (rank + 1) % world, (rank - 1) % world

    def exchange(dst: int, src: int) -> None:
        works = [dist.isend(message, dst, group=message_group(groups, rank, dst)),
                 dist.irecv(inbox, src, group=message_group(groups, src, rank))]
        for work in works:
            if work is not None:
                work.wait()

    for _ in range(5):
        loss_fn(module(x), y).backward()
    alone: list[float] = []
    together: list[float] = []
    talk = messages != "none" and world > 1
    for _ in range(rounds):
        for phase in range(world + 1):  # phase r < world: rank r alone; world: all of them
            barrier.wait()
            if phase not in (rank, world):
                if messages == "echo" and talk and rank == (phase + 1) % world:
                    for _ in range(steps):  # the alone rank's message straight back
                        dist.recv(inbox, phase, group=message_group(groups, phase, rank))
                        dist.send(inbox, phase, group=message_group(groups, rank, phase))
                continue
            for _ in range(steps):
                t0 = time.perf_counter()
                loss_fn(module(x), y).backward()
                (together if phase == world else alone).append(time.perf_counter() - t0)
                if talk and phase == world:
                    exchange(peer, source)
                elif talk and messages == "echo":
                    exchange(peer, peer)
    out.put((rank, statistics.median(alone), statistics.median(together)))
    if world > 1:
        dist.destroy_process_group()


def measure_contention(workers: int = 2, iterations: int = 200, steps: int = 10,
                       job: Callable = CALIBRATION_JOB, pin_cores: bool = False,
                       messages: str = "echo") -> dict[str, float]:
    """How much ``workers`` processes computing at once slow each other (``host_contention``).

    ``job`` gives the workload, ``(module, loss_fn, inputs, targets)`` (picklable: a
    ``functools.partial`` of :func:`executor.models.builtin_job`): by default a small MLP;
    a model's own layers say how much *that* model's ranks slow each other (memory
    bandwidth and caches: on this VM U-Net's overlapped actions ran 1.1-1.4x their
    profile, MLP's 1.0x, in one grid).
    ``workers`` processes run the same forward+backward loop, each alone in turn and all
    together, alternating every ``steps`` steps for ``iterations`` steps of each kind (see
    :func:`_contention_loop`); ``contention = (together / alone - 1) / (workers - 1)`` from
    the compute times alone.  ``messages``: what each step is followed by (``"echo"``, the
    default: a message after every step, alone too, so that alone and together wait
    alike; ``"ring"``: messages only together, as before 2026-11-29; ``"none"``).
    A separate measurement, never the plans being validated.
    Alone and together alternate within seconds, so a neighbour's load on a shared machine
    weighs on both alike: measured one after the other (this function until 2026-11-23)
    four readings in a row on this project's 2-core VM gave 0.78, 0.24, 0.0 and 0.60,
    where the actions of a 2-rank pipeline grid that overlapped the other rank's ran only
    10-24% over those that did not.
    """
    from executor.distributed import _free_port

    if workers < 2:
        raise ValueError(f"contention needs at least 2 workers, got {workers}")
    if messages not in MESSAGES:
        raise ValueError(f"messages must be one of {MESSAGES}, got {messages!r}")
    rounds = max(1, -(-iterations // steps))
    barrier = mp.get_context("spawn").Barrier(workers)
    results = _gather(_contention_loop, workers,
                      (barrier, rounds, steps, workers, _free_port(), job, messages),
                      expected=workers,
                      pin_cores=pin_cores)
    alone = statistics.median(a for _, a, _ in results)
    together = statistics.median(t for _, _, t in results)
    return {"alone_s": alone, "together_s": together,
            "host_contention": max(together / alone - 1.0, 0.0) / (workers - 1)}
