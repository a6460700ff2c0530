"""Progress of a long fuzz run: examples/s, elapsed time, events by type.

A :class:`Progress` is an ``on_example`` callback for
:func:`properties.machine.fuzz` (called at each example's setup and
teardown). On a terminal it keeps one line up to date (``\\r``); elsewhere
(CI logs, pipes) it is quiet: one line every ``every`` seconds (30 by
default), or nothing with ``every=0``::

    fuzz reference sliding/settled  1,204 examples  61.3/s  0:00:19  events: Schedule 9,870 ...

:meth:`Progress.close` clears the terminal line, so the caller's summary
follows on a clean line.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Any, TextIO


def _n(x: int) -> str:
    return f"{x:,}"


def _clock(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    def __init__(self, label: str = "fuzz", stream: TextIO | None = None,
                 tty: bool | None = None, every: float | None = None,
                 clock: Any = time.monotonic) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty and isatty())
        self.tty = tty
        self.every = every if every is not None else (0.25 if tty else 30.0)
        self.clock = clock
        self.t0 = clock()
        self.last = self.t0
        self.width = 0
        self.examples = 0
        self.events: dict[str, int] = {}
        self.lines = 0  # lines written (non-TTY) or updates drawn (TTY)

    def __call__(self, phase: str, machine: Any) -> None:
        stats = getattr(type(machine), "stats", None)
        if stats is not None:
            self.examples = stats.examples
            self.events = dict(stats.events)
        if self.every <= 0:
            return
        now = self.clock()
        if now - self.last >= self.every:
            self.last = now
            self._draw(now)

    def set(self, examples: int, events: dict[str, int]) -> None:
        """The counts so far, summed over runs in other processes."""
        self.examples = examples
        self.events = dict(events)
        if self.every <= 0:
            return
        now = self.clock()
        if now - self.last >= self.every:
            self.last = now
            self._draw(now)

    def line(self, now: float | None = None) -> str:
        el = (self.clock() if now is None else now) - self.t0
        rate = self.examples / el if el > 0 else 0.0
        ev = " ".join(f"{k} {_n(v)}" for k, v in sorted(self.events.items(),
                                                        key=lambda kv: -kv[1]))
        return (f"{self.label}  {_n(self.examples)} examples  {rate:.1f}/s  {_clock(el)}  "
                f"events: {ev or 'none'}")

    def _draw(self, now: float) -> None:
        text = self.line(now)
        if self.tty:
            cols = shutil.get_terminal_size((100, 24)).columns - 1
            if len(text) > cols:  # a wrapped line cannot be redrawn with \r
                text = text[:max(10, cols - 1)] + "…"
            pad = max(0, self.width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self.width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.lines += 1

    def close(self) -> None:
        """Clear the terminal line (nothing to do elsewhere)."""
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


class Ticker:
    """One status line of a long job (the gate, the nightly): on a terminal
    kept up to date in place (``\\r``), elsewhere (CI logs) written as a line
    of its own at most once every ``every`` seconds (60 by default)."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None,
                 every: float | None = None, clock: Any = time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty and isatty())
        self.tty = tty
        self.every = every if every is not None else (0.5 if tty else 60.0)
        self.clock = clock
        self.last = clock()
        self.width = 0
        self.lines = 0

    def update(self, text: str, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self.last < self.every:
            return
        self.last = now
        if self.tty:
            cols = shutil.get_terminal_size((100, 24)).columns - 1
            text = text[:max(10, cols - 1)]
            self.stream.write("\r" + text + " " * max(0, self.width - len(text)))
            self.width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.lines += 1

    def close(self) -> None:
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0
