"""Sizes as people read them."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit under 1024 of it: "512 B", "1.5 MiB", "2.0 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
