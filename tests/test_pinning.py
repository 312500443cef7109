"""Pinned ranks: each process of a run, and of the calibration that predicts it, on its own
cores -- the same cores for both (``executor.distributed.rank_cores``); and the
calibration's processes end it with an error when one dies.  And the threads of one
process on chosen cores (``executor.cores``), stage threads started inside included."""

from __future__ import annotations

import os
import sys
import time

import pytest

from executor.calibrate import _gather
from executor.distributed import rank_cores


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_rank_cores_gives_every_rank_cores_of_this_process(world):
    mine = os.sched_getaffinity(0)
    cores = rank_cores(world)
    assert sorted(cores) == list(range(world))
    assert all(c and c <= mine for c in cores.values())
    if world <= len(mine):
        # disjoint equal slices while there are enough cores
        assert len(set().union(*cores.values())) == sum(len(c) for c in cores.values())
        assert len({len(c) for c in cores.values()}) == 1


def _report_cores(rank: int, out) -> None:
    out.put((rank, sorted(os.sched_getaffinity(0))))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sched_setaffinity")
def test_calibration_processes_run_on_the_ranks_cores_when_pinned():
    pinned = dict(_gather(_report_cores, 2, (), expected=2, pin_cores=True))
    assert pinned == {r: sorted(c) for r, c in rank_cores(2).items()}
    free = dict(_gather(_report_cores, 2, (), expected=2))
    assert all(set(c) == os.sched_getaffinity(0) for c in free.values())


def _one_dies(rank: int, out) -> None:
    if rank == 1:
        raise SystemExit(3)
    out.put(rank)


def test_a_dead_calibration_process_ends_the_calibration_at_once():
    # rank 1 dies before putting its item: the calibration raises, naming it, instead of
    # waiting out its five-minute timeout for an item that will never come
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(exit code 3\)"):
        _gather(_one_dies, 2, (), expected=2)
    assert time.monotonic() - t0 < 60  # stops, does not hang (not a speed target)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sched_setaffinity")
def test_threads_on_one_core_holds_every_thread_and_gives_them_back():
    # the stage threads of the in-process executor, started inside, run on the one core;
    # after the block they (still alive) and the main thread are back on every core
    import torch

    from executor.cores import first_cores, threads_on
    from executor.pipeline import Pipeline
    from pipesim import Plan

    mine = os.sched_getaffinity(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    pipe = Pipeline(module, Plan([1, 1], 2, 4), track_memory=False)
    try:
        with threads_on(first_cores(1)):
            assert os.sched_getaffinity(0) == first_cores(1)
            pipe.run(x, y, iterations=1, warmup=0)
            inside = [os.sched_getaffinity(t.native_id) for t in pipe.worker_threads]
        assert inside == [first_cores(1)] * 2
        after = [os.sched_getaffinity(t.native_id) for t in pipe.worker_threads]
        assert after == [mine] * 2 and os.sched_getaffinity(0) == mine
    finally:
        pipe.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sched_setaffinity")
def test_threads_on_refuses_cores_the_process_does_not_have():
    from executor.cores import first_cores, threads_on

    mine = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match="cores must be 1 to"):
        first_cores(len(mine) + 1)
    with pytest.raises(ValueError, match="cores must be 1 to"):
        first_cores(0)
    with pytest.raises(ValueError, match="not all among"), threads_on({max(mine) + 1}):
        pass
    assert os.sched_getaffinity(0) == mine
    with threads_on(None):  # nothing moves
        assert os.sched_getaffinity(0) == mine


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="sched_setaffinity on two CPUs")
def test_ranks_run_on_the_cores_named_and_a_map_must_name_every_rank():
    import functools

    from executor.distributed import spawn_plans
    from executor.models import builtin_job
    from pipesim.plan import Plan

    job = functools.partial(builtin_job, "mlp", 4, width=8, depth=1, in_features=4)
    plan = Plan([1, 1], 2, 4)
    first, second = sorted(os.sched_getaffinity(0))[:2]
    # the ranks swapped onto each other's usual cores (experiments/core_swap.py)
    (result, ranks), = spawn_plans(job, [plan], iterations=1, warmup=0, track_memory=False,
                                   pin_cores={0: {second}, 1: {first}})
    assert ranks[0].cores == (second,) and ranks[1].cores == (first,)
    assert result.trace.meta["cores"] == {"rank0": [second], "rank1": [first]}
    with pytest.raises(ValueError, match="pin_cores"):
        spawn_plans(job, [plan], pin_cores={0: {first}})
