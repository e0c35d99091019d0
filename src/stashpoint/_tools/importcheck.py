"""Bounds on what ``stashpoint import`` takes from a foreign file: the pickles it unpickles and the
bytes it would write. A file of a few KB must not make an import run for hours (a dict whose keys
all hash alike) or write gigabytes (a tensor expanded from one element)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from stashpoint._state.dtensor import is_dtensor
from stashpoint._tools import picklescan
from stashpoint.errors import CheckpointError, CorruptCheckpointError

#: An import writes each tensor whole: views of one storage are written once each (tied weights
#: twice), and more than this many times the input's bytes means views made to multiply it.
WRITE_FACTOR = 8
_WRITE_SLACK = 256 << 20


def open_regular(
    path: Path, *, follow: bool = False, fix: str = "a DCP checkpoint holds only files"
) -> io.BufferedReader:
    """``path`` opened for reading, checked on the open file to be a regular file: one swapped
    for a FIFO or a device after a check by its name would block the read or never end it.
    A link is followed only with ``follow`` (the file a user names, not one a directory holds).
    A ValueError names what is there instead, and ``fix``."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:  # ELOOP: a link put in its place
        raise ValueError(f"{path} cannot be opened as a regular file ({e.strerror}): was it changed?") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file (a FIFO, a device?): {fix}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def opened_path(f: IO[bytes], path: Path) -> Path:
    """A name for the open file ``f`` that reopens the same file whatever is at ``path`` now
    (``/proc/self/fd/N`` on Linux), for readers that take a name (``torch.load(mmap=True)``)."""
    proc = Path(f"/proc/self/fd/{f.fileno()}")
    return proc if proc.exists() else path


def check_pickle(source: bytes | IO[bytes], where: str) -> None:
    """Refuse the pickle ``source`` (at a stream's position) before anything unpickles it if it
    asks for unbounded work: more than :data:`~picklescan.MAX_SAME_HASH` distinct dict keys or
    set items of one hash, and the like (:mod:`._tools.picklescan`). A malformed pickle is left
    to the unpickler's own error (the scan stops where it would)."""
    try:
        picklescan.scan(source)
    except picklescan.Flood as e:
        raise CheckpointError(
            f"{where} holds {e}, as only a file crafted to make unpickling take hours (or crash) does; import "
            "refuses it. Load it yourself if you trust it and save its state with stashpoint.save"
        ) from None


def check_torch_file(source: Path | IO[bytes], where: str) -> None:
    """:func:`check_pickle` on the pickles of a ``torch.save`` file (or a seekable stream of one,
    left at its start): the zip format's ``data.pkl``, or the legacy format's five pickles around
    the state. The format is told as torch.load tells it, by the zip signature at the start:
    zipfile finds a zip anywhere, and a legacy file with one appended went unchecked."""
    try:
        with contextlib.ExitStack() as ctx:
            f = ctx.enter_context(open(source, "rb")) if isinstance(source, Path) else source
            is_zip = f.read(4) == b"PK\x03\x04"
            f.seek(0)
            if is_zip:
                _check_zip(f, where)
            else:
                for _ in range(5):  # magic number, protocol, system info, the state, its storages' keys
                    check_pickle(f, where)
    except CheckpointError:
        raise
    except Exception:  # a file that cannot be read: torch.load says what is wrong
        return
    finally:
        if not isinstance(source, Path):
            source.seek(0)


def _check_zip(f: IO[bytes], where: str) -> None:
    """Scan each ``.pkl`` record of the zip ``f`` as torch's own reader gives it to torch.load:
    Python's zipfile reads some archives otherwise (it refuses a CRC torch wrote as 0 with
    ``set_crc32_options(False)``; torch reads past a wrong one)."""
    import torch

    try:
        reader = torch._C.PyTorchFileReader(f)
        names = [n for n in reader.get_all_records() if n.endswith(".pkl")]
    except Exception as e:  # torch.load would fail on it too: nothing is unpickled unchecked
        why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise CorruptCheckpointError(f"{where} is not a torch.save archive torch can read ({why})") from None
    for name in names:
        check_pickle(reader.get_record(name), f"{where} ({name})")


def dtensors_held(where: str | os.PathLike[str]) -> CheckpointError:
    """The refusal of one rank's ``torch.save`` of a sharded model's state dict."""
    return CheckpointError(
        f"{where} holds DTensors: one rank's shards of a sharded model (FSDP2 or TP), not a whole state. Import a "
        "whole one (torch.save of get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, "
        "cpu_offload=True))), or the job's DCP checkpoint; stashpoint never unpickles with weights_only=False"
    )


def check_tensors(state: Any, input_bytes: int, where: str) -> None:
    """Refuse a state whose tensors would make the import write far more than it read: a view
    expanded past its storage (a stride of 0), or views of one storage, each written whole."""
    import torch

    total, written = 0, set()
    for key, t in _tensors(state):
        if is_dtensor(t):  # read as such where torch.distributed.tensor was imported
            raise dtensors_held(where)
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


# what torch.load(weights_only=True) names when a file asks for a global it refuses: one not
# allowed (a class of the user's), or one of a module it blocks (os.system)
_GLOBAL = re.compile(
    r"Unsupported global: GLOBAL \S+ was not an allowed global by default|unsupported GLOBAL \S+ whose module \S+ "
    r"is blocked"
)
# the rest of its message: terminal escapes, and advice never passed on (weights_only=False
# runs whatever the file asks for)
_ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_TORCH_ADVICE = re.compile(
    r"Weights only load failed\.?|In PyTorch 2\.6, we changed.*?trusted source\.|Check the documentation.*$|"
    r"Please file an issue with the following so that we can make `weights_only=True` compatible with your use "
    r"case:",
    re.IGNORECASE,
)


def weights_only_refusal(e: BaseException) -> tuple[bool, str]:
    """Whether torch.load(weights_only=True) refused ``e``'s file for a global it asks for (a
    class not allowed, a blocked module's function: ``os.system``), rather than for bytes that
    are no pickle of allowed kinds at all; and torch's reason, without its advice to load with
    weights_only=False."""
    text = _ESCAPES.sub("", " ".join(str(e).split()))
    found = _GLOBAL.search(text)
    if found:
        return True, found[0]
    why = text.split("WeightsUnpickler error:", 1)[-1]
    return False, " ".join(_TORCH_ADVICE.sub(" ", why).split())[:500] or type(e).__name__
