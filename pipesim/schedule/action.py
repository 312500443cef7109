"""Actions and schedules: per-device ordered lists of work.

An action is one stage's forward (``F``) or backward (``B``) on one micro-batch; a split
backward is two actions instead of ``B``: ``I``, the input gradient (what the previous
stage waits for), and ``W``, the weight gradients (which nothing waits for, so a
zero-bubble schedule defers them into what would be idle time).  The text form is
torch.distributed.pipelining's: ``"1F0"`` is stage 1's forward of micro-batch 0,
``"0B3"`` stage 0's backward of micro-batch 3, ``"0I3"``/``"0W3"`` its two halves.  A schedule's CSV file has
one row per device (rank), each cell an action, exactly as that library's
``_dump_csv``/``_load_csv`` read and write it.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from pipesim.errors import ScheduleError

FORWARD, BACKWARD = "F", "B"
INPUT_GRAD, WEIGHT_GRAD = "I", "W"
#: the actions that send a gradient to the previous stage (a full or an input backward)
GRADIENT_KINDS = (BACKWARD, INPUT_GRAD)
#: every action that runs on the backward's side (gradients, the stage's parameters')
BACKWARD_KINDS = (BACKWARD, INPUT_GRAD, WEIGHT_GRAD)
_ACTION = re.compile(r"^(\d+)(F|B|I|W)(\d+)$")


class Action(NamedTuple):
    """One unit of compute: ``kind`` of ``stage`` on ``microbatch``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``"1F0"``; raises :class:`ScheduleError` on anything else."""
        match = _ACTION.match(text.strip())
        if not match:
            raise ScheduleError(f"{text!r} is not an action (expected e.g. '1F0', '0B3', '0I3' or '0W3')")
        return cls(int(match[1]), match[2], int(match[3]))


@dataclass(frozen=True)
class Schedule:
    """What every device executes, in order.

    ``order[d]`` is device ``d``'s action list; ``placement[s]`` the device of stage ``s``.
    Building a Schedule checks it (see :func:`pipesim.schedule.check.check_schedule`):
    every action exactly once, on its stage's device, and no deadlock.
    """

    name: str
    n_stages: int
    n_microbatches: int
    placement: tuple[int, ...]
    order: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        from pipesim.schedule.check import check_schedule

        check_schedule(self)

    @property
    def n_devices(self) -> int:
        return len(self.order)

    @property
    def splits_backward(self) -> bool:
        """Whether any backward is split into input (``I``) and weight (``W``) gradients."""
        return any(a.kind == INPUT_GRAD for device in self.order for a in device)

    def actions(self) -> list[Action]:
        """All actions, device by device."""
        return [a for device in self.order for a in device]

    def to_text(self) -> str:
        """One line per device: ``dev0: 0F0 0F1 ...``."""
        return "\n".join(f"dev{d}: " + " ".join(map(str, acts)) for d, acts in enumerate(self.order))

    def to_csv(self, path: str | Path) -> Path:
        """Write one row per device, cells like ``1F0`` (torch.distributed.pipelining's form)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            for device in self.order:
                writer.writerow([str(a) for a in device])
        return path

    @classmethod
    def from_csv(cls, path: str | Path, name: str | None = None) -> Schedule:
        """Read a schedule CSV; the placement is inferred from the row each stage is on."""
        path = Path(path)
        if not path.exists():
            raise ScheduleError(f"{path}: no such schedule file")
        order: list[tuple[Action, ...]] = []
        with path.open(newline="") as f:
            for row_no, row in enumerate(csv.reader(f), start=1):
                actions = []
                for col_no, cell in enumerate(row, start=1):
                    if not cell.strip():
                        continue  # torch writes empty cells for idle steps
                    try:
                        actions.append(Action.parse(cell))
                    except ScheduleError as exc:
                        raise ScheduleError(f"{path}: row {row_no}, column {col_no}: {exc}") from None
                order.append(tuple(actions))
        return cls.from_order(order, name=name or path.stem, source=str(path))

    @classmethod
    def from_order(cls, order: list[tuple[Action, ...]] | list[list[Action]], name: str = "custom",
                   source: str = "<order>") -> Schedule:
        """Build a schedule from per-device action lists, inferring stages and placement."""
        stage_device: dict[int, int] = {}
        n_mb = 0
        for device, actions in enumerate(order):
            for a in actions:
                if stage_device.setdefault(a.stage, device) != device:
                    raise ScheduleError(f"{source}: stage {a.stage} appears on devices "
                                        f"{stage_device[a.stage]} and {device}")
                n_mb = max(n_mb, a.microbatch + 1)
        if not stage_device:
            raise ScheduleError(f"{source}: the schedule has no actions")
        n_stages = max(stage_device) + 1
        missing = sorted(set(range(n_stages)) - set(stage_device))
        if missing:
            raise ScheduleError(f"{source}: stage(s) {missing} have no actions")
        placement = tuple(stage_device[s] for s in range(n_stages))
        return cls(name, n_stages, n_mb, placement, tuple(tuple(a) for a in order))
