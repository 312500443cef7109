"""pipesim: plan, simulate and validate pipeline-parallel training (no torch needed)."""

from pipesim.errors import (
    ClusterError,
    PipesimError,
    PlanError,
    ProfileError,
    ProfileRangeError,
    ScheduleError,
)
from pipesim.profile import LayerCost, Profile, split_sizes, synthetic_profile

__all__ = [
    "ClusterError",
    "LayerCost",
    "PipesimError",
    "PlanError",
    "Profile",
    "ProfileError",
    "ProfileRangeError",
    "ScheduleError",
    "split_sizes",
    "synthetic_profile",
]
