"""Bytes for people: ``"512MiB"`` in, ``"1.50 KiB"`` out (no torch, no pandas)."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.50 KiB"``: a unit that keeps the figure readable."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def parse_bytes(text: str) -> float:
    """``"512MiB"``, ``"1.5GiB"``, ``"2GB"``, ``"1e9"`` -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6,
             "gb": 1e9, "tb": 1e12, "b": 1}
    t = text.strip().lower().replace(" ", "")
    unit = next((u for u in units if t.endswith(u)), "")
    number = t[: len(t) - len(unit)]
    try:
        value = float(number) * units.get(unit, 1)
    except ValueError:
        raise ValueError(f"cannot read a memory size from {text!r} (try 512MiB or 2GiB)") from None
    if value <= 0:
        raise ValueError(f"memory budget must be positive, got {text!r}")
    return value
