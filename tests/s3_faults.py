"""A fault-injecting HTTP/1.1 proxy between stashpoint and the tests' real S3 server.

    proxy = FaultProxy(server.ports["s3"]).start()
    proxy.set([{"match": r"^HEAD .*/manifest\\.json$", "action": "status", "status": 404, "times": 1}])

A rule: ``match`` (a regex searched in ``"METHOD /path?query"``), ``times`` (how many matching
requests it takes; default every one) and ``action``:

- ``status``: answer ``status`` with an S3 error ``code`` without forwarding;
- ``reset``: read the request, then reset the connection (the server never sees it);
- ``stall``: read the request and answer nothing for ``seconds``;
- ``lost_reply``: forward (the server does the work), then reset instead of answering;
- ``forward_then_status``: forward, then answer ``status`` (a gateway's 503 after the work);
- ``corrupt``: forward, and flip the bits of the reply body's byte ``at``;
- ``delete_errors``: answer a DeleteObjects with a per-key ``code`` error for every key;
- ``list_empty_pages``: answer a ListObjectsV2 with empty pages, each with a new token.

Every request since the last :meth:`set` is logged: :meth:`requests` gives ``(what, action,
status)`` of those matching.
"""

from __future__ import annotations

import re
import socket
import struct
import threading
from typing import Any


def _until(sock: socket.socket, buf: bytearray, marker: bytes) -> int:
    while (i := buf.find(marker)) < 0:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("closed")
        buf += data
    return i


def _exactly(sock: socket.socket, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        data = sock.recv(max(65536, n - len(buf)))
        if not data:
            raise ConnectionError("closed")
        buf += data
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _message(sock: socket.socket, buf: bytearray, *, no_body: bool = False) -> tuple[str, list[tuple[str, str]], bytes]:
    """The start line, headers and (de-chunked) body of one HTTP message."""
    i = _until(sock, buf, b"\r\n\r\n")
    lines = bytes(buf[:i]).decode("latin-1").split("\r\n")
    del buf[: i + 4]
    headers = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:])]
    h = {k.lower(): v for k, v in headers}
    body = b""
    if no_body:
        pass
    elif "chunked" in h.get("transfer-encoding", "").lower():
        parts = []
        while True:
            j = _until(sock, buf, b"\r\n")
            size = int(bytes(buf[:j]).split(b";")[0], 16)
            del buf[: j + 2]
            if size == 0:
                j = _until(sock, buf, b"\r\n")
                del buf[: j + 2]
                break
            parts.append(_exactly(sock, buf, size))
            _exactly(sock, buf, 2)
        body = b"".join(parts)
        headers = [(k, v) for k, v in headers if k.lower() != "transfer-encoding"]
        headers.append(("Content-Length", str(len(body))))
    elif "content-length" in h:
        body = _exactly(sock, buf, int(h["content-length"]))
    return lines[0], headers, body


def _render(start: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    head = "\r\n".join([start, *(f"{k}: {v}" for k, v in headers)])
    return head.encode("latin-1") + b"\r\n\r\n" + body


def _length(headers: list[tuple[str, str]], n: int) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers if k.lower() != "content-length"] + [("Content-Length", str(n))]


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _error(status: int, code: str, head: bool) -> bytes:
    body = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>injected</Message></Error>'
    return _render(
        f"HTTP/1.1 {status} Injected",
        [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
        b"" if head else body.encode(),
    )


class FaultProxy:
    """A proxy on a free port of 127.0.0.1 in front of the S3 server on ``upstream_port``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.lock = threading.Lock()
        self.rules: list[dict[str, Any]] = []
        self.log: list[tuple[str, str, str]] = []
        self.stopped = threading.Event()
        self._tokens = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        threading.Thread(target=self._accept, daemon=True, name="s3-fault-proxy").start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.srv.close()

    def set(self, rules: list[dict[str, Any]]) -> None:
        """Apply ``rules`` from now on; the log starts again."""
        with self.lock:
            self.rules = [{**r, "_taken": 0} for r in rules]
            self.log = []

    def requests(self, pattern: str = "") -> list[tuple[str, str, str]]:
        with self.lock:
            return [e for e in self.log if re.search(pattern, e[0])]

    def _pick(self, what: str) -> dict[str, Any]:
        with self.lock:
            for rule in self.rules:
                if re.search(rule.get("match", ""), what) and rule["_taken"] < rule.get("times", float("inf")):
                    rule["_taken"] += 1
                    return rule
        return {"action": "pass"}

    def _note(self, what: str, action: str, status: str) -> None:
        with self.lock:
            self.log.append((what, action, status))

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                client, _ = self.srv.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        up: socket.socket | None = None
        cbuf, ubuf = bytearray(), bytearray()
        try:
            while True:
                start, headers, body = _message(client, cbuf)
                method, path = start.split(" ")[:2]
                what = f"{method} {path}"
                rule = self._pick(what)
                action = rule["action"]
                if action in ("reset", "stall"):
                    self._note(what, action, "-")
                    if action == "stall":
                        self.stopped.wait(float(rule.get("seconds", 3600)))
                    _reset(client)
                    return
                if action in ("status", "delete_errors"):
                    if action == "status":
                        reply = _error(int(rule.get("status", 503)), rule.get("code", "SlowDown"), method == "HEAD")
                    else:
                        code = rule.get("code", "SlowDown")
                        errors = "".join(
                            f"<Error><Key>{k}</Key><Code>{code}</Code><Message>x</Message></Error>"
                            for k in re.findall(r"<Key>(.*?)</Key>", body.decode())
                        )
                        xml = f'<?xml version="1.0" encoding="UTF-8"?><DeleteResult>{errors}</DeleteResult>'.encode()
                        reply = _render("HTTP/1.1 200 OK", [("Content-Length", str(len(xml)))], xml)
                    client.sendall(reply)
                    self._note(what, action, reply.split(b" ", 2)[1].decode())
                    continue
                if up is None:
                    up = socket.create_connection(self.upstream)
                up.sendall(_render(start, headers, body))
                rstart, rheaders, rbody = _message(up, ubuf, no_body=method == "HEAD")
                status = rstart.split(" ")[1]
                self._note(what, action, status)
                if action == "lost_reply":
                    _reset(client)
                    return
                if action == "forward_then_status":
                    client.sendall(_error(int(rule.get("status", 503)), rule.get("code", "SlowDown"), method == "HEAD"))
                    continue
                if action == "corrupt" and rbody:
                    flipped = bytearray(rbody)
                    flipped[min(int(rule.get("at", 0)), len(rbody) - 1)] ^= 0xFF
                    rbody = bytes(flipped)
                if action == "list_empty_pages" and "list-type=2" in path:
                    rbody, rheaders = self._empty_page(rbody), _length(rheaders, 0)
                    rheaders = _length(rheaders, len(rbody))
                client.sendall(_render(rstart, rheaders, rbody))
        except OSError:  # ConnectionError too: a side closed
            return
        finally:
            client.close()
            if up is not None:
                up.close()

    def _empty_page(self, body: bytes) -> bytes:
        text = body.decode()
        for tag in ("IsTruncated", "NextContinuationToken", "Contents", "CommonPrefixes"):
            text = re.sub(rf"<{tag}>.*?</{tag}>", "", text, flags=re.S)
        with self.lock:
            self._tokens += 1
            token = f"token-{self._tokens}"
        more = f"<IsTruncated>true</IsTruncated><NextContinuationToken>{token}</NextContinuationToken>"
        return text.replace("</ListBucketResult>", more + "</ListBucketResult>").encode()
