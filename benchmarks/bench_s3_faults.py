"""How long a stalled S3 server holds each part of stashpoint: a SeaweedFS server this script
starts, behind the tests' fault-injecting proxy (``tests/s3_faults.py``) that answers nothing.

    python -m benchmarks.bench_s3_faults [--timeout 5] [--retry 1] [--src DIR]

Each case runs in a fresh process (``--src``: the ``src`` directory of the stashpoint to
measure, to compare two commits), with ``STASHPOINT_S3_TIMEOUT_SECONDS`` and
``STASHPOINT_S3_RETRY_SECONDS`` set; it prints the seconds each call took, and how many requests
reached the proxy, in units of the timeout too:

- ``control``: one HeadBucket (``S3Storage.prepare``) to a stalled server;
- ``call``: an ``async_save`` call (the training thread) when the manifest HEAD stalls once;
- ``upload``: a manager's upload of one step when every request stalls (until ``wait()`` fails);
- ``close``: four steps saved, then ``close()``: one upload stalled, three queued behind it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUCKET = "bench"

CASE = r"""
import json, sys, tempfile, time, torch
sys.path.insert(0, {tests!r})
from s3_faults import FaultProxy
import os
proxy = FaultProxy(int(os.environ["BENCH_UPSTREAM"])).start()
os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
import stashpoint
from stashpoint._storage.s3 import S3Storage
url, case = sys.argv[1], sys.argv[2]
state = {{"w": torch.ones(1 << 20)}}
out = {{}}
t = time.monotonic()
if case == "control":
    proxy.set([{{"match": r"^HEAD /{bucket}$", "action": "stall"}}])
    try:
        S3Storage(url).prepare()
    except Exception:
        pass
elif case == "call":
    proxy.set([{{"match": r"manifest\.json", "action": "stall", "times": 1}}])
    try:
        h = stashpoint.async_save(state, url)
        out["call_s"] = time.monotonic() - t
        h.wait()
    except Exception as e:  # from the call itself, on the training thread
        out.setdefault("call_s", time.monotonic() - t)
        out["raised"] = type(e).__name__
else:
    mgr = stashpoint.CheckpointManager(tempfile.mkdtemp(), remote_root=url)
    proxy.set([{{"match": "", "action": "stall"}}])
    t = time.monotonic()
    for step in range(1, 2 if case == "upload" else 5):
        mgr.save(step, state)
    if case == "upload":
        try:
            mgr.wait()
        except Exception:
            pass
    else:
        try:
            mgr.close()  # the first upload fails, then the three queued behind it
        except Exception:
            pass
out.setdefault("s", time.monotonic() - t)
out["requests"] = len(proxy.requests())
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timeout", type=float, default=5.0, help="STASHPOINT_S3_TIMEOUT_SECONDS")
    ap.add_argument("--retry", type=float, default=1.0, help="STASHPOINT_S3_RETRY_SECONDS")
    ap.add_argument("--src", type=Path, default=REPO / "src", help="the stashpoint to measure")
    ap.add_argument("--cases", default="control,call,upload,close")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "tests"))
    from s3_server import SeaweedServer

    with tempfile.TemporaryDirectory(prefix="bench-s3-faults-") as d:
        server = SeaweedServer(Path(d) / "weed", [BUCKET])
        server.start()
        try:
            env = {
                **os.environ,
                **server.env(),
                "BENCH_UPSTREAM": str(server.ports["s3"]),
                "PYTHONPATH": str(args.src.resolve()),
                "STASHPOINT_S3_TIMEOUT_SECONDS": str(args.timeout),
                "STASHPOINT_S3_RETRY_SECONDS": str(args.retry),
            }
            code = CASE.format(tests=str(REPO / "tests"), bucket=BUCKET)
            print(f"stashpoint from {args.src}; timeout {args.timeout:g} s, retry budget {args.retry:g} s\n")
            print("| case | seconds | in timeouts | requests |")
            print("|---|---:|---:|---:|")
            for i, case in enumerate(args.cases.split(",")):
                url = f"s3://{BUCKET}/run-{i}"
                p = subprocess.run(
                    [sys.executable, "-c", code, url, case], env=env, capture_output=True, text=True, timeout=1800
                )
                line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    print(f"| {case} | failed: {p.stderr[-300:]!r} | | |")
                    continue
                r = json.loads(line[7:])
                s = r.get("call_s", r["s"])
                raised = f" (raised {r['raised']})" if "raised" in r else ""
                print(f"| {case} | {s:.1f}{raised} | {s / args.timeout:.1f} | {r['requests']} |", flush=True)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
