"""Live progress for long commands: ``rich`` bars on a terminal, plain lines anywhere else.

A run watched in a terminal wants bars with the time left; a log file or a pipe wants one line per
event, stamped with the time since the start, that a tool can follow (the emulator's callers parse
them). One interface serves both: ``line`` always says what happened, ``bar``/``advance`` move the bars
that exist only on a terminal.
"""

from __future__ import annotations

import time
from typing import IO, Any


class Progress:
    """Progress on ``stream``: bars through ``rich`` when it is a terminal (and ``rich`` is installed)."""

    def __init__(self, stream: IO[str], *, live: bool | None = None) -> None:
        self.stream = stream
        self.t0 = time.monotonic()
        self._bars: dict[str, Any] = {}
        self._rich: Any = None
        if live is None:
            live = bool(getattr(stream, "isatty", lambda: False)())
        if live:
            try:
                from rich.console import Console
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )
                from rich.progress import Progress as RichProgress
            except ImportError:
                return
            self._rich = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                                      console=Console(file=stream), transient=False)
            self._rich.start()

    @property
    def live(self) -> bool:
        """Bars are shown (a terminal with ``rich``)."""
        return self._rich is not None

    def line(self, text: str, *, stamp: bool = True) -> None:
        """One event: a plain line (stamped with the seconds since the start), or one above the bars."""
        stamped = f"{time.monotonic() - self.t0:8.1f}s {text}" if stamp else text
        if self._rich is not None:
            self._rich.console.print(stamped, markup=False, highlight=False)
        else:
            self.stream.write(stamped + "\n")
            self.stream.flush()

    def bar(self, key: str, description: str, total: float) -> None:
        """Start (or restart) the bar ``key`` of ``total`` steps; nothing without a terminal."""
        if self._rich is None:
            return
        if key in self._bars:
            self._rich.reset(self._bars[key], total=total, description=description)
        else:
            self._bars[key] = self._rich.add_task(description, total=total)

    def advance(self, key: str, completed: float, description: str | None = None) -> None:
        """Set the bar ``key`` to ``completed`` steps (and a new description)."""
        if self._rich is None or key not in self._bars:
            return
        changes: dict[str, Any] = {"completed": completed}
        if description is not None:
            changes["description"] = description
        self._rich.update(self._bars[key], **changes)

    def close(self) -> None:
        """Stop the bars (leaving their last state on the terminal)."""
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
