"""Reading a DCP checkpoint for ``stashpoint import`` without running code from its files.

DCP pickles its ``.metadata`` and the non-tensor values of the state, and its reader unpickles
them with ``pickle.load`` and ``torch.load(weights_only=False)``: a crafted checkpoint runs code
on import. Here the metadata is unpickled by an unpickler that knows only DCP's own metadata
records, ``torch.Size``, dtypes, layouts and paths, and each value with
``torch.load(weights_only=True)``. Anything else is refused, naming what the file asked for.
"""

from __future__ import annotations

import enum
import io
import logging
import math
import os
import pickle
import stat
import types
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

from stashpoint._tools.importcheck import check_pickle, check_torch_file, open_regular, weights_only_refusal
from stashpoint.errors import CheckpointError, CorruptCheckpointError

MAX_METADATA_BYTES = 256 << 20  # or 1/16 of the data, for checkpoints of very many chunks
_MODULES = {  # module -> the names a DCP .metadata may name in it (None: any class of the module)
    "torch.distributed.checkpoint.metadata": None,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "builtins": {"set", "frozenset", "complex", "slice"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle._Unpickler):  # Python's own: its BUILD can be checked (C's cannot)
    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)

    def _build(self) -> None:
        """BUILD sets an object's attributes from a state: never a class's or a module's (a
        file could change torch's or pathlib's classes for the rest of the process)."""
        stack: list[Any] = self.stack  # type: ignore[attr-defined]  # _Unpickler's, undeclared in typeshed
        target = stack[-2] if len(stack) > 1 else None
        if isinstance(target, (type, types.ModuleType)):
            raise pickle.UnpicklingError(
                f"the .metadata file sets attributes of {getattr(target, '__name__', target)!s}, which a DCP "
                "checkpoint's metadata never does"
            )
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = _build

    def find_class(self, module: str, name: str) -> Any:
        import torch

        found = torch.__dict__.get(name)  # not getattr: that would import torch's lazy submodules
        if module == "torch" and (name == "Size" or isinstance(found, torch.dtype)):
            return found
        if (module, name) == ("builtins", "getattr"):
            return _enum_member  # how Python 3.11.0-3.11.3 pickle an enum's member
        allowed = _MODULES.get(module, set())
        if module in _MODULES and "." not in name and (allowed is None or name in allowed):
            found = super().find_class(module, name)
            if allowed is not None or (isinstance(found, type) and found.__module__ == module):
                return found
        raise pickle.UnpicklingError(
            f"the .metadata file asks for {module}.{name}, which a DCP checkpoint's metadata never holds"
        )


def _enum_member(cls: Any, name: Any = None, *more: Any) -> Any:
    """``getattr(cls, name)`` where ``cls`` is an enum (a class the unpickler allowed) and
    ``name`` one of its members: nothing else a pickle may ask ``getattr`` for."""
    if not more and isinstance(cls, enum.EnumMeta) and isinstance(name, str) and name in cls.__members__:
        member: Any = cls[name]
        if type(member) is cls:
            return member
    shown = cls.__name__ if isinstance(cls, type) else repr(cls)[:100]
    args = ", ".join([shown, *(repr(a)[:100] for a in (name, *more))])
    raise pickle.UnpicklingError(
        f"the .metadata file asks for getattr({args}), which a DCP checkpoint's metadata never holds (only an "
        "enum's member)"
    )


