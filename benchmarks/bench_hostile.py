"""What a small hostile file can make a reader do: time and peak memory of each entry point an
attacker's review found working far past its input's size, each case in a fresh process.

    python -m benchmarks.bench_hostile [--sizes 2000 8000 32000] [--limit-s 120]

Cases (N is each size given):
- ``verify``: a version-1 manifest listing N shard files that are missing, N chunks in all;
- ``hint``: a load into a state without the checkpoint's one key, a key of N parts (``a.a.a...w``);
- ``int-keys``: a load of an index whose dict holds N integer keys of one hash (multiples of 2**61-1);
- ``import-keys``: ``stashpoint import`` of a torch.save file of such a dict;
- ``import-chunks``: ``stashpoint import`` of a 16 MiB DCP tensor whose one chunk is listed N/20 times.

Each prints the outcome (what was raised, or "ok"), the seconds and the process's peak RSS. A case
that runs past ``--limit-s`` is reported as such. Run it against an older checkout with
``PYTHONPATH=that/src`` to see the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

_SETUP = """
import json, os, pickle, resource, sys, tempfile, time, warnings
import torch, stashpoint
from stashpoint._core.sealed import seal
warnings.simplefilter("ignore")
N = int(sys.argv[1])
d = tempfile.mkdtemp()

def index_of(ck):
    name = next(f for f in os.listdir(ck) if f.startswith("index-"))
    return os.path.join(ck, name)

def reseal(path, mutate):
    doc = json.loads(open(path, "rb").read())
    doc.pop("checksum", None)
    mutate(doc)
    open(path, "wb").write(seal(doc))

def report(fn):
    t = time.perf_counter()
    try:
        fn()
        outcome = "ok"
    except Exception as e:
        outcome = type(e).__name__
    took = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"outcome": outcome, "seconds": round(took, 3), "peak_mib": round(peak)}))
"""

# Each case: what to build (in the setup's namespace), then what to time.
CASES = {
    "verify": """
ck = os.path.join(d, "c")
stashpoint.save({"model": {"w": torch.randn(4, 3)}, "step": 3}, ck)
from stashpoint._core.format import checksum
from stashpoint._load.manifest import read_manifest
from stashpoint._storage import storage_for
doc = json.loads(read_manifest(storage_for(ck)).to_json())  # as a version-1 manifest
doc.pop("checksum")
real = doc["files"][0]
at = real["data_start"]
doc["files"] += [{"name": f"missing-{i}", "size": 4096, "data_start": 4096, "header_checksum": "0", "rank": 0}
                 for i in range(N)]
empty = {"file": real["name"], "offsets": [0], "shape": [0], "start": at, "end": at, "checksums": [checksum(b"")]}
doc["tensors"]["model/e"] = {"dtype": "float32", "shape": [0], "chunks": [empty] * N}
for f in os.listdir(ck):
    if f.startswith("index-"):
        os.remove(os.path.join(ck, f))
open(os.path.join(ck, "manifest.json"), "wb").write(seal(doc))
report(lambda: stashpoint.verify(ck))
""",
    "hint": """
ck = os.path.join(d, "c")
stashpoint.save({"a." * N + "w": torch.zeros(1)}, ck)
report(lambda: stashpoint.load({"b": torch.zeros(1)}, ck))
""",
    "int-keys": """
ck = os.path.join(d, "c")
stashpoint.save({"d": {0: 0}, "w": torch.zeros(1)}, ck)
p = (1 << 61) - 1
def crowd(doc):
    for k, node in doc["tree"]["dict"]:
        if k == "d":
            node["dict"] = [[i * p, {"value": 0}] for i in range(1, N + 1)]
reseal(index_of(ck), crowd)
from stashpoint._core.format import checksum
raw = open(index_of(ck), "rb").read()
reseal(os.path.join(ck, "manifest.json"), lambda m: m.__setitem__("indexes", [[len(raw), checksum(raw)]]))
report(lambda: stashpoint.read(ck))
""",
    "import-keys": """
from stashpoint._tools.convert import import_checkpoint
p = (1 << 61) - 1
torch.save({i * p: 0 for i in range(1, N + 1)}, os.path.join(d, "keys.pt"))
report(lambda: import_checkpoint(os.path.join(d, "keys.pt"), os.path.join(d, "out")))
""",
    "import-chunks": """
import torch.distributed.checkpoint as dcp
from stashpoint._tools.convert import import_checkpoint
src = os.path.join(d, "dcp")
dcp.save({"w": torch.randn(1 << 22)}, checkpoint_id=src, no_dist=True)
meta = pickle.load(open(os.path.join(src, ".metadata"), "rb"))
entry = meta.state_dict_metadata["w"]
entry.chunks = [entry.chunks[0]] * max(1, N // 20)
pickle.dump(meta, open(os.path.join(src, ".metadata"), "wb"))
report(lambda: import_checkpoint(src, os.path.join(d, "out")))
""",
}


def run(case: str, n: int, limit_s: float) -> dict[str, object]:
    code = textwrap.dedent(_SETUP) + textwrap.dedent(CASES[case])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, str(n)], env=env, capture_output=True, text=True, timeout=limit_s
        )
    except subprocess.TimeoutExpired:
        return {"outcome": f"still running after {limit_s:.0f} s", "seconds": None, "peak_mib": None}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"outcome": f"failed: {out.stderr.strip().splitlines()[-1:]}", "seconds": None, "peak_mib": None}
    return dict(json.loads(lines[-1]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2000, 8000, 32000])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--limit-s", type=float, default=120.0)
    args = ap.parse_args(argv)
    print("| case | N | outcome | seconds | peak MiB |")
    print("|---|---:|---|---:|---:|")
    for case in args.cases:
        for n in args.sizes:
            r = run(case, n, args.limit_s)
            print(f"| {case} | {n} | {r['outcome']} | {r['seconds']} | {r['peak_mib']} |", flush=True)


if __name__ == "__main__":
    main()
