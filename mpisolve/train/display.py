"""Rank 0's view of a run on stderr: a progress bar on a terminal, periodic lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Display:
    """Shows progress on ``stream`` (stderr by default).

    On a terminal a one-line bar is redrawn (at most ten times a second). Otherwise,
    for logs and batch jobs, a plain line is printed for every evaluation and at most
    every ``every_s`` seconds in between.
    """

    def __init__(self, title: str, *, stream: TextIO | None = None, every_s: float = 10.0) -> None:
        self.title = title
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = every_s
        self._last = float("-inf")

    def update(self, fraction: float, fields: dict[str, Any], *, important: bool = False) -> None:
        """Progress ``fraction`` (0..1) with named values; ``important`` lines always print."""
        now = time.monotonic()
        text = " ".join(f"{k} {_fmt(v)}" for k, v in fields.items() if v is not None)
        if self.tty:
            if important or now - self._last >= 0.1 or fraction >= 1:
                filled = int(30 * min(fraction, 1.0))
                bar = "#" * filled + "." * (30 - filled)
                self.stream.write(f"\r{self.title} [{bar}] {100 * min(fraction, 1.0):3.0f}% {text}\x1b[K")
                self.stream.flush()
                self._last = now
        elif important or now - self._last >= self.every_s:
            self.stream.write(f"{self.title}: {100 * min(fraction, 1.0):.0f}% {text}\n")
            self.stream.flush()
            self._last = now

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
