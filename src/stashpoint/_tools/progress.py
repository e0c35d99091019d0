"""Progress of long command-line operations: a bar on a terminal, plain lines otherwise.

Library functions take ``progress``: any callable that accepts a message. When it also has
``start(total)`` and ``advance(n)`` (as :class:`Reporter` does), they report bytes too.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

from stashpoint._tools.output import esc


class Reporter:
    """A ``progress`` callable for the CLI: a ``rich`` bar of bytes on a terminal (messages
    printed above it), one line per message when the output is a file or a pipe."""

    def __init__(self, description: str, *, stream: TextIO | None = None, bar: bool | None = None) -> None:
        self.description = description
        self.stream = stream if stream is not None else sys.stderr
        self.bar = self.stream.isatty() if bar is None else bar
        self._progress: Any = None
        self._task: Any = None
        self.total = 0  # bytes announced by start()
        self.done = 0  # bytes reported by advance()

    def __enter__(self) -> Reporter:
        if self.bar:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
                transient=True,
            )
            self._progress.__enter__()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.__exit__(et, ev, tb)
            self._progress = None

    def __call__(self, message: str) -> None:
        message = esc(message)  # a path given may hold control characters, or a newline that forges a line
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=self.stream, flush=True)

    def start(self, total: int) -> None:
        """Count ``total`` more bytes: one bar for the whole command (a run's verify starts once
        a step; a bar each made every redraw draw them all, quadratic in the steps)."""
        self.total += total
        if self._progress is None:
            return
        if self._task is None:
            self._task = self._progress.add_task(self.description, total=self.total)
        else:
            self._progress.update(self._task, total=self.total)

    def advance(self, n: int) -> None:
        self.done += n
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, n)


def start(progress: Callable[[str], None] | None, total: int) -> None:
    """Tell ``progress`` the bytes the operation will go through, if it counts bytes."""
    fn = getattr(progress, "start", None)
    if fn is not None:
        fn(total)


def advance(progress: Callable[[str], None] | None, n: int) -> None:
    """Tell ``progress`` that ``n`` more bytes are done, if it counts bytes."""
    fn = getattr(progress, "advance", None)
    if fn is not None:
        fn(n)
