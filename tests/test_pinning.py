"""Pinned ranks: each process of a run, and of the calibration that predicts it, on its own
cores -- the same cores for both (``executor.distributed.rank_cores``); and the
calibration's processes end it with an error when one dies."""

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
