"""Argument helpers shared by the command modules (``__main__``, ``bench.cli``, ``convert``).

Kept apart from ``__main__`` so that a command module can use them without
importing the entry point (``python -m kbit_cupy`` runs ``__main__`` under the
name ``__main__``; importing it again by its package name would load it twice).
"""

from __future__ import annotations

import argparse

MAX_REPS = 100_000
MAX_ROWS = 1 << 24  # M of bench / T of bench-moe


def int_in(low: int, high: int):
    """An argparse ``type`` accepting integers from ``low`` to ``high``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range; give {low} to {high}")
        return value
    return parse
