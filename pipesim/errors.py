"""Exceptions raised by pipesim. Each names the offending value so a user can fix it."""

from __future__ import annotations


class PipesimError(Exception):
    """Base class of every error pipesim raises on purpose."""


class ProfileError(PipesimError, ValueError):
    """A profile file or table is malformed (names file, column and row)."""


class ProfileRangeError(PipesimError, ValueError):
    """A micro-batch size outside the measured range was asked for."""


class PlanError(PipesimError, ValueError):
    """A plan (balance, chunks, checkpoint, schedule, placement) is invalid."""


class ScheduleError(PipesimError, ValueError):
    """An action list is malformed or would deadlock (names the stuck actions)."""


class ClusterError(PipesimError, ValueError):
    """A cluster description is malformed."""
