"""Configuration of the S3 backend: tuning options, and one client per bucket and process.

The endpoint, region and credentials come from the standard AWS sources, resolved by botocore
(boto3 is not imported) exactly as the AWS CLI and boto3 resolve them: the environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``/``AWS_DEFAULT_REGION``,
``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``, ``AWS_PROFILE``), then ``~/.aws/credentials`` and
``~/.aws/config`` (or ``AWS_SHARED_CREDENTIALS_FILE``/``AWS_CONFIG_FILE``), then the rest of the
AWS chain (SSO, assumed roles, ``credential_process``, container and instance credentials).

Bytes move through obstore (Rust, outside the GIL; see benchmarks/RESULTS.md for the
measurement behind that choice). botocore resolves the configuration and makes the few calls
obstore lacks (``HeadBucket``, listing and aborting multipart uploads).
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

from stashpoint import _runtime
from stashpoint._storage.base import env_number
from stashpoint.errors import S3Error

MiB = 1024 * 1024
#: S3's limits on a multipart upload's parts (all but the last).
MIN_PART, MAX_PART = 5 * MiB, 5 * 1024 * MiB
INSTALL_HINT = "pip install 'stashpoint[s3]'"


@dataclass(frozen=True)
class S3Options:
    """How the S3 backend moves bytes. Every field has an environment variable, read by
    :meth:`from_env` when a storage is made from an ``s3://`` URL."""

    #: Size of each multipart-upload part, and of each ranged GET (``STASHPOINT_S3_PART_MB``).
    part_size: int = 32 * MiB
    #: Parts uploaded, or ranges fetched, in parallel per file (``STASHPOINT_S3_CONCURRENCY``).
    concurrency: int = 8
    #: How long one request is retried (exponential backoff) on transient errors: connection
    #: refused or reset, timeouts, 5xx, throttling (``STASHPOINT_S3_RETRY_SECONDS``).
    retry_seconds: float = 90.0
    #: Time limit of one HTTP request (``STASHPOINT_S3_TIMEOUT_SECONDS``).
    timeout_seconds: float = 120.0

    def __post_init__(self) -> None:
        if not MIN_PART <= self.part_size <= MAX_PART:
            raise ValueError(f"S3 part_size={self.part_size} must be between 5 MiB and 5 GiB (S3's limits)")
        if self.concurrency < 1:
            raise ValueError(f"S3 concurrency={self.concurrency} must be at least 1")
        if self.retry_seconds < 0 or self.timeout_seconds <= 0:
            raise ValueError(
                f"S3 retry_seconds={self.retry_seconds} must be >= 0 and timeout_seconds={self.timeout_seconds} > 0"
            )

    @classmethod
    def from_env(cls) -> S3Options:
        d = cls()
        return cls(
            part_size=int(env_number("STASHPOINT_S3_PART_MB", d.part_size, MIN_PART, MAX_PART, MiB)),
            concurrency=int(env_number("STASHPOINT_S3_CONCURRENCY", d.concurrency, 1, 256)),
            retry_seconds=env_number("STASHPOINT_S3_RETRY_SECONDS", d.retry_seconds, 0, 86400),
            timeout_seconds=env_number("STASHPOINT_S3_TIMEOUT_SECONDS", d.timeout_seconds, 0.1, 86400),
        )


@dataclass(frozen=True)
class S3Client:
    """The clients of one bucket in one process: obstore's store (data) and botocore's (control)."""

    bucket: str
    store: Any  # obstore.store.S3Store
    control: Any  # botocore S3 client
    endpoint: str  # where requests go, for messages
    custom_endpoint: bool
    credentials_from: str  # where the credentials were found, for messages
    # holds "bucket" once a HeadBucket found it usable: a save asks once per process, not per
    # save on every rank (16,384 requests a save at that scale); a later refusal still names the fix
    checked: set[str] = field(default_factory=set, compare=False, repr=False)

    def credentials_hint(self) -> str:
        return (
            f"check the credentials (found in: {self.credentials_from}): AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary keys), or AWS_PROFILE and "
            "~/.aws/credentials; and that they may use this bucket"
        )

    def endpoint_hint(self) -> str:
        if self.custom_endpoint:
            return f"is the server at {self.endpoint} up? (AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 set it)"
        return f"is {self.endpoint} reachable? For MinIO, SeaweedFS, R2 and the like set AWS_ENDPOINT_URL"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: blocked (sys.modules[module] is None)
        return False


def check_installed() -> None:
    """Raise a clear ImportError, naming the extra to install, if the S3 clients are missing."""
    missing = [m for m in ("obstore", "botocore") if not _importable(m)]
    if missing:
        raise ImportError(f"s3:// paths need the S3 extra: {INSTALL_HINT} (missing: {', '.join(missing)})")


def _import_clients() -> tuple[Any, Any]:
    try:
        import botocore.session  # not boto3: its import alone doubles the time to the first request
        import obstore
    except ImportError as e:
        raise ImportError(f"s3:// paths need the S3 extra: {INSTALL_HINT} (missing: {e.name})") from e
    return botocore.session, obstore


_AWS_SUFFIXES = (".amazonaws.com", ".amazonaws.com.cn")


class _RefreshingCredentials:
    """obstore credential provider over botocore's refreshable credentials (SSO, roles...)."""

    def __init__(self, creds: Any) -> None:
        self._creds = creds

    def __call__(self) -> dict[str, Any]:
        frozen = self._creds.get_frozen_credentials()
        expires = _dt.datetime.now(_dt.timezone.utc) + _dt.timedelta(minutes=5)
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": expires,
        }


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