def load_dcp(p: Path) -> tuple[dict[str, Any], int]:
    """The whole DCP checkpoint at ``p`` as a nested state dict (one process, no process group),
    and the bytes read for it: its ``.metadata`` and the items DCP read (not other files of the
    directory, nor items no tensor or value uses: the import's write limit is a multiple of it)."""
    try:
        from torch.distributed.checkpoint._traverse import set_element
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
        from torch.distributed.checkpoint.planner import LoadItemType
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    except ImportError as e:  # torch moved its private loader: refuse rather than unpickle unchecked
        raise CheckpointError(
            f"this torch ({e}) lacks the DCP reader stashpoint imports through without unpickling code; "
            "load the checkpoint with torch yourself if you trust it and save it with stashpoint.save"
        ) from None

    refused: list[Exception] = []  # DCP wraps what its reader raises in a traceback's text: ours, whole
    read = [0]

    class Files(FileSystem):
        """DCP's reads: each file opened checked, as the checks above do, and its tensor items'
        pickles scanned in the very file DCP then reads them from (not one opened before)."""

        def __init__(self, tensors: dict[str, list[tuple[str, Any]]]) -> None:
            super().__init__()
            self.tensors = tensors

        @contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            if mode != "rb":
                raise ValueError(f"import only reads: DCP asked to open {path} with mode {mode!r}")
            try:
                with open_regular(Path(path)) as f:
                    for fqn, info in self.tensors.get(Path(path).name, ()):
                        check_torch_file(
                            io.BufferedReader(_Window(f, info.offset, info.length)), f"the DCP tensor {fqn!r}"
                        )
                    f.seek(0)
                    yield f
            except (ValueError, CheckpointError) as e:
                refused.append(e)
                raise

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return self._read_metadata()
            except (ValueError, pickle.UnpicklingError, CheckpointError) as e:
                refused.append(e)
                raise

        def _read_metadata(self) -> Any:
            from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

            root = Path(self.path)
            cap = _metadata_cap(root)
            with open_regular(_regular(root, ".metadata", cap)) as f:
                raw = f.read(cap + 1)  # the file checked by name may have grown since
            if len(raw) > cap:
                raise ValueError(f"{root / '.metadata'} holds more than {cap} bytes, more than any DCP metadata")
            read[0] += len(raw)
            check_pickle(raw, f"{root / '.metadata'}")
            metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(
                    f"the .metadata file holds a {type(metadata).__name__}, not DCP's Metadata"
                )
            _check_places(metadata, root)
            meta = metadata.storage_meta if metadata.storage_meta is not None else StorageMeta()
            meta.load_id = self.load_id
            metadata.storage_meta = meta
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            """Count the bytes of each item DCP reads; its tensor items' pickles are scanned as
            their files open (:class:`Files`), a value's in :func:`_plain_value`."""
            tensors: dict[str, list[tuple[str, Any]]] = {}
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                read[0] += info.length
                if item.type != LoadItemType.BYTE_IO:
                    tensors.setdefault(info.relative_path, []).append((item.dest_index.fqn, info))
            self.fs = Files(tensors)
            return super().read_data(plan, planner)

    class Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:  # torch's: weights_only=False
            key = read_item.dest_index.fqn
            try:
                obj = _plain_value(value, key)
            except CheckpointError as e:
                refused.append(e)
                raise
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[key], obj)
            else:
                self.state_dict[key] = obj

    state: dict[str, Any] = {}
    with _quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that no process group is initialized
        try:
            _load_state_dict(state_dict=state, storage_reader=Reader(str(p)), planner=Planner(), no_dist=True)  # type: ignore[no-untyped-call]
        except BaseException:
            if refused:
                raise refused[0] from None
            raise
    return state, read[0]


def _regular(root: Path, name: object, cap: int | None = None) -> Path:
    """``root / name`` if ``name`` is a plain file name and that a regular file (not a link, a
    FIFO or a device), at most ``cap`` bytes; else a ValueError naming it."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"the DCP metadata names the file {name!r}, which is not a file name inside {root}")
    path = root / name
    try:
        st = path.lstat()
    except OSError as e:
        raise ValueError(f"the DCP metadata names {name!r}, which {root} lacks ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(
            f"{path} is a symbolic link: import reads only the checkpoint's own files (a link could lead anywhere "
            "on this host); copy the checkpoint with its links resolved (cp -rL) and import the copy"
        )
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file (a FIFO, a device?): DCP checkpoints hold only files")
    if cap is not None and st.st_size > cap:
        raise ValueError(f"{path} holds {st.st_size} bytes, more than any DCP metadata ({cap})")
    return path


def _metadata_cap(root: Path) -> int:
    """The most bytes a .metadata may hold: a record per chunk, so it grows with the chunks (about
    150 bytes each); bounded by the data it describes as held on disk (a sparse file of a
    terabyte beside it uses none), at least 256 MiB."""
    data = 0
    for e in os.scandir(root):
        if e.is_file(follow_symlinks=False):
            st = e.stat(follow_symlinks=False)
            data += min(st.st_size, getattr(st, "st_blocks", st.st_size >> 9) << 9)
    return max(MAX_METADATA_BYTES, data // 16)


def _check_places(metadata: Any, root: Path) -> None:
    """Each item the metadata places must lie in a regular file of the checkpoint, untransformed,
    and the tensors it promises must fit in those files' bytes: a crafted .metadata could point
    at any file of the host, a FIFO or /dev/zero, or ask for terabytes of empty tensors."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    sizes: dict[str, int] = {}
    places = metadata.storage_data
    if not isinstance(places, dict):
        raise ValueError(f"the DCP metadata's storage_data is a {type(places).__name__}, not a dict")
    for index, info in places.items():
        if not isinstance(info, _StorageInfo):
            raise ValueError(f"the DCP metadata places {index} with a {type(info).__name__}")
        name = info.relative_path
        if name not in sizes:
            sizes[name] = _regular(root, name).stat().st_size
        offset, length = info.offset, info.length
        if not (type(offset) is int and type(length) is int and offset >= 0 and 0 <= length <= sizes[name] - offset):
            raise ValueError(f"the DCP metadata places {index} at bytes {offset!r}+{length!r} of {name}, past its end")
        transforms = getattr(info, "transform_descriptors", None)  # a field since torch 2.7
        if transforms:
            raise ValueError(f"{index} is stored transformed ({transforms!r}); stashpoint imports plain DCP")
    promised = 0
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            dims = tuple(entry.size)
            if not all(type(n) is int and n >= 0 for n in dims):
                raise ValueError(f"the DCP tensor {key!r} has the shape {dims!r}")
            promised += math.prod(dims) * entry.properties.dtype.itemsize
    if promised > sum(sizes.values()):
        raise ValueError(
            f"the DCP metadata promises {promised} bytes of tensors, more than its files hold ({sum(sizes.values())})"
        )
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            _check_tiling(key, tuple(entry.size), entry.chunks)


