"""The reserved-memory estimate: the caching allocator's rules and what the tuner makes of them."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipesim.allocator import CUDA_H100, CachingAllocator, MiB, allocated_peaks, reserved_peaks
from pipesim.cluster import Cluster
from pipesim.errors import PlanError
from pipesim.plan import Plan
from pipesim.simulator import simulate
from pipesim.trace import metrics
from pipesim.tune import tune
from tests.helpers import uniform_profile

#: no rounding, no fragmentation, no workspace: reserved is exactly the peak allocated
EXACT = CachingAllocator(large_round=1, fragmentation=0.0)


def test_a_request_opens_the_segment_the_cuda_allocator_documents():
    cuda = CachingAllocator()
    assert cuda.segment_bytes(100) == 2 * MiB  # small pool
    assert cuda.segment_bytes(1 * MiB) == 2 * MiB
    assert cuda.segment_bytes(1 * MiB + 1) == 20 * MiB  # up to 10 MiB: 20 MiB segments
    assert cuda.segment_bytes(10 * MiB) == 10 * MiB  # larger: their own, rounded to 2 MiB
    assert cuda.segment_bytes(11 * MiB + 1) == 12 * MiB


def test_reserved_is_static_and_dynamic_peak_rounded_with_workspaces_and_fragmentation():
    a = CachingAllocator(workspace_bytes=4 * MiB, fragmentation=0.5)
    # static 3 MiB + 1 byte -> 4 MiB; (10 + 2 streams x 4) x 1.5 = 27 MiB -> 28 MiB
    assert a.reserved(3 * MiB + 1, 10 * MiB, streams=2) == 4 * MiB + 28 * MiB
    assert a.reserved(0, 0, streams=0) == 0
    with pytest.raises(ValueError, match="fragmentation"):
        CachingAllocator(fragmentation=-0.1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(balance=st.sampled_from([[1, 3], [2, 2], [3, 1]]), chunks=st.sampled_from([1, 2, 4]),
       checkpoint=st.sampled_from(["never", "always", "except_last"]),
       schedule=st.sampled_from(["gpipe", "1f1b"]))
def test_reserved_holds_the_peak_allocated_and_equals_it_without_waste(balance, chunks,
                                                                       checkpoint, schedule):
    plan = Plan(balance, chunks, 4, checkpoint=checkpoint, schedule=schedule)
    trace = simulate(uniform_profile(4, sizes=(1, 4)), plan, Cluster.shared_gpu(2), iterations=2)
    peaks = metrics(trace).peak_memory_bytes
    assert reserved_peaks(trace, EXACT) == pytest.approx(peaks)
    estimate = reserved_peaks(trace, CUDA_H100)
    # two workers' streams on the one GPU, each with its workspaces
    assert estimate["cuda:0"] >= peaks["cuda:0"] + 2 * CUDA_H100.workspace_bytes


def test_a_fresh_process_allocates_each_streams_workspaces_beside_the_peak():
    a = CachingAllocator(workspace_bytes=4 * MiB)
    assert a.allocated(10 * MiB, streams=2) == 18 * MiB
    assert EXACT.allocated(10 * MiB, streams=3) == 10 * MiB  # no workspace: the peak
    # both stages on one GPU: two streams; one stage a GPU: one each
    for cluster, streams in ((Cluster.shared_gpu(2), {"cuda:0": 2}),
                             (Cluster.nvlink_gpus(2), {"cuda:0": 1, "cuda:1": 1})):
        trace = simulate(uniform_profile(4, sizes=(1, 4)), Plan([2, 2], 4, 4), cluster)
        peaks = metrics(trace).peak_memory_bytes
        assert allocated_peaks(trace) == pytest.approx(
            {d: peaks[d] + streams[d] * CUDA_H100.workspace_bytes for d in peaks})
        assert allocated_peaks(trace, EXACT) == pytest.approx(peaks)


def test_reserved_needs_the_memory_per_category():
    trace = simulate(uniform_profile(2, sizes=(1, 2)), Plan([1, 1], 2, 2), track_memory=False)
    with pytest.raises(ValueError, match="memory per category"):
        reserved_peaks(trace)


def test_the_tuner_holds_a_gpus_estimated_reserved_within_the_budget():
    prof = uniform_profile(4, sizes=(1, 8), act_bytes=MiB, saved_bytes=3 * MiB,
                           param_bytes=8 * MiB)
    gpu = Cluster.shared_gpu(2)
    workspaces = CachingAllocator(workspace_bytes=16 * MiB)
    loose = tune(prof, 2, 8, 1e12, cluster=gpu, allocator=workspaces)
    assert (loose.table.reserved_bytes > loose.table.peak_bytes * 1.1).all()
    # a budget every plan's peak fits with its margin, but not the cheapest's reserved
    budget = float(loose.table.peak_bytes.min() * 1.1 + 1)
    smallest = loose.table.reserved_bytes.min()
    assert smallest > budget
    with pytest.raises(PlanError, match="estimated reserved"):
        tune(prof, 2, 8, budget, cluster=gpu, allocator=workspaces)
    # on CPU workers nothing is reserved beyond the tensors: the same budget fits
    cpu = tune(prof, 2, 8, budget, cluster=Cluster.free(2))
    assert cpu.table.reserved_bytes.isna().all() and cpu.plans
    # and every plan the GPU tuning returns fits by both measures
    roomy = tune(prof, 2, 8, float(smallest), cluster=gpu, allocator=workspaces)
    chosen = roomy.table[roomy.table.fits]
    assert len(chosen) and (chosen.reserved_bytes <= smallest).all()
