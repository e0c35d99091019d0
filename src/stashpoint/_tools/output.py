"""How the command line prints: control characters escaped (names and values come from files
anyone can write), tables, JSON, and one-line errors with exit code 2."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def fails_cleanly(fn: F) -> F:
    """Print a stashpoint error (or bad argument) as one line on stderr and exit 2; with
    ``--json``, also as ``{"error": message, "kind": class name}`` on stdout."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from stashpoint.errors import CheckpointError

        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:  # the output went to `head` or the like: as a process SIGPIPE ended
            _quiet_stdout()
            sys.exit(128 + signal.SIGPIPE)  # not 1, which says verify or diff found problems
        except KeyboardInterrupt as e:  # 130 as the shell's own, not 1, which says verify or diff found problems
            said = f"stashpoint {click.get_current_context().info_name}: interrupted" + (f"; {e}" if str(e) else "")
            _say_and_end(said, 128 + signal.SIGINT)
        except (CheckpointError, ValueError, OSError, ImportError) as e:  # ImportError: an extra not installed
            msg = "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
            echo(f"stashpoint {click.get_current_context().info_name}: error: {msg}", err=True)
            if kwargs.get("as_json"):
                try:
                    echo_json({"error": msg, "kind": type(e).__name__})
                except OSError:  # the error was stdout's own (a full disk under it): said on stderr above
                    _quiet_stdout()
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: what is left in its buffer is not flushed again at exit (a
    second traceback from a closed pipe or a full disk)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # a stdout of no file (a test's runner)
        pass


def _say_and_end(message: str, status: int) -> NoReturn:
    """Say ``message`` on stderr and end the process now: a save in flight (``import``) stops
    as a crash would stop it, uncommitted, rather than being finished by the exit hooks after
    the command said it was interrupted."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        echo(message, err=True)
        sys.stderr.flush()
    os._exit(status)


def age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{max(seconds, 0):.0f}s ago"


# C0 and C1 control characters (ESC starts terminal escape sequences), DEL, the bidirectional
# overrides that reorder what a terminal shows (names and values come from files anyone can
# write), and the surrogates that stand for a file name's bytes that are not UTF-8 (shown as the
# byte, \xNN, so that the file can be found)
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape(m: re.Match[str]) -> str:
    c = ord(m[0])
    if 0xDC80 <= c <= 0xDCFF:
        return f"\\x{c - 0xDC00:02x}"
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def esc(text: str, newlines: bool = False) -> str:
    """``text`` with its control characters shown as escapes (``\\x1b``); newlines too unless kept."""
    out = _UNSAFE.sub(_escape, text)
    return out if newlines else out.replace("\n", "\\n").replace("\t", "\\t")


def echo(text: str = "", err: bool = False) -> None:
    click.echo(esc(text, newlines=True), err=err)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(headers), *([esc(str(c)) for c in r] for r in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def short(value: object, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def echo_json(doc: object) -> None:
    from stashpoint._tools.inspect import jsonable  # NaN and inf as strings: strict JSON

    echo(json.dumps(jsonable(doc), indent=2, default=str, allow_nan=False))


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
# A local path or a URL such as s3://bucket/run/step-00000100 (a click.Path would fold its "//").
PATH_ARG = click.STRING