def _check_tiling(key: str, dims: tuple[int, ...], chunks: Any) -> None:
    """A tensor's chunks must lie inside it and hold as many elements as it does: DCP reads each
    chunk listed, so a chunk listed a million times would read the tensor a million times."""
    covered = 0
    for c in chunks:
        offsets, sizes = tuple(c.offsets), tuple(c.sizes)
        inside = len(offsets) == len(sizes) == len(dims) and all(
            type(o) is int and type(n) is int and o >= 0 and n >= 0 and o + n <= d
            for o, n, d in zip(offsets, sizes, dims)
        )
        if not inside:
            raise ValueError(f"the DCP tensor {key!r} of shape {dims!r} has a chunk at {offsets!r} of {sizes!r}")
        covered += math.prod(sizes)
    if covered != math.prod(dims):
        raise ValueError(
            f"the DCP tensor {key!r} has chunks of {covered} elements in all, not its {math.prod(dims)}: they must "
            "tile it once"
        )


def _plain_value(value: io.BytesIO, key: str) -> Any:
    """A non-tensor value of the state, unpickled with ``torch.load(weights_only=True)``."""
    import torch

    value.seek(0)
    check_torch_file(value, f"the DCP value {key!r}")
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:
        refused, why = weights_only_refusal(e)
        why = why[:300]
        if not refused:  # no pickle of allowed kinds at all: damaged bytes
            raise CorruptCheckpointError(f"the DCP value {key!r} is not a readable pickle ({why})") from None
        raise CheckpointError(
            f"the DCP value {key!r} holds objects torch.load(weights_only=True) refuses ({why}); stashpoint never "
            "runs code from a file: load the checkpoint with torch yourself if you trust it"
        ) from None


class _Window(io.RawIOBase):
    """Bytes ``offset`` to ``offset + length`` of the open file ``f`` as a stream of their own, for
    zipfile (which seeks from the end: torch's view of a slice gets that wrong)."""

    def __init__(self, f: io.BufferedReader, offset: int, length: int) -> None:
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]
        if base + pos < 0:
            raise OSError(f"seek to {base + pos}, before the start")
        self.pos = base + pos
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.f.seek(self.offset + self.pos)
        got = self.f.readinto(memoryview(buffer)[:n])
        self.pos += got
        return got


class _DropDcpRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return f"torch{os.sep}distributed{os.sep}checkpoint" not in record.pathname


@contextmanager
def _quiet() -> Iterator[None]:
    """DCP logs a failed load's whole traceback (on the root logger) before raising it: the
    error says it once. Only DCP's own records are dropped, and only meanwhile."""
    drop = _DropDcpRecords()
    loggers = [logging.getLogger(), logging.getLogger("torch.distributed.checkpoint")]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)
