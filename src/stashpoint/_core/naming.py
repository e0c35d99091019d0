"""Every name stashpoint writes, in one place: shard files in a checkpoint, step directories,
damaged steps set aside and the lock file in a run directory. Readers act only on names that
these functions produce (ASCII digits, exact match)."""

from __future__ import annotations

import re

MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".stashpoint-manager.lock"  # the manager's lock file in its root
REWIND_NAME = ".stashpoint-rewind.json"  # in a run's root: a rewind the remote tier has not seen yet
#: In a node-local step directory: every node's files of this step had live copies on
#: ``replicas`` other nodes when it was written (the manifest is sealed before the copies exist)
RECOVERABLE_NAME = "recoverable.json"

_NODE_MARKER_RE = re.compile(r"(partial|replica)-r[0-9]{5,}|recoverable\.json")
PARTIAL_RE = re.compile(r"partial-r([0-9]{5,})")  # a node-local step: a rank's files here are not whole
REPLICA_RE = re.compile(r"replica-r([0-9]{5,})")  # a node-local step: a rank's files here are another node's

_SHARD_RE = re.compile(r"shard-r([0-9]{5,})-([0-9]{4,})-([0-9a-f]+)\.safetensors")
_INDEX_RE = re.compile(r"index-r([0-9]{5,})-([0-9a-f]+)\.json")
_GROUP_RE = re.compile(r"g([0-9]{5,})")
_STEP_RE = re.compile(r"step-([0-9]{8,})")
_SET_ASIDE_RE = re.compile(r"(step-[0-9]{8,})\.(?:damaged|rewound|incomplete)-[0-9]{8}-[0-9]{6}(?:-[0-9]{1,4})?")


def partial_name(name: str, tag: str) -> str:
    """Where a file ``name`` is written before it is renamed into place (``tag``: a random hex)."""
    return f".{name}.{tag}.partial"


def is_partial_of(candidate: str, name: str) -> bool:
    """Whether ``candidate`` is a write of ``name`` a crash left before its rename."""
    return re.fullmatch(re.escape(f".{name}.") + r"[0-9a-f]{32}\.partial", candidate) is not None


_PARTIAL_RE = re.compile(r"\.(.+)\.[0-9a-f]{32}\.partial")


def written_by_a_save(name: str) -> bool:
    """Whether ``name`` (a ``/``-separated path inside a step directory) is a file a save or a
    node-local transfer writes there, or one a crash left before its rename: a leftover that
    holds anything else is not stashpoint's to delete. Pure."""
    head, _, leaf = name.rpartition("/")
    if (m := _PARTIAL_RE.fullmatch(leaf)) is not None:
        leaf = m[1]
    if parse_save_file(f"{head}/{leaf}" if head else leaf) is not None:
        return True
    return not head and (leaf == MANIFEST_NAME or is_node_marker(leaf))


def shard_name(rank: int, index: int, save_id: str) -> str:
    """The file name of shard ``index`` written by ``rank`` in the save ``save_id``."""
    return f"shard-r{rank:05d}-{index:04d}-{save_id}.safetensors"


def parse_shard_name(name: str) -> tuple[int, int, str] | None:
    """``(rank, index, save_id)`` of a shard file name :func:`shard_name` gives, else None."""
    m = _SHARD_RE.fullmatch(name)
    if m is None:
        return None
    rank, index, save_id = int(m[1]), int(m[2]), m[3]
    return (rank, index, save_id) if shard_name(rank, index, save_id) == name else None


def index_name(rank: int, save_id: str) -> str:
    """The file name of the index ``rank`` writes in the save ``save_id`` (format version 2)."""
    return f"index-r{rank:05d}-{save_id}.json"


RANKS_PER_DIR = 1024  # ranks whose files share a directory once a world has more (about 3,000 entries)


def group_dir(rank: int, ranks_per_dir: int) -> str:
    """The directory under a checkpoint that ``rank``'s files go in: ``g`` and the group number
    (``""``: the checkpoint's root, when ``ranks_per_dir`` is 0). One directory (or object-store
    prefix) per ``ranks_per_dir`` ranks keeps each to a few thousand entries at any world size."""
    return f"g{rank // ranks_per_dir:05d}" if ranks_per_dir else ""


def placed(name: str, rank: int, ranks_per_dir: int) -> str:
    """``name`` inside ``rank``'s group directory (``g00012/name``), or ``name`` itself."""
    group = group_dir(rank, ranks_per_dir)
    return f"{group}/{name}" if group else name


def is_group_dir(name: str) -> bool:
    """Whether ``name`` is exactly a group directory name :func:`group_dir` gives."""
    m = _GROUP_RE.fullmatch(name)
    return m is not None and f"g{int(m[1]):05d}" == name


def split_group(name: str) -> tuple[str, str] | None:
    """``(group, file)`` of a file name inside the checkpoint (group ``""`` at its root), or None
    unless it is a plain name or one group directory and a plain name."""
    group, sep, leaf = name.rpartition("/")
    if not leaf or "/" in group or "\\" in name or leaf in (".", ".."):
        return None
    if sep and not is_group_dir(group):
        return None
    return group, leaf


def parse_save_file(name: str) -> tuple[int, str] | None:
    """``(rank, save_id)`` of a shard or index file name this module gives (at the root or in
    a group directory), else None."""
    parts = split_group(name)
    if parts is None:
        return None
    name = parts[1]
    shard = parse_shard_name(name)
    if shard is not None:
        return shard[0], shard[2]
    m = _INDEX_RE.fullmatch(name)
    if m is None:
        return None
    rank, save_id = int(m[1]), m[2]
    return (rank, save_id) if index_name(rank, save_id) == name else None


def looks_like_shard(name: str) -> bool:
    """Whether ``name`` could be one of stashpoint's shard files (telling what a directory is)."""
    return name.rpartition("/")[2].startswith(("shard-", "index-"))


def step_dir(step: int) -> str:
    """The directory name of ``step``: ``step-`` and the step zero-padded to at least 8 digits."""
    if step < 0:
        raise ValueError(f"steps are non-negative integers, got {step}")
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name stands for, or None unless it is exactly the name
    :func:`step_dir` gives that step (ASCII digits, no extra padding, nothing around it): the
    manager acts only on names it writes."""
    m = _STEP_RE.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir(step) == name else None


def set_aside_name(step: int, stamp: str, why: str = "damaged", n: int = 0) -> str:
    """The name a step is moved to (``stamp``: ``%Y%m%d-%H%M%S``), kept for inspection: a
    damaged one, one ``"rewound"`` (newer than a step the run saved after going back), or one
    ``"incomplete"`` (node-local: some saving rank's files are on no node of the job); ``n``
    (1-9999) tells apart steps set aside within the same second."""
    if why not in ("damaged", "rewound", "incomplete"):
        raise ValueError(f"a step is set aside as damaged, rewound or incomplete, not {why!r}")
    if not 0 <= n < 10_000:
        raise ValueError(f"n must be in [0, 10000), not {n}")
    return f"{step_dir(step)}.{why}-{stamp}" + (f"-{n}" if n else "")


def is_set_aside(name: str) -> bool:
    m = _SET_ASIDE_RE.fullmatch(name)
    return m is not None and parse_step_dir(m[1]) is not None


def is_node_marker(name: str) -> bool:
    """A marker a node-local step directory holds beside the checkpoint's files: another rank's
    files copied in part (``partial-rNNNNN``), kept for another node (``replica-rNNNNN``), or
    the step recoverable without storage (:data:`RECOVERABLE_NAME`)."""
    return _NODE_MARKER_RE.fullmatch(name) is not None
