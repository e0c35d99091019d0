"""What ``stashpoint export`` and ``stashpoint import`` do: to and from other checkpoint formats.

export: a stashpoint checkpoint (any world size, any sharding) or a sub-tree of it, consolidated
into one safetensors file or a Hugging Face-style sharded directory. import: a ``torch.save``
file or a DCP checkpoint directory into a stashpoint checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stashpoint._core.naming import MANIFEST_NAME
from stashpoint._core.nodes import MAX_TREE_DEPTH
from stashpoint._load.manifest import open_checkpoint
from stashpoint._save.engine import save
from stashpoint._state.dtypes import torch_dtype
from stashpoint._storage import path_problem, storage_for, user_path
from stashpoint._tools import progress as _progress
from stashpoint._tools.dcpread import load_dcp
from stashpoint._tools.importcheck import (
    check_tensors,
    check_torch_file,
    dtensors_held,
    open_regular,
    opened_path,
    weights_only_refusal,
)
from stashpoint._tools.tensors import read_tensors
from stashpoint.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError

DEFAULT_DIR_SHARD_BYTES = 5 * 10**9  # the Hugging Face default ("5GB")
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5 * 10**9, ``"500MiB"`` -> 500 * 2**20, ``"1000"`` -> 1000 bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", text.upper())
    if not m or (m.group(3) and not m.group(2)):
        raise ValueError(f"invalid size {text!r}: give bytes or a number with a unit, e.g. 5GB, 500MiB")
    unit = 1024 ** "KMGT".index(m.group(2)) * 1024 if m.group(3) else _UNITS[m.group(2)]
    n = int(float(m.group(1)) * unit)
    if n < 1:
        raise ValueError(f"invalid size {text!r}: it must be at least one byte")
    return n


def output_name(key: str, prefix: str) -> str:
    """``model/encoder.layers.0.weight`` with prefix ``model`` -> ``encoder.layers.0.weight``."""
    rest = key[len(prefix) :].lstrip("/") if prefix else key
    parts = rest.split("/") if rest else [key.rsplit("/", 1)[-1]]
    return ".".join(re.sub(r"%(25|2F)", lambda g: "%" if g.group(1) == "25" else "/", p) for p in parts)


@dataclass
class ExportResult:
    files: list[str] = field(default_factory=list)
    index: str | None = None
    tensors: int = 0
    total_size: int = 0
    dropped: dict[str, str] = field(default_factory=dict)  # tied name left out -> the name it shares data with


def _targets(out: Path, sharded: bool, n: int) -> tuple[list[Path], Path | None]:
    """The files an export of ``n`` shards writes (HF names: model-00001-of-00002.safetensors)."""
    single = out if out.suffix == ".safetensors" and not out.is_dir() else out / "model.safetensors"
    if not sharded:
        return [single], None
    stem = single.name.removesuffix(".safetensors")
    files = [single.with_name(f"{stem}-{i:05d}-of-{n:05d}.safetensors") for i in range(1, n + 1)]
    return files, single.with_name(single.name + ".index.json")


def export(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    select: str = "",
    max_shard_size: int | None = None,
    tied: str = "drop",
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> ExportResult:
    """Write the tensors of ``path`` (those under the key-path prefix ``select``) as safetensors.

    ``out`` ending in ``.safetensors`` is one file (split into ``out``-00001-of-N files plus an
    index only when ``max_shard_size`` is given and exceeded); any other ``out`` is a directory
    that gets ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` and
    ``model.safetensors.index.json`` when the tensors exceed ``max_shard_size`` (default 5GB).

    Tied tensors (stored once, aliases in the manifest): safetensors refuses tensors that share
    memory, so with ``tied="drop"`` (the default) an alias whose target is exported too is left
    out, as ``transformers`` ``save_pretrained`` does (its loader ties the weights again); with
    ``tied="clone"`` it is written as a copy under its own name.
    """
    try:
        import safetensors.torch as st
    except ImportError:
        raise CheckpointError("stashpoint export needs the safetensors package: pip install safetensors") from None
    # the dtypes save_file writes (its loader's table lacks float8_e8m0fnu, the MX scales, though
    # it reads them back); empty if those private tables move: save_file then says
    storable = set(getattr(st, "_SIZE", None) or getattr(st, "_TYPES", {}).values())
    if tied not in ("drop", "clone"):
        raise ValueError(f"tied must be 'drop' or 'clone', got {tied!r}")
    say = progress or (lambda _: None)
    storage, m = open_checkpoint(path)
    prefix = select.strip("/")
    keys = {k: None for k in m.tensors if not prefix or k == prefix or k.startswith(prefix + "/")}  # ordered set
    if not keys:
        tops = sorted({k.split("/", 1)[0] for k in m.tensors})
        raise ValueError(f"no tensor under {select!r} in {storage.location}; its top-level keys are {tops}")
    res = ExportResult()
    names: dict[str, str] = {}  # output name -> key
    for k in keys:
        alias = m.tensors[k].alias_of
        if alias is not None and alias in keys and tied == "drop":
            res.dropped[output_name(k, prefix)] = output_name(alias, prefix)
            continue
        name = output_name(k, prefix)
        if name in names:
            raise ValueError(f"keys {names[name]!r} and {k!r} both become the tensor name {name!r}")
        e = m.resolve(k)
        if storable and torch_dtype(e.dtype, k) not in storable:
            raise ValueError(f"tensor {k!r} has dtype {e.dtype}, which safetensors cannot store; --select around it")
        names[name] = k
    sizes = {n: math.prod(m.resolve(k).shape) * torch_dtype(m.resolve(k).dtype, k).itemsize for n, k in names.items()}
    out_p = _local(out, "export writes")
    is_file = out_p.suffix == ".safetensors" and not out_p.is_dir()
    limit = max_shard_size if max_shard_size is not None or is_file else DEFAULT_DIR_SHARD_BYTES
    shards: list[list[str]] = [[]]
    size = 0
    for n, nb in sizes.items():
        if shards[-1] and limit is not None and size + nb > limit:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nb
    files, index = _targets(out_p, len(shards) > 1, len(shards))
    base = files[0].parent
    stem = (out_p.name if is_file else "model.safetensors").removesuffix(".safetensors")
    ours = re.compile(rf"{re.escape(stem)}(-\d+-of-\d+)?\.safetensors(\.index\.json)?")
    old = [p for p in base.iterdir() if ours.fullmatch(p.name)] if base.is_dir() else []
    if old and not overwrite:
        raise CheckpointError(f"{old[0]} already exists; pass --overwrite to replace the earlier export")
    blocking = next((a for a in (base, *base.parents) if a.exists() and not a.is_dir()), None)
    if blocking is not None:  # mkdir's "File exists" read as an overwrite refusal
        raise CheckpointError(f"cannot export to {out_p}: {blocking} is a file, not a directory")
    base.mkdir(parents=True, exist_ok=True)
    # every new file is written under a temporary name first: an export that fails (a damaged
    # block, a full disk) leaves the earlier one as it was
    written: list[tuple[Path, Path]] = []
    try:
        _progress.start(progress, sum(sizes.values()))
        for i, (shard, f) in enumerate(zip(shards, files), 1):
            loaded = read_tensors(storage, m, [names[n] for n in shard])
            tmp = _partial(f)
            written.append((tmp, f))
            st.save_file({n: loaded[names[n]] for n in shard}, str(tmp), metadata={"format": "pt"})
            tmp.chmod(0o666 & ~_umask())  # safetensors writes 0600; an export is for others to read
            say(f"[{i}/{len(files)}] {f.name}: {len(shard)} tensor(s)")
            _progress.advance(progress, sum(sizes[n] for n in shard))
        res.tensors, res.total_size = len(names), sum(sizes.values())
        if index is not None:
            weight_map = {n: f.name for shard, f in zip(shards, files) for n in shard}
            doc = {"metadata": {"total_size": res.total_size}, "weight_map": dict(sorted(weight_map.items()))}
            tmp = _partial(index)
            written.append((tmp, index))
            tmp.write_text(json.dumps(doc, indent=2) + "\n")
            res.index = str(index)
    except BaseException:
        for tmp, _ in written:
            tmp.unlink(missing_ok=True)
        raise
    replaced = {f for _, f in written}
    for p in old:
        if p not in replaced:
            p.unlink()
    for tmp, f in written:
        tmp.replace(f)
    res.files = [str(f) for _, f in written if f != index]
    return res


def _partial(f: Path) -> Path:
    """Where the export's file ``f`` is written first: beside it, under a name the file system
    takes even where ``f``'s own name is as long as it allows."""
    name = f".{f.name}.partial"
    if len(os.fsencode(name)) > 255:
        name = f".stashpoint-export-{hashlib.sha256(os.fsencode(f.name)).hexdigest()[:16]}.partial"
    return f.with_name(name)


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (another thread may be
    creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------------------------------------
# import


@dataclass
class ImportResult:
    kind: str  # "torch.save" or "dcp"
    path: str
    tensors: int
    bytes: int


def _load_torch_file(p: Path) -> Any:
    try:  # a FIFO would block torch.load forever, a device read without end: checked once opened
        f = open_regular(p, follow=True, fix="give the file torch.save wrote")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    with f:
        return _load_opened(opened_path(f, p), p)


def _load_opened(at: Path, p: Path) -> Any:
    """The torch.save file ``p``, read through ``at`` (the file opened and checked)."""
    check_torch_file(at, str(p))
    try:
        try:
            return torch.load(at, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(at, map_location="cpu", weights_only=True)  # the legacy (non-zip) format
    except pickle.UnpicklingError as e:
        refused, why = weights_only_refusal(e)
        if "DTensor" in str(e):  # one rank's torch.save of a sharded model's state_dict
            raise dtensors_held(p) from None
        if not refused:  # not a pickle of allowed types at all: damaged or not torch.save
            raise CorruptCheckpointError(f"{p} is not a readable torch.save file ({why})") from None
        raise CheckpointError(
            f"{p} holds objects that torch.load(weights_only=True) refuses to unpickle ({why}); stashpoint "
            "never runs code from a file: load it yourself if you trust it and save its state with stashpoint.save"
        ) from None
    except Exception as e:  # torch raises RuntimeError, KeyError, EOFError, ... on a file it cannot read
        raise CorruptCheckpointError(f"{p} is not a readable torch.save file ({type(e).__name__}: {e})") from None


def import_checkpoint(
    src: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    strip_prefix: Sequence[str] = (),
) -> ImportResult:
    """Convert a ``torch.save`` file or a DCP checkpoint directory into a stashpoint checkpoint.

    A ``torch.save`` file is read with ``weights_only=True``; a DCP checkpoint's pickled metadata
    and values through unpicklers that know only what DCP and ``weights_only=True`` allow
    (``_tools.dcpread``). Nothing in the file can run code. Each of ``strip_prefix`` (e.g.
    ``"module."`` of DDP, ``"_orig_mod."`` of ``torch.compile``) is taken off the start of every
    dict key holding it, so that the state dict of a wrapped module loads into the module.
    """
    p = _local(src, "import reads")
    if not p.exists():
        raise CheckpointNotFoundError(f"nothing at {p}: give a torch.save file or a DCP checkpoint directory")
    if storage_for(path).exists(MANIFEST_NAME) and not overwrite:
        raise CheckpointError(f"a committed checkpoint already exists at {path}; pass --overwrite to replace it")
    if p.is_dir():
        if (p / MANIFEST_NAME).exists():
            raise CheckpointError(f"{p} is already a stashpoint checkpoint; show it with: stashpoint inspect {p}")
        if not (p / ".metadata").is_file():
            raise CheckpointError(f"{p} is a directory without a DCP .metadata file: not a DCP checkpoint")
        odd = [c.name for c in p.iterdir() if not c.is_file()]
        if odd:  # DCP's reader would block on a FIFO
            raise CheckpointError(f"{p} holds {odd[0]!r}, not a regular file: a DCP checkpoint holds only files")
        kind = "dcp"
        try:
            state, read = load_dcp(p)  # read: the bytes DCP read, not all the directory holds
        except BaseException as e:  # DCP's CheckpointException derives from BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            own = _own_refusal(e)
            if own is not None:  # a value refused (objects that would run code): not damage
                raise CheckpointError(f"could not import the DCP checkpoint at {p}: {own}") from None
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            why = (lines[-1] if lines else "")[:500]  # DCP wraps the cause's whole traceback: its last line
            what = f"{type(e).__name__}: {why}"
            raise CorruptCheckpointError(f"could not read the DCP checkpoint at {p}: {what}") from None
    else:
        kind, state, read = "torch.save", _load_torch_file(p), p.stat().st_size
    check_tensors(state, read, str(p))
    if strip_prefix:
        state = stripped(state, (strip_prefix,) if isinstance(strip_prefix, str) else tuple(strip_prefix))
    if not isinstance(state, (dict, list, tuple)):  # e.g. a lone tensor: give it a name
        state = {"state": state}
    stats = save(state, path, overwrite=overwrite)
    return ImportResult(kind, str(path), stats.num_tensors, stats.bytes_written)


def _own_refusal(e: BaseException) -> CheckpointError | None:
    """The error of stashpoint's own that DCP's reader wrapped in its ``CheckpointException``
    (whose ``failures`` map each rank to its error and traceback), if one was not damage; a
    Ctrl-C it wrapped is raised again."""
    failures = getattr(e, "failures", None)
    for failure in failures.values() if isinstance(failures, dict) else ():
        cause = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(cause, KeyboardInterrupt):  # Ctrl-C while DCP read: wrapped by its reader like a failure
            raise KeyboardInterrupt from None
        if isinstance(cause, CheckpointError) and not isinstance(cause, CorruptCheckpointError):
            return cause
    return e if isinstance(e, CheckpointError) and not isinstance(e, CorruptCheckpointError) else None


def _local(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a local path; a URL is refused (``Path`` would fold ``s3://b/k`` into a
    local directory named ``s3:``)."""
    if "://" in str(path):
        raise ValueError(f"{what} local files; {str(path)!r} is a URL: give a local path (and copy it yourself)")
    local = Path(user_path(path))
    try:
        local.exists()  # a name the file system refuses outright (ENAMETOOLONG) is said here, by name
    except OSError as e:
        raise CheckpointError(f"{local}: {path_problem(e)}") from e
    return local


def stripped(state: Any, prefixes: tuple[str, ...]) -> Any:
    """``state`` with ``prefixes`` taken off the start of its dicts' string keys (each in turn,
    again while one applies: ``module._orig_mod.``), its dicts, lists and tuples copied, each
    once (shared ones stay shared); raises ``CheckpointError`` where two keys become one, or
    for a nesting deeper than a save takes."""
    if not all(prefixes):
        raise ValueError("--strip-prefix needs a non-empty prefix, e.g. 'module.'")

    def bare(key: Any) -> Any:
        while isinstance(key, str) and (hit := next((p for p in prefixes if key.startswith(p)), None)):
            key = key[len(hit) :]
        return key

    copies: dict[int, Any] = {}

    def copy(node: Any, where: str, depth: int) -> Any:
        if not isinstance(node, (dict, list, tuple)):
            return node
        if id(node) in copies:
            return copies[id(node)]
        if depth > MAX_TREE_DEPTH:
            raise CheckpointError(f"the state is nested deeper than {MAX_TREE_DEPTH} containers at {where!r}")
        if isinstance(node, dict):
            out: dict[Any, Any] = {}
            copies[id(node)] = out  # before its items: a cycle comes back to it
            for k, v in node.items():
                if (nk := bare(k)) in out:
                    raise CheckpointError(
                        f"--strip-prefix makes two keys under {where or '<root>'!r} one: {nk!r}; import without it"
                    )
                out[nk] = copy(v, f"{where}/{nk}" if where else str(nk), depth + 1)
            return out
        if isinstance(node, list):
            items: list[Any] = []
            copies[id(node)] = items
            items.extend(copy(v, f"{where}/{i}", depth + 1) for i, v in enumerate(node))
            return items
        made = tuple(copy(v, f"{where}/{i}", depth + 1) for i, v in enumerate(node)) if type(node) is tuple else node
        copies[id(node)] = made
        return made

    return copy(state, "", 0)
