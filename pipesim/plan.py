"""The Plan: how a model is cut and fed through a pipeline.

A Plan is plain data: which layers form each stage (``balance``), how many micro-batches
(``chunks``) a ``batch_size`` batch is split into, which micro-batches are checkpointed,
which schedule orders the work, and on which device (worker) each stage runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

from pipesim.errors import PlanError
from pipesim.profile import split_sizes

#: torchgpipe's checkpoint modes: how many leading micro-batches recompute their forward.
CHECKPOINT_MODES = ("always", "except_last", "never")

#: Adam keeps two moments (2 bytes of state per parameter byte); SGD with momentum one.
OPTIMIZER_STATE = {"adam": 2.0, "sgd": 0.0, "momentum": 1.0}


#: schedules whose two stages a device sit in a V (see :func:`v_placement`)
V_SCHEDULES = ("zbv",)


def v_placement(n_devices: int) -> tuple[int, ...]:
    """Stage -> device of a V: stages ``0..n-1`` down the devices, ``n..2n-1`` back up, so
    device ``d`` holds stages ``d`` and ``2n - 1 - d`` (the first and the last on device 0)."""
    return tuple(range(n_devices)) + tuple(reversed(range(n_devices)))


@dataclass(frozen=True)
class Plan:
    """A pipeline plan.

    balance
        layers per stage, in order; ``sum(balance)`` is the model's length.
    chunks
        requested micro-batches; the batch splits as ``torch.Tensor.chunk`` does, so
        ``n_microbatches`` can be smaller (10 samples in 4 chunks -> 3, 3, 3, 1).
    batch_size
        samples per iteration (mini-batch).
    checkpoint
        ``always`` (every micro-batch recomputes its forward in backward),
        ``except_last`` (all but the last), ``never``.
    schedule
        ``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1``, ``zb-h2`` or ``zbv`` (see
        :mod:`pipesim.schedule`).
    placement
        device (worker) index of each stage.  Default: stage ``s`` on device ``s``, or
        ``s % n_devices`` for interleaved schedules (``virtual_stages`` stages a device),
        or the V of :func:`v_placement` for ``zbv``.
    virtual_stages
        stages per device for interleaved schedules (``v``).
    optimizer
        name in :data:`OPTIMIZER_STATE`, or bytes of state per parameter byte.  Default
        ``"sgd"`` (no state): what pipesim's executor holds, so a prediction and a run
        of the same Plan count the same memory; say ``"adam"`` to plan a training run.
    """

    balance: Sequence[int]  # stored as a tuple
    chunks: int
    batch_size: int
    checkpoint: str = "except_last"
    schedule: str = "gpipe"
    placement: Sequence[int] | None = None  # stored as a tuple
    virtual_stages: int = 1
    optimizer: str | float = "sgd"
    extras: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "balance", tuple(int(b) for b in self.balance))
        if self.placement is not None:
            object.__setattr__(self, "placement", tuple(int(d) for d in self.placement))
        self._check()

    # ----------------------------------------------------------------- checks
    def _check(self) -> None:
        if not self.balance:
            raise PlanError("balance is empty: give the number of layers of each stage")
        bad = [b for b in self.balance if b < 1]
        if bad:
            raise PlanError(f"balance {list(self.balance)} has non-positive entries {bad}; "
                            "every stage needs at least one layer")
        if not isinstance(self.chunks, int) or self.chunks < 1:
            raise PlanError(f"chunks must be an integer of at least 1, got {self.chunks!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise PlanError(f"batch_size must be an integer of at least 1, got {self.batch_size!r}")
        if self.chunks > self.batch_size:
            raise PlanError(f"chunks {self.chunks} is larger than the batch size {self.batch_size}")
        if self.checkpoint not in CHECKPOINT_MODES:
            raise PlanError(f"unknown checkpoint mode {self.checkpoint!r}; "
                            f"choose one of {', '.join(CHECKPOINT_MODES)}")
        if self.virtual_stages < 1 or self.n_stages % self.virtual_stages:
            raise PlanError(f"virtual_stages {self.virtual_stages} must divide the "
                            f"{self.n_stages} stages")
        placement = self.stage_devices
        if len(placement) != self.n_stages:
            raise PlanError(f"placement {list(placement)} names {len(placement)} devices for "
                            f"{self.n_stages} stages")
        if min(placement) < 0:
            raise PlanError(f"placement {list(placement)} has a negative device index")
        missing = sorted(set(range(max(placement) + 1)) - set(placement))
        if missing:
            raise PlanError(f"placement {list(placement)} leaves device(s) {missing} without a stage")
        if isinstance(self.optimizer, str) and self.optimizer not in OPTIMIZER_STATE:
            raise PlanError(f"unknown optimizer {self.optimizer!r}; choose one of "
                            f"{sorted(OPTIMIZER_STATE)} or give state bytes per parameter byte")

    def check_layers(self, n_layers: int) -> None:
        """Raise :class:`PlanError` unless the balance covers exactly ``n_layers`` layers."""
        total = sum(self.balance)
        if total != n_layers:
            raise PlanError(f"balance {list(self.balance)} sums to {total} layers but the model "
                            f"has {n_layers}")

    # ------------------------------------------------------------- derived
    @property
    def n_stages(self) -> int:
        return len(self.balance)

    @property
    def stage_devices(self) -> tuple[int, ...]:
        """Device (worker) index of every stage."""
        if self.placement is not None:
            return tuple(self.placement)
        n_devices = self.n_stages // self.virtual_stages
        if self.schedule in V_SCHEDULES and self.virtual_stages == 2:
            return v_placement(n_devices)
        return tuple(s % n_devices for s in range(self.n_stages))

    @property
    def n_devices(self) -> int:
        return max(self.stage_devices) + 1

    @cached_property
    def micro_batch_sizes(self) -> tuple[int, ...]:
        """Samples in each micro-batch, as ``tensor.chunk(chunks)`` splits the batch."""
        return tuple(split_sizes(self.batch_size, self.chunks))

    @property
    def n_microbatches(self) -> int:
        return len(self.micro_batch_sizes)

    def stage_layers(self, stage: int) -> range:
        """Layer indices of ``stage``."""
        first = sum(self.balance[:stage])
        return range(first, first + self.balance[stage])

    @cached_property
    def checkpoint_stop(self) -> int:
        """Micro-batches ``0 .. stop-1`` are checkpointed (torchgpipe's rule)."""
        m = self.n_microbatches
        return {"always": m, "except_last": m - 1, "never": 0}[self.checkpoint]

    def checkpointed(self, microbatch: int) -> bool:
        """Whether ``microbatch`` recomputes its forward during backward."""
        return microbatch < self.checkpoint_stop

    @property
    def optimizer_state_factor(self) -> float:
        """Bytes of optimizer state per parameter byte."""
        if isinstance(self.optimizer, str):
            return OPTIMIZER_STATE[self.optimizer]
        return float(self.optimizer)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "extras"}
        d["balance"] = list(self.balance)
        d["placement"] = list(self.stage_devices)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "<dict>") -> Plan:
        """The Plan of :meth:`to_dict` (``best_plan.json``, a trace's ``meta["plan"]``)."""
        known = {"balance", "chunks", "batch_size", "checkpoint", "schedule", "placement",
                 "virtual_stages", "optimizer"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PlanError(f"{source}: unknown plan field(s) {unknown}")
        try:
            return cls(**d)
        except TypeError as exc:
            raise PlanError(f"{source}: not a plan ({exc})") from None

    #: the fields that make the schedule (not the optimizer, which only moves memory)
    SCHEDULE_FIELDS = ("balance", "chunks", "batch_size", "checkpoint", "schedule", "stage_devices",
                       "virtual_stages")

    def label(self) -> str:
        """A short human label, e.g. ``gpipe [3,3] m=4 ckpt=never``."""
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (f"{self.schedule}{v} [{','.join(map(str, self.balance))}] m={self.chunks} "
                f"ckpt={self.checkpoint}")
