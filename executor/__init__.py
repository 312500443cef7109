"""pipesim's torch side: profile layers, run schedules for real, record traces.

``from executor import GPipe`` gives the torchgpipe-style facade; the rest lives in its
modules (``executor.profiler``, ``executor.pipeline``, ``executor.distributed``, ...).
torch is imported only when something from here is used, so that the console's
torch-free commands (``pipesim simulate``) start fast.
"""

from typing import Any

__all__ = ["GPipe"]


def __getattr__(name: str) -> Any:
    if name == "GPipe":
        from executor.gpipe import GPipe

        return GPipe
    raise AttributeError(f"module 'executor' has no attribute {name!r}")
