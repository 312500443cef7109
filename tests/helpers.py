"""Shared test fixtures (no torch needed)."""

from __future__ import annotations

from pipesim.profile import synthetic_profile

#: identical layers, costs linear in the micro-batch size (see synthetic_profile)
uniform_profile = synthetic_profile
