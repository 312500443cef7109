"""Which CPU cores this process's threads run on (Linux).

Stage threads of one process (the in-process executor, :class:`executor.pipeline.Pipeline`)
hold one interpreter in turn.  Where the operating system puts them on different cores,
every hand-over of the interpreter wakes a thread on another core, and a thread that
waited resumes on cold caches; on one core the hand-over is a switch between two threads
that share their caches::

    two cores   core 0  |F0 ....|~wake~|B0 ....|       each hand-over crosses cores
                core 1        |F1 ...|~wake~|B1 ...|
    one core    core 0  |F0 ..|F1 ..|B1 ..|B0 ..|       turns, no crossing (nor overlap)

On this project's 2-core VM (2026-11-27) the threads grid of ``experiments/
validate_threads.py`` took 0.67-0.78x as long on one core (small gpt) and 0.49-0.87x
(small mlp) as placed freely, four pairs of runs; ``experiments/switch_interval.py
--device cpu --small --placements free,one_core`` put the small gpt's checkpointed plans
at 16 micro-batches of 2 samples at 0.61-0.86x, and a plain 1F1B at 4 micro-batches,
whose operations overlap on two cores, at 1.20x.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def _every_thread(cores: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cores)


def first_cores(count: int | None) -> set[int] | None:
    """The first ``count`` cores this process may use (``ValueError`` beyond them); None
    for None (where the operating system puts the threads: :func:`threads_on`'s None)."""
    if count is None:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= count <= len(allowed):
        raise ValueError(f"cores must be 1 to {len(allowed)} (this process's cores), "
                         f"got {count}")
    return set(allowed[:count])


@contextlib.contextmanager
def threads_on(cores: set[int] | None) -> Iterator[None]:
    """Within the block every thread of this process -- those there now (``/proc/self/task``:
    the main thread, a pipeline's workers, autograd's device threads, torch's intra-op
    pool) and those started inside, which inherit it -- runs on ``cores``; after it every
    thread is back on the cores the process had.  ``None`` leaves the placement alone."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    if not cores <= before:
        raise ValueError(f"cores {sorted(cores)} are not all among this process's "
                         f"{sorted(before)}")
    _every_thread(cores)
    try:
        yield
    finally:
        _every_thread(before)
