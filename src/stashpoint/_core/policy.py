"""Pure policies of the checkpoint manager: step naming, retention, and when to save."""

from __future__ import annotations

import json
import math
import numbers
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_METRICS_BYTES = 64 * 1024


def parse_metrics(text: object) -> dict[str, Any]:
    """A step's metrics from the JSON text they were saved as: the top-level scalar values
    (numbers, strings, booleans, None); {} when the text is no JSON object, is nested too deeply
    or is over 64 KiB. Whatever a step's metadata holds, retention and listing go on."""
    if not isinstance(text, str) or len(text) > MAX_METRICS_BYTES:
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if v is None or isinstance(v, (int, float, str, bool))}


def count_or_none(name: str, value: object) -> None:
    """Refuse ``value`` for the option ``name`` unless it is None or a positive integer (a
    NumPy integer too; never a bool or a float, which would be taken as 1 or cut short)."""
    if value is None:
        return
    try:
        ok = not isinstance(value, bool) and operator.index(value) >= 1  # type: ignore[arg-type]
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} must be None or a positive integer, got {value!r}")


def seconds_or_none(name: str, value: object, *, zero: bool = False) -> None:
    """Refuse ``value`` for the option ``name`` unless it is None or a finite number of seconds
    above 0 (or 0, with ``zero``): NaN or infinity broke the collectives' deadlines, a bool or
    a string was taken as a number or failed deep inside."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if value is not None and not (ok and (value >= 0 if zero else value > 0)):  # type: ignore[operator]
        bound = "0 or more" if zero else "above 0"
        raise ValueError(f"{name} must be None or a finite number of seconds {bound}, got {value!r}")


def usable_seconds(value: object) -> Any:
    """``value`` where :func:`seconds_or_none` takes it, else None (the default): for the
    collectives that fail a save refused for its timeout on every rank together."""
    try:
        seconds_or_none("timeout", value)
    except ValueError:
        return None
    return value


def flag(name: str, value: object) -> None:
    """Refuse a yes/no option that is not a bool: ``allow_pickle="False"`` is true, and unpickled."""
    if not isinstance(value, bool) and type(value).__name__ != "bool_":  # NumPy's bools too
        raise TypeError(f"{name} must be True or False, got {value!r}")


@dataclass(frozen=True)
class Retention:
    """Which committed steps to keep. The rules add up; the newest step is always kept.

    ``keep_last``: the newest N. ``keep_every``: every step that is a multiple of K, forever.
    ``keep_best``: the K best by ``metric`` (``mode`` ``"min"`` or ``"max"``); steps saved
    without that metric do not compete. With no rule set, every step is kept.
    """

    keep_last: int | None = 3
    keep_every: int | None = None
    keep_best: int | None = None
    metric: str = "loss"
    mode: str = "min"

    @classmethod
    def of(cls, keep_last: int | None, keep_every: int | None, keep_best: Any) -> Retention:
        """The rules as the manager takes them: ``keep_best`` is ``(k, metric)`` or
        ``(k, metric, "min" | "max")``, or None."""
        if keep_best is None:
            return cls(keep_last, keep_every)
        ok = isinstance(keep_best, tuple) and len(keep_best) in (2, 3)
        if not (ok and isinstance(keep_best[1], str)):
            raise ValueError(f"keep_best must be (k, 'metric') or (k, 'metric', 'min'|'max'), got {keep_best!r}")
        count_or_none("keep_best's k (how many best steps to keep)", keep_best[0])
        k = operator.index(keep_best[0])  # a NumPy integer as keep_last takes one
        return cls(keep_last, keep_every, k, keep_best[1], keep_best[2] if len(keep_best) == 3 else "min")

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            count_or_none(name, getattr(self, name))
        if self.mode not in ("min", "max"):
            raise ValueError(f"the keep_best mode must be 'min' or 'max', got {self.mode!r}")

    @property
    def keeps_all(self) -> bool:
        return self.keep_last is None and self.keep_every is None and self.keep_best is None

    def bound(self) -> int | None:
        """The most steps these rules ever keep at once; None when that grows without bound
        (``keep_every``, or no rule)."""
        if self.keeps_all or self.keep_every is not None:
            return None
        return (self.keep_last or 1) + (self.keep_best or 0)


def steps_to_keep(
    steps: Sequence[int], metrics: Mapping[int, Mapping[str, float]], policy: Retention
) -> frozenset[int]:
    """The subset of committed ``steps`` that ``policy`` keeps."""
    ordered = sorted(set(steps))
    if not ordered or policy.keeps_all:
        return frozenset(ordered)
    keep = {ordered[-1]}
    if policy.keep_last is not None:
        keep.update(ordered[-policy.keep_last :])
    if policy.keep_every is not None:
        keep.update(s for s in ordered if s % policy.keep_every == 0)
    if policy.keep_best is not None:
        scored = []
        for s in ordered:
            value = _score(metrics.get(s, {}).get(policy.metric))
            if value is not None:
                scored.append((value if policy.mode == "min" else -value, -s))  # ties: newer first
        keep.update(-neg_step for _, neg_step in sorted(scored)[: policy.keep_best])
    return frozenset(keep)


def metric_problem(metrics: Mapping[str, Any], policy: Retention) -> tuple[str, str] | None:
    """Why a save's ``metrics`` will not compete for ``keep_best`` although it passed some: the
    metric is missing (a misspelt key?) or not a finite number; as (kind, what to say), or None.
    A save with no metrics at all is no problem: it does not compete, as documented."""
    if policy.keep_best is None or not metrics:
        return None
    if policy.metric not in metrics:
        held = ", ".join(map(repr, sorted(metrics)))
        return "missing", f"its metrics lack {policy.metric!r}, which keep_best ranks by (they hold {held})"
    value = metrics[policy.metric]
    if _score(value) is None:
        return "value", f"metrics[{policy.metric!r}] is {value!r}, not a finite number, which keep_best can rank"
    return None


def _score(value: object) -> float | None:
    """A metric's value as a finite float; None for anything else (a string, a boolean, an
    integer too large for a float, NaN), which then does not compete."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        score = float(value)
    except OverflowError:
        return None
    return score if math.isfinite(score) else None


class Doubling:
    """Whether a growing count (steps waiting for their upload, for a callback) is worth a
    warning: as it passes ``mark``, again each time it doubles, and afresh only once it fell back
    to one (a count about the mark would say it at every other step)."""

    def __init__(self, mark: int) -> None:
        self.mark = self._next = mark

    def louder(self, count: int) -> bool:
        if count <= 1:
            self._next = self.mark
        if count <= self._next:
            return False
        self._next = 2 * count
        return True


@dataclass(frozen=True)
class Schedule:
    """When a save is due: every ``every_steps`` steps and/or every ``every_seconds`` seconds."""

    every_steps: int | None = None
    every_seconds: float | None = None

    def __post_init__(self) -> None:
        count_or_none("every_steps", self.every_steps)
        seconds = self.every_seconds
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not 0 < seconds < math.inf
        ):
            raise ValueError(f"every_seconds must be None or a positive, finite number of seconds, got {seconds!r}")

    @property
    def configured(self) -> bool:
        return self.every_steps is not None or self.every_seconds is not None

    def due(self, step: int, now: float, last_save_time: float | None) -> bool:
        """Whether a save is due at ``step`` (``now`` and ``last_save_time`` in seconds)."""
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        if self.every_seconds is not None:
            return last_save_time is None or now - last_save_time >= self.every_seconds
        return False
