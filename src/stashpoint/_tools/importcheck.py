"""Bounds on what ``stashpoint import`` takes from a foreign file: the pickles it unpickles and the
bytes it would write. A file of a few KB must not make an import run for hours (a dict whose keys
all hash alike) or write gigabytes (a tensor expanded from one element)."""

from __future__ import annotations

import collections
import io
import pickletools
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from stashpoint.errors import CheckpointError

#: Python hashes an int modulo 2**61 - 1: past that, keys can be chosen to share one hash, and
#: building a dict of N of them takes N**2 steps. Distinct ints share one by chance alone.
MAX_HUGE_INTS = 1_000
_HASH_MODULUS = (1 << 61) - 1
_INT_OPS = frozenset({"INT", "LONG", "LONG1", "LONG4"})
#: An import writes each tensor whole: views of one storage are written once each (tied weights
#: twice), and more than this many times the input's bytes means views made to multiply it.
WRITE_FACTOR = 8
_WRITE_SLACK = 256 << 20
_READ_WHOLE = 256 << 20


def check_pickle(source: bytes | IO[bytes], where: str) -> None:
    """Refuse the pickle ``source`` (at a stream's position) if more than :data:`MAX_HUGE_INTS`
    distinct integers in it share one hash, before anything unpickles it. A malformed pickle is
    left to the unpickler's own error (this scan stops where it would)."""
    if isinstance(source, bytes):
        if sum(source.count(op) for op in (b"\x8a", b"\x8b", b"I", b"L")) <= MAX_HUGE_INTS:
            return  # too few opcodes that could make such an int: no walk through the opcodes
        source = io.BytesIO(source)
    seen: set[bytes] = set()  # each distinct value once (bytes hash with a random seed)
    per_hash: collections.Counter[int] = collections.Counter()
    try:
        for op, arg, _ in pickletools.genops(source):
            if op.name in _INT_OPS and type(arg) is int and abs(arg) >= _HASH_MODULUS:
                raw = arg.to_bytes(arg.bit_length() // 8 + 1, "little", signed=True)
                if raw in seen:
                    continue
                seen.add(raw)
                per_hash[hash(arg)] += 1
                if per_hash[hash(arg)] > MAX_HUGE_INTS:
                    raise CheckpointError(
                        f"{where} holds more than {MAX_HUGE_INTS} integers of one hash, as a dict crafted to take "
                        "hours to unpickle does; import refuses it. Load it yourself if you trust it and save its "
                        "state with stashpoint.save"
                    )
    except CheckpointError:
        raise
    except Exception:  # a malformed pickle: the unpickler says what is wrong with it
        return


def check_torch_file(source: Path | io.BytesIO, where: str) -> None:
    """:func:`check_pickle` on the pickles of a ``torch.save`` file: the zip format's ``data.pkl``,
    or the legacy format's four pickles ahead of its data."""
    try:
        if zipfile.is_zipfile(source):
            with zipfile.ZipFile(source) as z:
                for info in z.infolist():
                    if info.filename.endswith(".pkl"):
                        with z.open(info) as f:
                            check_pickle(f.read() if info.file_size <= _READ_WHOLE else f, f"{where} ({info.filename})")
        elif isinstance(source, Path):
            with open(source, "rb") as f:
                for _ in range(4):  # magic number, protocol, system info, the state
                    check_pickle(f, where)
        else:
            for _ in range(4):
                check_pickle(source, where)
    except CheckpointError:
        raise
    except Exception:  # a damaged zip (zipfile raises what it meets): torch.load says what is wrong
        return
    finally:
        if isinstance(source, io.BytesIO):
            source.seek(0)


def check_tensors(state: Any, input_bytes: int, where: str) -> None:
    """Refuse a state whose tensors would make the import write far more than it read: a view
    expanded past its storage (a stride of 0), or views of one storage, each written whole."""
    import torch

    total, written = 0, set()
    for key, t in _tensors(state):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_quantized:
            continue  # the save refuses these, naming the fix
        n = t.numel() * t.element_size()
        held = t.untyped_storage().nbytes()
        if n > held:
            raise CheckpointError(
                f"{where}: {key!r} is a view of {held} bytes expanded to {n} (a stride of 0); import writes tensors "
                "whole and refuses it. Load the file yourself and save the tensor you mean (its base, or .clone())"
            )
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if view not in written:  # the same view twice (a layer shared 16 times) is saved once
            written.add(view)
            total += n
    if total > WRITE_FACTOR * input_bytes + _WRITE_SLACK:
        raise CheckpointError(
            f"{where}: its tensors would take {total} bytes written from {input_bytes} read (views of the same "
            f"storage, each written whole); import refuses more than {WRITE_FACTOR}x. Load the file yourself and "
            "save the tensors you mean with stashpoint.save"
        )


def _tensors(state: Any) -> Iterator[tuple[str, Any]]:
    """Every leaf under the dicts, lists and tuples of ``state`` with its key path (no recursion:
    an unpickled state may nest deeper than Python's stack)."""
    stack: list[tuple[str, Any]] = [("", state)]
    while stack:
        key, node = stack.pop()
        if isinstance(node, dict):
            stack.extend((f"{key}/{k}" if key else str(k), v) for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((f"{key}/{i}" if key else str(i), v) for i, v in enumerate(node))
        else:
            yield key, node
