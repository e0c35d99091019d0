"""The background half of a save: plan who writes what, write, agree, commit.

Runs on the writer thread, which owns the checkpoint process group (see ``_dist``). In a single
process the same code runs against a trivial one-rank context.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from stashpoint import _runtime
from stashpoint._core.assign import ChunkMeta
from stashpoint._core.format import MAX_MANIFEST_BYTES, checksum, utc_stamp
from stashpoint._core.index import Head, box_json, index_json
from stashpoint._core.naming import MANIFEST_NAME, group_dir, index_name, parse_save_file, placed
from stashpoint._core.nodeplan import Room
from stashpoint._core.plan import FilePlan, TensorSpec, plan_files
from stashpoint._core.sealed import open_sealed
from stashpoint._dist import group as _dist
from stashpoint._dist.arrival import CollectiveError
from stashpoint._dist.commit import (
    Outcome,
    RankFailure,
    Written,
    finish_together,
)
from stashpoint._dist.group import DistContext
from stashpoint._dist.nodecommit import commit_on_nodes, node_room
from stashpoint._dist.transfer import replicate
from stashpoint._save.agree import agree
from stashpoint._save.handle import SaveStats
from stashpoint._save.layout import Layout
from stashpoint._save.persist import FileLayout, Writer, WrittenShards, file_layouts, write_shards
from stashpoint._save.staging import StagingBuffers, StagingPool
from stashpoint._storage import Storage
from stashpoint._version import __version__
from stashpoint.errors import CheckpointError, ReplicaError

if TYPE_CHECKING:
    from stashpoint._save.options import SaveOptions
    from stashpoint._save.overlap import PendingCopies

log = logging.getLogger("stashpoint")


def _shard_of(name: str, rank: int, save_id: str) -> bool:
    return parse_save_file(name) == (rank, save_id)


@dataclass(frozen=True)
class Totals:
    """What rank 0 tells every rank about a committed save."""

    bytes_written: int
    files: int
    tensors: int


@dataclass
class PersistJob:
    storage: Storage
    staged: StagingBuffers | None
    pool: StagingPool | None  # None once the save ended: its error's frames must not hold the buffers
    tree: dict[str, Any]
    layout: Layout
    opts: SaveOptions
    ctx: DistContext
    blocking_s: float = 0.0
    seq: int = 0  # this rank's count of collective saves: every rank must be at the same one
    early_error: BaseException | None = None  # this rank failed before staging
    pending: PendingCopies | None = None  # overlap mode: copies still running into ``staged``
    staged_at: float = 0.0  # perf_counter() when the call's own copies were done
    writer: Writer | None = None  # the writer process; None: write on this (the writer) thread
    staged_keys: frozenset[str] | None = None  # the keys copied for this save; None: every key
    reported_ok: bool = False  # this rank told the others its part succeeded
    commit_tried: bool = False  # this rank asked the storage to commit (rank 0 only ever does)
    ranks_per_dir: int = 0  # rank 0's choice for this save (see ``agree.ranks_per_dir()``)
    manifest: bytes | None = None  # rank 0: the manifest it committed
    room: dict[int, Room] | None = None  # rank 0, node-local with replicas: each node's bytes of the step
    staging_pinned: bool | None = None  # set at the call: see SaveStats.staging_pinned

    @classmethod
    def failed(
        cls, storage: Storage, pool: StagingPool, opts: SaveOptions, ctx: DistContext, e: BaseException
    ) -> PersistJob:
        """A save this rank could not stage: it still joins the collectives, to fail them all."""
        empty = Layout([], {}, {}, {}, "")
        return cls(storage, None, pool, {}, empty, opts, ctx, early_error=e)

    def run(self, t_start: float, staging_s: float) -> SaveStats:
        """Persist what was staged (on the engine's thread); raises what failed the save."""
        try:
            return self._run(t_start, staging_s)
        except BaseException as e:
            _runtime.drop_locals(e, keep=self.early_error)
            raise
        finally:
            # A failed save's handle is kept until wait() reports it (by a manager, over many
            # failed saves maybe): neither it nor its error may keep the state's tree, its
            # tensors (the layout's sources) or the staging buffers alive meanwhile.
            self.tree, self.staged, self.pending, self.pool = {}, None, None, None
            self.layout = Layout([], {}, {}, {}, self.layout.hash)

    def _run(self, t_start: float, staging_s: float) -> SaveStats:
        t0 = time.perf_counter()
        ctx, loc = self.ctx, self.storage.location
        save_id = ""
        local_error: BaseException | None = None
        mine_written: list[str] = []
        try:
            loc_agreed = loc
            if self.opts.nodes is not None:  # each node's own root: only the step's name must agree
                loc_agreed = "node-local root/" + loc.rstrip("/").rpartition("/")[2]
            agreed = agree(
                ctx,
                self.layout,
                location=loc_agreed,
                seq=self.seq,
                staged_keys=self.staged_keys,
                early_error=self.early_error,
            )
            save_id, given, self.ranks_per_dir = agreed.save_id, agreed.given, agreed.ranks_per_dir
            assert self.staged is not None
            try:  # from here any failure is this rank's outcome, which every rank learns
                mine, files = self.layout.remember(
                    ("files", given, self.opts.max_shard_bytes, ctx.rank), lambda: self._files(given)
                )
                if self.staged_keys is not None and (lost := [c.key for c in mine if c.key not in self.staged_keys]):
                    raise CheckpointError(f"rank {ctx.rank} was given tensors to write it did not copy: {lost[:10]}")
                if self.pending is not None:  # write only what has been copied (overlap mode)
                    self.pending.result()
                # The pages this save's layout does not use, given back off the caller's thread
                # and after the copies, so that it takes no CPU from overlap mode's copier.
                self.staged.trim()
                self.storage.prepare()
                written = write_shards(
                    self.storage,
                    files,
                    self.staged,
                    rank=ctx.rank,
                    save_id=save_id,
                    writer=self.writer,
                    directory=group_dir(ctx.rank, self.ranks_per_dir),
                    layouts=self._layouts(given, files, self.staged),
                )
                index = self._write_index(save_id, written)
                self.storage.sync()
                mine_written = [f.name for f in written.files]
                mine_written.append(placed(index_name(ctx.rank, save_id), ctx.rank, self.ranks_per_dir))
                wrote = Written(len(index), checksum(index), len(written.files))
                outcome = Outcome(payload=wrote, nbytes=written.bytes_written + len(index))
            except Exception as e:
                local_error = e
                # an OSError of a write names no file (ENOSPC): say whose directory, node-local ones differ
                where = (
                    f" (writing into {loc})" if isinstance(e, OSError) and ctx.world > 1 and loc not in str(e) else ""
                )
                outcome = Outcome(error=f"{type(e).__name__}: {e}{where}")
            self.reported_ok = outcome.error is None  # from here rank 0 may commit this save
            totals = finish_together(ctx, "save", outcome, lambda done: self._commit(save_id, done), local_error)
        except BaseException as e:
            if isinstance(e, RankFailure) and e.local is not None:
                local_error = e.local
            self._fail(e, save_id, local_error or self.early_error)
        finally:
            if self.pending is not None:
                self.pending.wait()  # no copy may still write into buffers another save reuses
            if self.staged is not None and self.pool is not None:
                self.pool.release(self.staged)
        nodes, room = self.opts.nodes, None
        if nodes is not None:  # node-local directories: every node's leader commits too
            leaders, exclusive = nodes.nodes.leader_ranks(), not self.opts.overwrite
            room = commit_on_nodes(ctx, self.storage, self.manifest, leaders, self.room, exclusive=exclusive)
        self.storage.keep_cached(mine_written)  # committed: the newest, which a restart here reads
        if nodes is not None and nodes.replicas:
            try:
                replicate(ctx, self.storage, nodes, save_id, room)
            except ReplicaError as e:  # logged as it happens: a training loop may not wait() for its saves
                log.error("stashpoint: %s", e)
                raise
            except Exception as e:  # a peer lost in the middle: the step is committed all the same
                failed = ReplicaError(
                    f"the step at {loc} is committed on every node, but copying it to other nodes failed "
                    f"({type(e).__name__}: {e}); a node lost now takes its files of this step with it"
                )
                log.error("stashpoint: %s", failed)
                raise failed from e
        t1 = time.perf_counter()
        pending = self.pending
        staged_at = pending.done_at if pending is not None and pending.done_at is not None else self.staged_at
        stats = SaveStats(
            path=loc,
            bytes_written=totals.bytes_written,
            num_tensors=totals.tensors,
            num_files=totals.files,
            blocking_s=self.blocking_s,
            staging_s=staging_s,
            persist_s=t1 - t0,
            total_s=t1 - t_start,
            step=self.opts.step,
            rank_bytes_written=outcome.nbytes,
            staged_s=max(0.0, staged_at - t_start),
            step_wait_s=pending.step_wait_s if pending is not None else 0.0,
            writer="thread" if self.writer is None else "process",
            staged_bytes=0 if self.staged is None else sum(s.nbytes for s in self.staged.specs),
            staging_pinned=self.staging_pinned,
        )
        log.info("stashpoint: saved %s", stats)
        return stats

    def _fail(self, e: BaseException, save_id: str, local_error: BaseException | None) -> None:
        loc, rank = self.storage.location, self.ctx.rank
        # Rank 0 commits: where it never tried, nothing was (an object store it cannot reach must
        # not keep its files as a maybe), and where some rank failed (decided) it never tries;
        # else a rank asks the storage.
        decided = isinstance(e, RankFailure) and e.decided
        ask = save_id and not decided and (rank != 0 or self.commit_tried)
        committed = self._committed(save_id) if ask else False
        if committed:
            # rank 0 wrote the manifest but what came after failed: the checkpoint is whole
            if self.ctx.world == 1:  # its directory's sync, say: loadable, durable maybe not
                cause = e.failed[0][1] if isinstance(e, RankFailure) and e.failed else f"{type(e).__name__}: {e}"
                raise CheckpointError(
                    f"the checkpoint at {loc} was committed (its manifest is in place and it loads), but what follows "
                    f"the commit failed ({cause}): it may not survive a power loss; save again to be sure"
                ) from e
            raise CheckpointError(
                f"rank {rank}: the checkpoint at {loc} was committed, but confirming it across the ranks failed "
                f"({type(e).__name__}: {e}); it is complete and loadable"
            ) from e
        # A rank never deletes files of a save that may still be committed: only rank 0 commits,
        # and only once every rank reported success, however long that takes on rank 0.
        undecided = self.reported_ok and rank != 0 and not decided
        if committed is None:  # the storage could not say: keep the files (an uncommitted leftover at worst)
            log.warning("stashpoint: could not tell whether %s was committed; its files are kept", loc)
        elif undecided:
            log.warning(
                "stashpoint: rank %d keeps its files of the save to %s: rank 0 may still commit it (then it is "
                "complete and loadable); if not, a CheckpointManager there removes them (stashpoint verify lists "
                "them)",
                rank,
                loc,
            )
        elif save_id:
            own = group_dir(rank, self.ranks_per_dir)
            self._remove(lambda name: _shard_of(name, rank, save_id), self.storage.best_effort(), own)
        if isinstance(e, CollectiveError):
            _dist.forget(self.ctx)
        if isinstance(e, RankFailure):
            where = "" if self.ctx.world == 1 else f" on rank(s) {', '.join(str(r) for r, _ in e.failed)}"
            causes = e.failed[0][1] if self.ctx.world == 1 else str(e)
            msg = f"saving the checkpoint to {loc} failed{where}: {causes}"
        else:
            msg = f"saving the checkpoint to {loc} failed on rank {rank}: {type(e).__name__}: {e}"
            local_error = e
        log.error("stashpoint: %s", msg)
        if msg.endswith(".") and not msg.endswith(".."):  # the sentences below start after one full stop
            msg = msg[:-1]
        if undecided:
            raise CheckpointError(
                f"{msg}. This rank could not learn whether rank 0 committed the save: the checkpoint there is either "
                "complete and loadable or not committed at all; earlier checkpoints are untouched."
            ) from local_error
        if committed is None:
            raise CheckpointError(
                f"{msg}. Whether it was committed could not be told (its manifest could not be read back): the "
                "checkpoint there is either complete and loadable or not committed at all, and its files are kept; "
                "earlier checkpoints are untouched."
            ) from local_error
        raise CheckpointError(
            f"{msg}. Nothing was committed there and earlier checkpoints are untouched; fix the cause and save again."
        ) from local_error

    def _committed(self, save_id: str) -> bool | None:
        """Whether this save's manifest is in place (None: the storage could not say)."""
        try:
            try:
                return self._manifest_id(missing=True) == save_id
            except FileNotFoundError:
                # an object store's 404 may be a lagging replica's: its listing is asked too, as
                # before a step directory without its manifest is taken for a leftover
                return None if not self.storage.atomic_rename and self.storage.listed(MANIFEST_NAME) else False
        except NotADirectoryError:  # the path is a file: no manifest can be under it
            return False
        except (OSError, MemoryError):  # the manifest may be there: its files stay
            return None

    def _manifest_id(self, *, missing: bool = False) -> str | None:
        """The save id of the manifest in place: None where there is none (``missing``: raise
        FileNotFoundError then), or a damaged one (any file may be in the way: parsed within the
        bounds a load keeps, and its seal checked)."""
        try:
            doc, _ = open_sealed(self.storage.read(MANIFEST_NAME, 0, MAX_MANIFEST_BYTES + 1), self.storage.location)
        except (FileNotFoundError, CheckpointError) as e:
            # unread (an object store's failure, memory short) is not absent: the caller decides
            if isinstance(e, (OSError, MemoryError)) and (missing or not isinstance(e, FileNotFoundError)):
                raise
            return None
        found = doc.get("save_id")
        return found if isinstance(found, str) else None

    def _remove(self, doomed: Any, storage: Storage | None = None, group: str | None = None) -> None:
        """Delete the save files that ``doomed(name)`` picks: anywhere, or in ``group`` alone."""
        storage = storage or self.storage
        try:
            try:
                names = storage.list() if not group else [f"{group}/{n}" for n in storage.child(group).list()]
            except (FileNotFoundError, NotADirectoryError):  # nothing was made there: nothing to remove
                return
            for name in names:
                if parse_save_file(name) is not None and doomed(name):
                    storage.delete(name)
        except (OSError, CheckpointError) as e:  # best effort
            log.warning("stashpoint: could not remove files in %s: %s", storage.location, e)

    def _files(self, given: frozenset[Any]) -> tuple[list[ChunkMeta], tuple[FilePlan, ...]]:
        """The chunks this rank writes, and its files of them: once per layout and plan."""
        mine = [c for c in self.layout.chunks if c.ident in given]
        staged = self.staged
        if (
            mine  # a rank given nothing writes no file (plan_files of nothing is one empty file)
            and staged is not None
            and len(mine) == len(staged.specs)
            and all(c.key == s.key for c, s in zip(mine, staged.specs))
        ):  # the staging plan's tensors (a world of one, or as copied): its files, not a second plan
            return mine, staged.plan.files
        specs = [TensorSpec(c.key, c.dtype, c.shape, c.itemsize) for c in mine]
        files = plan_files(specs, max_file_bytes=self.opts.max_shard_bytes, rank=self.ctx.rank).files if mine else ()
        return mine, tuple(files)

    def _layouts(
        self, given: frozenset[Any], files: tuple[FilePlan, ...], staged: StagingBuffers
    ) -> tuple[FileLayout, ...]:
        """The files' layouts in ``staged``: once per layout, plan and staging plan (the value
        kept holds the staging plan, so its id stays its own)."""
        key = ("layouts", given, self.opts.max_shard_bytes, self.ctx.rank, id(staged.plan))
        kept: tuple[Any, tuple[FileLayout, ...]] = self.layout.remember(
            key, lambda: (staged.plan, file_layouts(files, staged))
        )
        return kept[1]

    def _index_json(self, save_id: str, written: WrittenShards) -> bytes:
        """This rank's index: each chunk's row as RankIndex.to_json makes it, without a record per chunk."""
        boxes = self.layout.remember("boxes", lambda: {c.key: box_json(c.offsets, c.shape) for c in self.layout.chunks})
        number = {f.name: i for i, f in enumerate(written.files)}
        rows = ((key, number[f], boxes[key], start, end, sums) for key, (f, start, end, sums) in written.chunks.items())
        return index_json(self.ctx.rank, save_id, written.files, rows, self.tree)

    def _write_index(self, save_id: str, written: WrittenShards) -> bytes:
        """Write this rank's index (what it wrote, and its state tree) beside its shards."""
        raw = self._index_json(save_id, written)
        name = placed(index_name(self.ctx.rank, save_id), self.ctx.rank, self.ranks_per_dir)
        out = self.storage.open_writer(name, len(raw))
        try:
            out.write(raw)
            out.close()
        except BaseException:
            out.abort()
            raise
        return raw

    def _commit(self, save_id: str, outcomes: list[Outcome]) -> Totals:
        """Rank 0: write the manifest (the commit); with ``overwrite``, then remove the old shards."""
        loc = self.storage.location
        plan = self.ctx.last_plan
        assert plan is not None and plan.catalog is not None
        written: list[Written] = [o.payload for o in outcomes]
        head = Head(
            save_id=save_id,
            created=utc_stamp(),
            library_version=__version__,
            torch_version=torch.__version__,
            world_size=self.ctx.world,
            indexes=tuple((w.index_size, w.index_checksum) for w in written),
            catalog=plan.catalog,
            metadata=self.opts.metadata,
            ranks_per_dir=self.ranks_per_dir,
        )
        self.manifest = head.to_json(plan.catalog_json)
        if self.opts.nodes is not None and self.opts.nodes.replicas:
            self.room = node_room(self.opts.nodes, [o.nbytes for o in outcomes])
        replaced = None
        if self.opts.overwrite:  # whose files go once this manifest replaced it
            try:
                replaced = self._manifest_id()
            except (OSError, MemoryError):  # unknown: its files stay (a leak, never a loss)
                pass
        try:  # without overwrite, of two saves racing to one new path exactly one commits
            self.commit_tried = True
            self.storage.commit(MANIFEST_NAME, self.manifest, exclusive=not self.opts.overwrite)
        except FileExistsError:
            raise CheckpointError(
                f"another save committed a checkpoint at {loc} while this one was being written "
                "(overwrite=False); this save's files are removed. Pass overwrite=True to replace it, "
                "or save to a new path"
            ) from None
        if replaced is not None and replaced != save_id:
            # Only the checkpoint this one replaced: the files of another save still writing to
            # this path (which may commit after us, and win) must stay whole.
            self._remove(lambda name: (p := parse_save_file(name)) is not None and p[1] == replaced)
        return Totals(sum(o.nbytes for o in outcomes), sum(w.files for w in written), len(plan.catalog))
