"""The last part of a load: plain values put back and the objects' own ``load_state_dict``
called, once every tensor is in place; in a distributed load, agreed on by every rank."""

from __future__ import annotations

from collections.abc import Callable

from stashpoint._dist.group import DistContext
from stashpoint._load.exchange import agree, kinded_failure, own_or_agreed
from stashpoint._load.restoreplan import RestorePlan as Plan
from stashpoint.errors import CheckpointError

#: What a load whose object's own ``load_state_dict`` raised adds to its error.
OBJECT_FAILED = (
    "The objects' own loads run last, once every byte was read and verified (atomic=True tries torch's optimizers "
    "and LR schedulers on a copy first, no other object): the state's tensors and plain values hold this "
    "checkpoint's values already, and objects loaded before this one theirs. Fix the object or its saved state, "
    "or load a good checkpoint before training on."
)


def apply(plan: Plan, location: str) -> None:
    """Give plain values and objects their state, once every tensor is in place."""
    for s in plan.setters:
        try:
            s()
        except Exception as e:  # a container of the state's own refused the value (a frozen mapping)
            raise CheckpointError(
                f"putting a plain value of {location} back into the state failed: {type(e).__name__}: {e}; the "
                "state's tensors hold this checkpoint's values already"
            ) from e
    for where, fin in plan.finalizers:
        try:
            call(fin, where, location)
        except CheckpointError as e:
            if type(e) is not CheckpointError:  # a kind of our own objects' (a mismatch): as it is
                raise
            raise CheckpointError(f"{e}\n{OBJECT_FAILED}") from e


def apply_together(ctx: DistContext, plan: Plan, location: str) -> None:
    """:func:`apply` on every rank, then one agreement: an object's own ``load_state_dict``
    that raised on some ranks fails the load on all of them (a restore takes one path)."""
    error: CheckpointError | None = None
    try:
        apply(plan, location)
    except CheckpointError as e:
        error = e
    except Exception as e:  # whatever it was, the other ranks must not wait for this one
        error = CheckpointError(f"loading {location} failed on its last part: {type(e).__name__}: {e}")
    try:
        agree(ctx, "load applied", kinded_failure(error) if error else 0, path=str(location))
    except CheckpointError as agreed:
        raise own_or_agreed(error, agreed, same_class=True) from None


def call(fn: Callable[[], None], where: str, location: str) -> None:
    try:
        fn()
    except CheckpointError:
        raise
    except Exception as e:  # an object's own load_state_dict refused what passed our checks
        raise CheckpointError(
            f"loading the state at {where or '<root>'!r} of {location} into its object failed: {type(e).__name__}: {e}"
        ) from e
