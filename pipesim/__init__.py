"""pipesim: plan, simulate and validate pipeline-parallel training (no torch needed).

The main objects and functions::

    Profile.load(path)                      per-layer costs (executor.profiler writes them)
    Plan(balance, chunks, batch_size, ...)  how the model is cut and fed
    build_schedule(plan) -> Schedule        per-device action lists (GPipe, 1F1B, interleaved)
    simulate(profile, plan, cluster)        SimPy prediction -> Trace
    metrics(trace)                          iteration time, throughput, bubble, peaks
    compare(predicted, measured)            prediction against measurement
    tune(profile, n_devices, batch, budget) ranked plans under a memory budget
"""

from pipesim.cluster import Cluster, Device, Link
from pipesim.compare import Comparison, compare
from pipesim.errors import (
    ClusterError,
    PipesimError,
    PlanError,
    ProfileError,
    ProfileRangeError,
    ScheduleError,
)
from pipesim.plan import Plan
from pipesim.profile import LayerCost, Profile, split_sizes, synthetic_profile
from pipesim.schedule import Action, Schedule, build_schedule
from pipesim.simulator import Jitter, simulate
from pipesim.trace import Metrics, Trace, metrics
from pipesim.tune import TuneResult, tune

__all__ = [
    "Action",
    "Cluster",
    "ClusterError",
    "Comparison",
    "Device",
    "Jitter",
    "LayerCost",
    "Link",
    "Metrics",
    "PipesimError",
    "Plan",
    "PlanError",
    "Profile",
    "ProfileError",
    "ProfileRangeError",
    "Schedule",
    "ScheduleError",
    "Trace",
    "TuneResult",
    "build_schedule",
    "compare",
    "metrics",
    "simulate",
    "split_sizes",
    "synthetic_profile",
    "tune",
]