def _make_client(bucket: str, opts: S3Options) -> S3Client:
    sessions, _ = _import_clients()
    import botocore
    from botocore.config import Config
    from obstore.store import S3Store

    session = sessions.get_session()
    creds = session.get_credentials()
    control = session.create_client(
        "s3",
        config=Config(
            # one attempt: s3list.retrying retries within STASHPOINT_S3_RETRY_SECONDS (botocore's
            # own attempts each waited the whole timeout, 4x it against a stalled server)
            retries={"mode": "standard", "total_max_attempts": 1},
            connect_timeout=min(10.0, opts.timeout_seconds),
            read_timeout=opts.timeout_seconds,
            s3={"addressing_style": "path"},
            # no credentials anywhere: anonymous requests (public buckets), as the data client's
            signature_version=botocore.UNSIGNED if creds is None else None,
        ),
    )
    endpoint = str(control.meta.endpoint_url).rstrip("/")
    host = urlsplit(endpoint).hostname or ""
    custom = not host.endswith(_AWS_SUFFIXES)
    region = session.get_config_variable("region") or control.meta.region_name or "us-east-1"
    config: dict[str, Any] = {"region": region}
    if custom:
        config["endpoint"] = endpoint
        config["virtual_hosted_style_request"] = False  # path style: what custom servers expect
    provider = None
    source = "nowhere"
    if creds is not None:
        source = {"env": "the environment", "shared-credentials-file": "the credentials file"}.get(
            creds.method, creds.method
        )
        if hasattr(creds, "refresh_needed"):  # refreshable: ask botocore again when they expire
            provider = _RefreshingCredentials(creds)
        else:
            frozen = creds.get_frozen_credentials()
            config["access_key_id"] = frozen.access_key
            config["secret_access_key"] = frozen.secret_key
            if frozen.token:
                config["token"] = frozen.token
    else:
        config["skip_signature"] = True  # no credentials anywhere: anonymous requests (public buckets)
    retry = {
        "max_retries": 1000,  # bounded by time, not by count
        "retry_timeout": _dt.timedelta(seconds=opts.retry_seconds),
        "backoff": {
            "init_backoff": _dt.timedelta(milliseconds=100),
            "max_backoff": _dt.timedelta(seconds=8),
            "base": 2,
        },
    }
    client_options = {
        "allow_http": endpoint.startswith("http://"),
        "timeout": _duration(opts.timeout_seconds),
        "connect_timeout": _duration(min(10.0, opts.timeout_seconds)),
    }
    store = S3Store(
        bucket,
        config=cast("Any", config),
        client_options=cast("Any", client_options),
        retry_config=cast("Any", retry),
        credential_provider=cast("Any", provider),
    )
    return S3Client(bucket, store, control, endpoint, custom, source)


_lock = threading.Lock()
# A fact about obstore's native runtime, which a fork copies but cannot use; unlike the clients
# (in the process-wide slots), it must survive the fork to be checked there.
_used_in_pid: int | None = None


def _clients() -> dict[tuple[Any, ...], S3Client]:
    return _runtime.slot("storage.s3_clients", dict, close=dict.clear, order=40)


def _check_not_forked() -> None:
    """obstore's I/O runtime (its threads) does not survive ``fork``: a forked child that used it
    would hang. Say so instead."""
    if _used_in_pid is not None and _used_in_pid != os.getpid():
        raise S3Error(
            f"this process (pid {os.getpid()}) was forked from one that had already used s3:// paths "
            f"(pid {_used_in_pid}), and the S3 client's I/O threads do not survive a fork. Start such "
            "processes with the 'spawn' or 'forkserver' method (multiprocessing.get_context('spawn'), "
            "torch.multiprocessing.spawn, torchrun), or fork them before the first s3:// call"
        )


def client_for(bucket: str, opts: S3Options) -> S3Client:
    """The (cached) clients of ``bucket``: one per process, bucket, options and AWS environment,
    so a forked child or a changed ``AWS_*`` variable gets a fresh one, and nothing is created per
    request."""
    aws_env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    key = (os.getpid(), bucket, opts, aws_env)
    global _used_in_pid
    with _lock:
        clients = _clients()
        client = clients.get(key)
        if client is None:
            _check_not_forked()
            if len(clients) > 64:  # environments that keep changing: do not grow forever
                clients.clear()
            client = clients[key] = _make_client(bucket, opts)
            _used_in_pid = os.getpid()
    return client


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")`` (empty segments dropped)."""
    if not url.startswith("s3://"):
        raise ValueError(f"not an S3 URL: {url!r}; expected s3://bucket/prefix")
    bucket, _, rest = url[len("s3://") :].partition("/")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket):
        raise ValueError(
            f"{url!r} does not start with a valid bucket name ({bucket!r}): 3-63 lowercase letters, digits, "
            "dots and hyphens; write s3://bucket/prefix"
        )
    parts = [p for p in rest.split("/") if p]
    odd = next((p for p in parts if not addressable(p)), None)
    if odd is not None:
        raise ValueError(f"{url!r}: the prefix segment {odd!r} is '.', '..' or holds a control character; rename it")
    if "\\" in rest:  # a run's steps written under it were listed under another prefix, as none
        raise ValueError(
            f"{url!r}: the prefix holds a backslash, which S3-compatible servers read differently (SeaweedFS "
            "takes it for '/', AWS advises against it); rename it"
        )
    return bucket, "/".join(parts)


def addressable(segment: str) -> bool:
    """Whether the data client can address a key segment: S3 keeps ``.``, ``..`` and control
    characters as they are, obstore refuses them."""
    return segment not in (".", "..") and not has_control(segment)


def has_control(text: str) -> bool:
    """Whether ``text`` holds an ASCII control character (which XML 1.0 request bodies cannot)."""
    return any(ord(c) < 32 or ord(c) == 127 for c in text)
