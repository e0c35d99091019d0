"""The tool commands (ls, inspect, verify, diff, export, import) on real checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import load_file

import stashpoint
from conftest import ROOT, small_model, train_steps, whole
from dist_util import run_world
from stashpoint._core.format import seal
from stashpoint._tools.cli import main


def cli(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def one_line_error(r: Result, *needles: str) -> None:
    """Exit 2 with one line on stderr that says what is wrong."""
    assert r.exit_code == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = small_model()
        self.emb = torch.nn.Embedding(4, 8)
        self.head = torch.nn.Linear(8, 4, bias=False)
        self.head.weight = self.emb.weight  # tied: stored once, an alias in the manifest


class _Trap:
    """Unpickling this creates a directory: the tools must never unpickle."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, Path]:
    """A one-process checkpoint: a model with tied weights, its optimizer, plain and pickled values."""
    d = tmp_path_factory.mktemp("single")
    torch.manual_seed(0)
    model = Tied()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model.body, optim, 2)
    extra = {"nan": float("nan"), "raw": b"\x00\x01", "pair": (1, "two")}
    state = {"model": model, "optim": optim, "step": 7, "extra": extra, "obj": _Trap(str(d / "UNPICKLED"))}
    stashpoint.save(state, d / "ck", allow_pickle=True, metadata={"note": "hello"})
    return d / "ck", state, d / "UNPICKLED"


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A 2-rank FSDP2 checkpoint: every parameter and moment is 2 chunks, one per rank's shard."""
    path = tmp_path_factory.mktemp("fsdp") / "ck"
    run_world(2, "fsdp_save", str(path))
    return path, torch.load(str(path) + ".ref.pt", weights_only=True)


def manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "ck"))


def flip_byte(path: Path, key: str, chunk: int = 0, at: int = 0) -> str:
    c = whole(path).tensors[key].chunks[chunk]
    with open(path / c.file, "r+b") as f:
        f.seek(c.start + at)
        b = f.read(1)
        f.seek(c.start + at)
        f.write(bytes([b[0] ^ 0x55]))
    return c.file


# -- ls -----------------------------------------------------------------------------------------


def test_ls_lists_committed_and_partial_steps(tmp_path: Path) -> None:
    model = small_model()
    with stashpoint.CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in (10, 20):
            mgr.save(step, {"model": model, "step": step}, metrics={"loss": 1 / step})
    partial = tmp_path / "step-00000030"
    partial.mkdir()
    (partial / "shard-r00000-0000-abc.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "notes.txt").write_text("not a step")
    (tmp_path / "step-00000040").mkdir()
    (tmp_path / "step-00000040" / "manifest.json").write_text("{damaged")

    r = cli("ls", tmp_path)
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    assert lines[0].split() == ["STEP", "STATUS", "SIZE", "AGE", "METRICS"]
    statuses = [ln.split()[:2] for ln in lines[1:]]
    assert statuses == [["10", "committed"], ["20", "committed"], ["30", "partial"], ["40", "unreadable"]]
    assert "malformed manifest" in lines[4]
    assert "loss=0.1" in lines[1] and "loss=0.05" in lines[2]
    assert "100 B" in lines[3]

    steps = json.loads(cli("ls", tmp_path, "--json").stdout)
    assert [s["step"] for s in steps] == [10, 20, 30, 40]
    assert steps[0]["metrics"] == {"loss": 0.1} and steps[2]["metrics"] == {}
    assert steps[0]["created"] and steps[2]["created"] is None
    assert steps[2]["size"] == 100
    assert steps[0]["size"] == sum(f.stat().st_size for f in (tmp_path / "step-00000010").iterdir())
    assert all(0 <= s["age_s"] < 600 for s in steps)


def test_ls_errors_and_empty_runs(tmp_path: Path, single) -> None:
    one_line_error(cli("ls", tmp_path / "nope"), str(tmp_path / "nope"), "does not exist")
    one_line_error(cli("ls", single[0]), "is a checkpoint", "stashpoint inspect")
    r = cli("ls", tmp_path)
    assert r.exit_code == 0 and "no step directories" in r.stdout


# -- inspect ------------------------------------------------------------------------------------


def test_inspect_shows_tensors_values_metadata_without_unpickling(single) -> None:
    path, _, sentinel = single
    r = cli("inspect", path)
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "model/body.0.weight" in out and "float32" in out and "[16, 8]" in out and "1 chunk" in out
    assert "alias of model/emb.weight" in out  # model/head.weight, tied
    assert "step = 7" in out and "extra/pair = [1, 'two']" in out and "extra/nan = nan" in out
    assert "obj = <pickled, not loaded>" in out and "note = hello" in out
    assert "world size  1" in out and "stashpoint v2" in out

    d = json.loads(cli("inspect", path, "--json").stdout)
    tensors = {t["key"]: t for t in d["tensors"]}
    assert tensors["model/body.0.weight"]["bytes"] == 16 * 8 * 4
    assert tensors["model/head.weight"]["sharding"] == "alias of model/emb.weight"
    assert set(tensors) == set(manifest(path)["tensors"])
    assert d["values"]["step"] == 7 and d["values"]["obj"] == "<pickled, not loaded>"
    assert d["values"]["optim/param_groups/0/lr"] == 0.01 and d["metadata"] == {"note": "hello"}
    assert d["world_size"] == 1 and d["format_version"] == 2
    assert [f["name"] for f in d["files"]] == [p.name for p in sorted(path.glob("shard-*"))]
    assert not sentinel.exists()


def test_inspect_multi_rank(fsdp) -> None:
    path, _ = fsdp
    d = json.loads(cli("inspect", path, "--json").stdout)
    tensors = {t["key"]: t for t in d["tensors"]}
    assert d["world_size"] == 2 and tensors["model/0.weight"]["shape"] == [64, 16]
    assert tensors["model/0.weight"]["sharding"] == "2 chunks"
    assert sorted(f["rank"] for f in d["files"]) == [0, 1]
    assert "2 chunks" in cli("inspect", path).stdout
    one_line_error(cli("inspect", path, "--rank", "2"), "rank 2", "2 rank(s)")


@pytest.mark.parametrize("command", ["inspect", "verify", "export", "diff"])
def test_not_a_checkpoint_is_one_line_exit_2(tmp_path: Path, single, command: str) -> None:
    extra = {"export": [tmp_path / "o.safetensors"], "diff": [single[0]]}.get(command, [])
    one_line_error(cli(command, tmp_path / "nope", *extra), str(tmp_path / "nope"), "does not exist")
    one_line_error(cli(command, tmp_path, *extra), "not a stashpoint checkpoint")
    partial = tmp_path / "step-00000005"
    partial.mkdir()
    (partial / "shard-r00000-0000-x.safetensors").write_bytes(b"")
    one_line_error(cli(command, partial, *extra), "no committed checkpoint")
    one_line_error(cli(command, tmp_path, *extra), "run directory", "step-00000005")
    f = tmp_path / "model.pt"
    f.write_bytes(b"x")
    one_line_error(cli(command, f, *extra), "is a file", "stashpoint import")


# -- verify -------------------------------------------------------------------------------------


def test_verify_clean_checkpoints(single, fsdp) -> None:
    for path in (single[0], fsdp[0]):
        r = cli("verify", path)
        assert r.exit_code == 0, r.output
        n = len(whole(path).files)
        assert (
            f"[{n}/{n}]" in r.stderr
            and f"[{n}/{n}]" not in r.stdout
            and r.stdout.strip().splitlines()[-1].startswith("OK:")
        )
    rep = json.loads(cli("verify", "--json", fsdp[0]).stdout)
    assert rep["ok"] and rep["problems"] == [] and rep["files"] == 2
    assert rep["bytes_checked"] == sum(
        t["bytes"] for t in json.loads(cli("inspect", fsdp[0], "--json").stdout)["tensors"]
    )


def test_verify_shows_a_file_name_holding_newlines_on_one_line(single, tmp_path: Path) -> None:
    """Before: a file named "x\nproblem: none\nOK: ..." printed lines that looked like verify's own."""
    path = copy(single[0], tmp_path)
    (path / "x\nproblem: none\nOK: 1 file(s)").write_bytes(b"")
    r = cli("verify", path)
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    assert not [ln for ln in lines if ln.startswith("problem:")], lines
    assert len([ln for ln in lines if ln.startswith("OK:")]) == 1, lines
    assert any(ln.startswith("warning: ") and "x\\nproblem: none\\nOK" in ln for ln in lines), lines


def test_verify_flipped_bytes_names_every_key_and_file(fsdp, tmp_path: Path) -> None:
    path = copy(fsdp[0], tmp_path)
    f1 = flip_byte(path, "model/0.weight", chunk=1, at=5)
    f2 = flip_byte(path, "optim/state/2.bias/exp_avg_sq", chunk=0)
    (path / "shard-r00000-0001-0123456789abcdef.safetensors").write_bytes(b"old")
    r = cli("verify", path)
    assert r.exit_code == 1, r.output
    problems = [ln for ln in r.stdout.splitlines() if ln.startswith("problem:")]
    assert len(problems) == 2, r.stdout
    assert any("'model/0.weight'" in p and f1 in p for p in problems)
    assert any("'optim/state/2.bias/exp_avg_sq'" in p and f2 in p for p in problems)
    assert "warning:" in r.stdout and "shard-r00000-0001-0123456789abcdef" in r.stdout
    assert "FAILED: 2 problem(s)" in r.stdout
    with pytest.raises(stashpoint.CorruptCheckpointError):
        stashpoint.load({"model": None, "optim": None}, path)


def test_inspect_shows_the_part_one_nodes_directory_holds(fsdp, tmp_path: Path) -> None:
    """Before: inspect of one node's directory of a node-local run failed, calling it damaged."""
    path = copy(fsdp[0], tmp_path)
    for f in path.glob("*-r00001-*"):  # rank 1's index and shards live on the other node
        f.unlink()
    r = cli("inspect", path)
    assert r.exit_code == 0, r.output
    assert "holds the files of 1 of its 2 ranks (one node's directory of a node-local run)" in r.output
    d = json.loads(cli("inspect", path, "--json").stdout)
    assert d["ranks_elsewhere"] == [1] and {f["rank"] for f in d["files"]} == {0}
    assert json.loads(cli("inspect", path, "--rank", "1", "--json").stdout)["ranks_elsewhere"] == [1]
    assert cli("verify", "-q", path).exit_code == 1, "the whole checkpoint is not here"
    r = cli("verify", "--this-node", path)
    assert r.exit_code == 0 and "the files of 1 of its 2 ranks are on other nodes (rank(s) 1)" in r.stdout, r.stdout
    c = next(c for e in whole(fsdp[0]).tensors.values() for c in e.chunks if c.file.startswith("shard-r00000"))
    with open(path / c.file, "r+b") as f:  # damage in this node's part is still found
        f.seek(c.start)
        b = f.read(1)
        f.seek(c.start)
        f.write(bytes([b[0] ^ 0x55]))
    r = cli("verify", "--this-node", "-q", path)
    assert r.exit_code == 1 and "checksum" in r.stdout, r.stdout


def test_a_missing_index_beside_its_shards_is_damage_not_a_nodes_part(fsdp, tmp_path: Path) -> None:
    """Before: inspect called it one node's directory (verify found the shards nothing lists)."""
    path = copy(fsdp[0], tmp_path)
    (index,) = path.glob("index-r00001-*")
    index.unlink()  # rank 1's shards stay: no node-local directory looks like this
    for args in (("inspect", path), ("verify", "--this-node", path)):
        r = cli(*args)
        assert r.exit_code != 0, r.output
        assert "the index of rank(s) 1 is missing while its shard files are here" in r.output, r.output
    for marker in ("partial-r00001", "replica-r00001"):  # another node's copy landing, or being dropped
        (path / marker).touch()
        r = cli("inspect", path)
        assert r.exit_code == 0 and "holds the files of 1 of its 2 ranks" in r.output, r.output
        (path / marker).unlink()


def test_verify_truncated_and_deleted_shards(fsdp, tmp_path: Path) -> None:
    path = copy(fsdp[0], tmp_path)
    files = [{"name": f.name, "size": f.size} for f in whole(path).files]
    os.truncate(path / files[0]["name"], files[0]["size"] - 100)
    r = cli("verify", "-q", path)
    assert r.exit_code == 1
    assert "[1/2]" not in r.stdout  # --quiet: no progress
    assert f"is truncated: {files[0]['size'] - 100} bytes" in r.stdout and f"{files[0]['name']} (holding" in r.stdout
    assert "ends before the data of" in r.stdout
    (path / files[1]["name"]).unlink()
    r = cli("verify", path)
    assert r.exit_code == 1
    missing = next(line for line in r.stdout.splitlines() if "listed in the manifest is missing" in line)
    assert files[1]["name"] in missing and "(holding 'model/" in missing  # names the keys it held
    assert "FAILED: 3 problem(s)" in r.stdout


def test_verify_damaged_manifest_and_header(single, tmp_path: Path) -> None:
    path = copy(single[0], tmp_path)
    shard = next(path.glob("shard-*"))
    with open(shard, "r+b") as f:  # inside the JSON header
        f.seek(20)
        f.write(b"#")
    r = cli("verify", path)
    assert r.exit_code == 1 and "header of shard" in r.stdout and shard.name in r.stdout
    (path / "manifest.json").write_text("{not json")
    r = cli("verify", path)
    assert r.exit_code == 1 and "malformed manifest" in r.stdout
    one_line_error(cli("inspect", path), "malformed manifest", "use an earlier one")


def test_verify_multi_block_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk of several checksum blocks, read a few blocks at a time: the damaged block is named."""
    from stashpoint._core.format import CHECKSUM_BLOCK_BYTES as BLOCK
    from stashpoint._tools import checking as _checking

    monkeypatch.setattr(_checking, "_SPAN", 2 * BLOCK)
    stashpoint.save({"big": torch.arange(BLOCK * 9 // 32, dtype=torch.int64), "small": torch.ones(3)}, tmp_path / "ck")
    r = cli("verify", tmp_path / "ck")
    assert r.exit_code == 0 and "9.0 MiB of tensor data verified" in r.stdout, r.stdout
    flip_byte(tmp_path / "ck", "big", at=2 * BLOCK + 7)
    start = whole(tmp_path / "ck").tensors["big"].chunks[0].start
    r = cli("verify", tmp_path / "ck")
    assert r.exit_code == 1
    assert f"'big' in shard {tmp_path / 'ck'}/shard-" in r.stdout and "1 of 3 block(s) damaged" in r.stdout
    assert f"at file bytes {start + 2 * BLOCK}-{start + 9 * BLOCK // 4}" in r.stdout


def test_verify_entry_point_exit_codes(single, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = [sys.executable, "-m", "stashpoint", "verify"]
    ok = subprocess.run([*run, str(single[0])], capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    path = copy(single[0], tmp_path)
    flip_byte(path, "model/emb.weight")
    bad = subprocess.run([*run, str(path)], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1 and "'model/emb.weight'" in bad.stdout
    usage = subprocess.run([*run, str(tmp_path / "nope")], capture_output=True, text=True, env=env, timeout=120)
    assert usage.returncode == 2 and "does not exist" in usage.stderr


# -- diff ---------------------------------------------------------------------------------------


def test_diff_identical_and_different(tmp_path: Path) -> None:
    def state(**changes):
        torch.manual_seed(0)
        s = {"w": torch.randn(4, 4), "b": torch.zeros(3), "i": torch.arange(5), "h": torch.ones(2, dtype=torch.float16)}
        s.update({"nanny": torch.tensor([float("nan"), 1.0]), "step": 3, "name": "run"})
        s.update(changes)
        return {k: v for k, v in s.items() if v is not None}

    stashpoint.save(state(), tmp_path / "a")
    stashpoint.save(state(), tmp_path / "a2")
    r = cli("diff", tmp_path / "a", tmp_path / "a2")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == "5 tensor(s) compared (by the checksums recorded; --verify checks the files): identical"
    r = cli("diff", tmp_path / "a", tmp_path / "a2", "--verify")
    assert r.exit_code == 0 and r.stdout.strip() == "5 tensor(s) compared: identical", r.output

    # a damaged copy: equal by the checksums its manifest records, and caught once its files are read
    shutil.copytree(tmp_path / "a", tmp_path / "bad")
    shard = next((tmp_path / "bad").glob("shard-*"))
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size - 1)
        last = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([last[0] ^ 0xFF]))
    assert cli("diff", tmp_path / "a", tmp_path / "bad").exit_code == 0
    one_line_error(cli("diff", tmp_path / "a", tmp_path / "bad", "--verify"), "bad is damaged", "checksum")
    d = json.loads(cli("diff", tmp_path / "a", tmp_path / "a2", "--json").stdout)
    assert d["identical"] and d["compared"] == d["by_checksum"] == 5

    w = state()["w"].clone()
    w[1, 2] += 0.5
    stashpoint.save(state(w=w, b=None, extra=torch.ones(1), i=torch.arange(6), h=torch.ones(2), step=4), tmp_path / "b")
    r = cli("diff", tmp_path / "a", tmp_path / "b")
    assert r.exit_code == 1
    out = r.stdout
    assert "only in A: b" in out and "only in B: extra" in out and "shape:     i: [5] -> [6]" in out
    assert "dtype:     h: float16 -> float32" in out and "data:      w: max |a-b| = 0.5" in out
    assert "nanny" not in out  # NaN in the same place in both counts as equal
    assert "value:     step: 3 -> 4" in out
    summary = (
        "5 tensor(s) and 1 plain value(s) differ (3 tensor(s) of the same shape in both compared, 2 by their data)"
    )
    assert out.strip().endswith(summary), out
    d = json.loads(cli("diff", tmp_path / "a", tmp_path / "b", "--json").stdout)
    assert not d["identical"] and d["values"] == {"w": 0.5} and (d["only_a"], d["only_b"]) == (["b"], ["extra"])
    assert d["plain"] == [{"key": "step", "a": 3, "b": 4}]


def test_diff_and_inspect_tell_apart_keys_that_print_alike_and_see_empty_dicts(tmp_path: Path) -> None:
    """Before: diff said "identical" for these pairs, and inspect showed one of the two values."""
    pairs = [
        ({1: "lr=0.1", "1": "same"}, {1: "lr=9.9", "1": "same"}, "1 (int key): 'lr=0.1' -> 'lr=9.9'"),
        ({"step": 1, "extra": {}}, {"step": 1}, "extra: {} -> <absent>"),
        ({"": {"a": 1}, "a": 2}, {"": {"a": 2}, "a": 1}, "''/a: 1 -> 2"),
        ({1: "x"}, {"1": "x"}, "1 (int key): 'x' -> <absent>"),
    ]
    for i, (a, b, line) in enumerate(pairs):
        stashpoint.save(a, tmp_path / f"a{i}")
        stashpoint.save(b, tmp_path / f"b{i}")
        r = cli("diff", tmp_path / f"a{i}", tmp_path / f"b{i}")
        assert r.exit_code == 1 and line in r.stdout, r.stdout
    shown = json.loads(cli("inspect", tmp_path / "a0", "--json").stdout)["values"]
    assert shown == {"1 (int key)": "lr=0.1", "1": "same"}
    stashpoint.save({"a": 2, "": {"a": 1}}, tmp_path / "c2")  # the same tree, its keys in another order
    assert cli("diff", tmp_path / "a2", tmp_path / "c2").exit_code == 0


def test_diff_multi_rank_against_its_import(fsdp, tmp_path: Path) -> None:
    """A 2-rank sharded checkpoint and a one-process copy of its model: the tensors are equal."""
    path, ref = fsdp
    torch.save({"model": ref["model"]}, tmp_path / "ref.pt")
    assert cli("import", tmp_path / "ref.pt", tmp_path / "one").exit_code == 0
    r = cli("diff", path, tmp_path / "one", "--json")
    d = json.loads(r.stdout)
    assert r.exit_code == 1 and not d["identical"]
    assert d["values"] == {} and d["only_b"] == []  # every model tensor identical, across 2 chunks
    assert all(k.startswith("optim/") for k in d["only_a"])


# -- export -------------------------------------------------------------------------------------


def test_export_single_file_round_trip(single, tmp_path: Path) -> None:
    path, state, sentinel = single
    sd = state["model"].state_dict()
    mask = os.umask(0o022)
    try:
        r = cli("export", path, tmp_path / "m.safetensors", "--select", "model")
    finally:
        os.umask(mask)
    assert r.exit_code == 0 and "left out head.weight: tied to emb.weight" in r.stdout, r.output
    assert (tmp_path / "m.safetensors").stat().st_mode & 0o777 == 0o644, "readable by others, as the umask allows"
    got = load_file(tmp_path / "m.safetensors")
    assert set(got) == set(sd) - {"head.weight"} and all(torch.equal(got[k], sd[k]) for k in got)

    assert cli("export", path, tmp_path / "c.safetensors", "--select", "model", "--tied", "clone").exit_code == 0
    got = load_file(tmp_path / "c.safetensors")
    assert set(got) == set(sd) and torch.equal(got["head.weight"], sd["emb.weight"])

    # everything, names from the full key paths
    assert cli("export", path, tmp_path / "all.safetensors").exit_code == 0
    got = load_file(tmp_path / "all.safetensors")
    assert "model.body.0.weight" in got and "optim.state.body.0.weight.exp_avg" in got
    assert not sentinel.exists()


def test_export_refusals(single, tmp_path: Path) -> None:
    path = single[0]
    out = tmp_path / "m.safetensors"
    assert cli("export", path, out, "--select", "model").exit_code == 0
    one_line_error(cli("export", path, out, "--select", "model"), "already exists", "--overwrite")
    assert cli("export", path, out, "--select", "model", "--overwrite").exit_code == 0
    one_line_error(
        cli("export", path, tmp_path / "x.safetensors", "--select", "nope"), "no tensor under 'nope'", "model"
    )
    r = cli("export", path, tmp_path / "x.safetensors", "--max-shard-size", "5XB")
    assert r.exit_code == 2 and "invalid size" in r.stderr
    stashpoint.save({"c": torch.ones(2, dtype=torch.complex128), "x": torch.ones(2)}, tmp_path / "cx")
    one_line_error(cli("export", tmp_path / "cx", tmp_path / "x.safetensors"), "'c' has dtype complex128", "--select")
    assert cli("export", tmp_path / "cx", tmp_path / "x.safetensors", "--select", "x").exit_code == 0


def test_an_export_that_fails_leaves_the_earlier_export_as_it_was(tmp_path: Path) -> None:
    """Before: --overwrite deleted the earlier files first, so an export failing on a damaged
    block left nothing."""
    stashpoint.save({"model": {"w": torch.ones(64)}}, tmp_path / "good")
    stashpoint.save({"model": {"w": torch.zeros(64)}}, tmp_path / "bad")
    shard = next((tmp_path / "bad").glob("shard-*"))
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1  # the last byte of the tensor's data
    shard.write_bytes(bytes(raw))
    for out in (tmp_path / "one" / "w.safetensors", tmp_path / "dir"):
        assert cli("export", tmp_path / "good", out, "--select", "model").exit_code == 0
        where = out.parent if out.suffix else out
        before = {p.name: p.read_bytes() for p in where.iterdir()}
        r = cli("export", tmp_path / "bad", out, "--select", "model", "--overwrite")
        one_line_error(r, "checksum mismatch")
        assert {p.name: p.read_bytes() for p in where.iterdir()} == before, "no file changed, none left over"
        assert torch.equal(load_file(out if out.suffix else out / "model.safetensors")["w"], torch.ones(64))
    (tmp_path / "a-file").write_text("")
    one_line_error(cli("export", tmp_path / "good", tmp_path / "a-file" / "w.safetensors"), "a-file is a file")


def test_an_export_to_a_name_as_long_as_the_file_system_allows_is_written(tmp_path: Path) -> None:
    """Before: its temporary name (".<name>.partial") was too long, and the error named it."""
    stashpoint.save({"model": {"w": torch.ones(8)}}, tmp_path / "c")
    out = tmp_path / ("e" * (255 - len(".safetensors")) + ".safetensors")
    r = cli("export", tmp_path / "c", out, "--select", "model")
    assert r.exit_code == 0, r.output
    assert torch.equal(load_file(out)["w"], torch.ones(8))
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == [out.name]
    too_long = tmp_path / ("e" * 256 + ".safetensors")
    one_line_error(cli("export", tmp_path / "c", too_long), "longer than the file system allows")


def test_export_multi_rank_consolidates_and_shards(fsdp, tmp_path: Path) -> None:
    path, ref = fsdp
    assert cli("export", path, tmp_path / "m.safetensors", "--select", "model").exit_code == 0
    got = load_file(tmp_path / "m.safetensors")
    assert set(got) == set(ref["model"]) and all(torch.equal(got[k], v) for k, v in ref["model"].items())

    out = tmp_path / "hf"
    r = cli("export", path, out, "--max-shard-size", "5KB")
    assert r.exit_code == 0, r.output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    merged = {}
    for f in files:
        part = load_file(out / f)
        assert all(index["weight_map"][k] == f for k in part)
        merged.update(part)
    assert set(merged) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    assert all(torch.equal(merged[f"model.{k}"], v) for k, v in ref["model"].items())
    assert all(torch.equal(merged[f"optim.state.{k}.exp_avg"], v) for k, v in ref["exp_avg"].items())

    # a directory that fits in one shard: model.safetensors (Hugging Face's single-file layout)
    assert cli("export", path, out, "--overwrite").exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_export_loads_in_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    stashpoint.save({"model": model, "step": 1}, tmp_path / "ck")
    out = tmp_path / "hf"
    r = cli("export", tmp_path / "ck", out, "--select", "model")
    assert r.exit_code == 0, r.output
    model.config.save_pretrained(out)
    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied again


# -- import -------------------------------------------------------------------------------------


def test_import_torch_save(tmp_path: Path) -> None:
    model = small_model(seed=1)
    optim = torch.optim.AdamW(model.parameters())
    train_steps(model, optim, 2)
    torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "epoch": 3}, tmp_path / "ck.pt")
    r = cli("import", tmp_path / "ck.pt", tmp_path / "sp")
    assert r.exit_code == 0 and "imported torch.save" in r.stdout, r.output
    assert cli("verify", "-q", tmp_path / "sp").exit_code == 0
    fresh = small_model(seed=2)
    state = {"model": fresh.state_dict(), "optim": None, "epoch": 0}
    stashpoint.load(state, tmp_path / "sp")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items()) and state["epoch"] == 3
    assert torch.equal(state["optim"]["state"][0]["exp_avg"], optim.state_dict()["state"][0]["exp_avg"])

    one_line_error(cli("import", tmp_path / "ck.pt", tmp_path / "sp"), "already exists", "--overwrite")
    assert cli("import", tmp_path / "ck.pt", tmp_path / "sp", "--overwrite").exit_code == 0


def test_import_strips_a_wrappers_prefix_so_the_state_dict_loads_into_the_module(tmp_path: Path) -> None:
    """A torch.save file of a DDP model's state_dict: its keys carry DDP's ``module.``. Before:
    the imported checkpoint loaded into no module, and the hint said to change how the
    (existing) file was saved."""
    model = small_model(seed=1)
    ddp_keys = {f"module.{k}": v for k, v in model.state_dict().items()}  # what DDP's state_dict() gives
    torch.save({"model": ddp_keys, "step": 5}, tmp_path / "ck.pt")
    assert cli("import", tmp_path / "ck.pt", tmp_path / "as-is").exit_code == 0
    with pytest.raises(stashpoint.StateMismatchError, match=r"import it again with --strip-prefix 'module\.'"):
        stashpoint.load({"model": small_model(seed=2), "step": 0}, tmp_path / "as-is")

    r = cli("import", tmp_path / "ck.pt", tmp_path / "sp", "--strip-prefix", "_orig_mod.", "--strip-prefix", "module.")
    assert r.exit_code == 0, r.output
    fresh = small_model(seed=2)
    target = {"model": fresh, "step": 0}
    stashpoint.load(target, tmp_path / "sp")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items()) and target["step"] == 5

    torch.save({"module.w": torch.ones(1), "w": torch.zeros(1)}, tmp_path / "two.pt")
    one_line_error(cli("import", tmp_path / "two.pt", tmp_path / "x", "--strip-prefix", "module."), "two keys", "'w'")
    assert not (tmp_path / "x").exists()


def test_import_dcp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict_loader

    model = small_model(seed=3)
    dcp.save({"model": model.state_dict(), "step": 5, "tags": ["a", "b"]}, checkpoint_id=str(tmp_path / "dcp"))
    r = cli("import", tmp_path / "dcp", tmp_path / "sp")
    assert r.exit_code == 0 and "imported dcp" in r.stdout, r.output
    d = json.loads(cli("inspect", tmp_path / "sp", "--json").stdout)
    assert d["values"]["step"] == 5 and d["values"]["tags"] == ["a", "b"]
    fresh = small_model(seed=4)  # the imported "model" is a plain dict: load it into the state dict's tensors
    stashpoint.load({"model": fresh.state_dict(), "step": 0, "tags": None}, tmp_path / "sp")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())

    # without torch's private loader: refused, never handed to a reader that unpickles unchecked
    monkeypatch.delattr(state_dict_loader, "_load_state_dict")
    one_line_error(cli("import", tmp_path / "dcp", tmp_path / "sp2"), "without unpickling code")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp", "sp"]


def test_import_dcp_of_a_training_state_in_bfloat16_with_its_optimizer(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).to(torch.bfloat16)
    optim = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.9))
    model(torch.randn(4, 8, dtype=torch.bfloat16)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    extra = {
        "epoch": 2,
        "ids": torch.arange(3),
        "mask": torch.ones(2, dtype=torch.bool),
        "z": torch.zeros(2, dtype=torch.complex64),
    }
    dcp.save({"model": msd, "optim": osd, "extra": extra}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    r = cli("import", tmp_path / "dcp", tmp_path / "sp")
    assert r.exit_code == 0, r.output
    d = json.loads(cli("inspect", tmp_path / "sp", "--json").stdout)
    assert d["values"]["extra/epoch"] == 2 and d["values"]["optim/param_groups/0/betas"] == [0.8, 0.9]
    dtypes = {t["key"]: t["dtype"] for t in d["tensors"]}
    assert (
        dtypes["model/0.weight"] == "bfloat16" and dtypes["extra/mask"] == "bool" and dtypes["extra/z"] == "complex64"
    )


class _TouchOnLoad:
    """Unpickling this creates ``path``: a stand-in for code a crafted file would run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_import_never_runs_code_from_a_dcp_checkpoint(tmp_path: Path) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(3), "value": _TouchOnLoad(marker)}, checkpoint_id=str(tmp_path / "values"), no_dist=True)
    one_line_error(cli("import", tmp_path / "values", tmp_path / "o1"), "'value'", "weights_only=True")
    assert not marker.exists() and not (tmp_path / "o1").exists()

    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "meta"), no_dist=True)
    (tmp_path / "meta" / ".metadata").write_bytes(pickle.dumps(_TouchOnLoad(marker), protocol=4))
    one_line_error(cli("import", tmp_path / "meta", tmp_path / "o2"), "pathlib.Path.touch")
    assert not marker.exists() and not (tmp_path / "o2").exists()


class _ByGetattr:
    """Pickles as ``getattr(target, name)``."""

    def __init__(self, target: object, name: str) -> None:
        self.target, self.name = target, name

    def __reduce__(self):
        return (getattr, (self.target, self.name))


def test_import_reads_enums_pickled_by_getattr_and_no_other_getattr(tmp_path: Path) -> None:
    import enum
    import io
    import pickle

    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(3.0)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    meta = tmp_path / "dcp" / ".metadata"

    class EnumsByGetattr(pickle.Pickler):  # as Python 3.11.0-3.11.3 (Debian 12's) pickle enum members
        def reducer_override(self, obj):
            return (getattr, (type(obj), obj.name)) if isinstance(obj, enum.Enum) else NotImplemented

    out = io.BytesIO()
    EnumsByGetattr(out, protocol=4).dump(pickle.loads(meta.read_bytes()))
    assert b"getattr" in out.getvalue()
    meta.write_bytes(out.getvalue())
    r = cli("import", tmp_path / "dcp", tmp_path / "sp")
    assert r.exit_code == 0 and "imported dcp" in r.stdout, r.output
    assert torch.equal(stashpoint.read(tmp_path / "sp")["w"], torch.arange(3.0))

    # getattr of anything but an enum's member is refused: a method is a step to running code
    meta.write_bytes(pickle.dumps(_ByGetattr(Path, "home"), protocol=4))
    one_line_error(cli("import", tmp_path / "dcp", tmp_path / "o1"), "getattr(Path, 'home')", "enum")
    meta.write_bytes(pickle.dumps(_ByGetattr(torch.float32, "__class__"), protocol=4))
    one_line_error(cli("import", tmp_path / "dcp", tmp_path / "o2"), "'__class__'", "enum")
    # BUILD on a class: the state a file gives would change pathlib's class for the whole process
    build_on_class = b"\x80\x04cpathlib\nPurePosixPath\nN}\x8c\x07__str__cbuiltins\nfrozenset\ns\x86b."
    meta.write_bytes(build_on_class)
    one_line_error(cli("import", tmp_path / "dcp", tmp_path / "o3"), "sets attributes of PurePosixPath")
    assert str(PurePosixPath("/x")) == "/x"
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3"))


def test_import_refusals(tmp_path: Path, single) -> None:
    torch.save(small_model(), tmp_path / "module.pt")  # a pickled module: weights_only refuses it
    one_line_error(cli("import", tmp_path / "module.pt", tmp_path / "o"), "weights_only=True", "never runs code")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    one_line_error(cli("import", tmp_path / "junk.pt", tmp_path / "o"), "not a readable torch.save file")
    one_line_error(cli("import", tmp_path / "nope.pt", tmp_path / "o"), "nope.pt", "torch.save file or a DCP")
    one_line_error(cli("import", single[0], tmp_path / "o"), "already a stashpoint checkpoint")
    (tmp_path / "empty").mkdir()
    one_line_error(cli("import", tmp_path / "empty", tmp_path / "o"), "not a DCP checkpoint")
    os.mkfifo(tmp_path / "fifo.pt")  # before: torch.load blocked on it forever
    one_line_error(cli("import", tmp_path / "fifo.pt", tmp_path / "o"), "not a regular file")
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")
    os.mkfifo(tmp_path / "dcp" / "__0_0.distcp")
    one_line_error(cli("import", tmp_path / "dcp", tmp_path / "o"), "'__0_0.distcp', not a regular file")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["inspect", "verify", "ls"])
def test_an_error_under_json_is_json_on_stdout_too(tmp_path, command):
    r = cli(command, tmp_path / "nope", "--json")
    one_line_error(r, "nope")
    doc = json.loads(r.stdout)
    assert doc["kind"] == "CheckpointNotFoundError" and "nope" in doc["error"], doc


def test_progress_bar_counts_every_byte_and_prints_the_messages_above_it(tmp_path):
    import io

    from stashpoint._tools.checking import verify
    from stashpoint._tools.progress import Reporter

    ck = tmp_path / "ck"
    stashpoint.save({"a": torch.randn(100_000), "b": torch.randn(50_000)}, ck, max_shard_bytes=300_000)
    out = io.StringIO()
    with Reporter("verifying", stream=out, bar=True) as progress:
        rep = verify(ck, progress=progress)
    assert rep.ok
    sizes = sum(p.stat().st_size for p in ck.glob("shard-*"))
    assert progress.total == progress.done == sizes
    assert "verifying" in out.getvalue() and "[2/2]" in out.getvalue()


def test_a_runs_verify_on_a_terminal_draws_one_bar_for_all_its_steps(tmp_path):
    """Before: a bar per step, each redraw drawing them all: 500 steps took 494 s on a terminal."""
    import io

    from stashpoint._tools.checking import verify
    from stashpoint._tools.progress import Reporter

    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=None) as mgr:
        for step in range(1, 6):
            mgr.save(step, {"w": torch.randn(1000)})
    with Reporter("verifying", stream=io.StringIO(), bar=True) as progress:
        assert verify(tmp_path / "run", progress=progress).ok
        assert len(progress._progress.tasks) == 1
        assert progress.total == progress.done > 0


def test_one_step_that_cannot_be_read_is_a_row_and_a_problem_not_the_end_of_ls_or_verify(tmp_path, monkeypatch):
    """Before: a step directory the user may not read ended `ls` and `verify` with a bare errno
    (exit 2), the other steps unchecked."""
    from stashpoint._storage import LocalStorage

    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=None) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.randn(100)})
    real_list, real_read = LocalStorage.list, LocalStorage.read

    def refused(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.root.name == "step-00000002":
            raise PermissionError(13, "Permission denied", str(self.root))
        return (real_list if not args else real_read)(self, *args, **kwargs)

    monkeypatch.setattr(LocalStorage, "list", refused)
    monkeypatch.setattr(LocalStorage, "read", refused)
    r = cli("ls", "--json", tmp_path / "run")
    assert r.exit_code == 0, r.output
    rows = {row["step"]: row for row in json.loads(r.stdout)}
    assert rows[2]["status"] == "unreadable" and "Permission denied" in rows[2]["error"], rows[2]
    assert rows[1]["status"] == rows[3]["status"] == "committed"
    r = cli("verify", "--json", tmp_path / "run")
    assert r.exit_code == 1, r.output
    report = json.loads(r.stdout)
    assert report["steps"] == 2 and any(p.startswith("step 2: could not be checked") for p in report["problems"])


def test_output_cut_short_by_a_pipe_exits_as_sigpipe_would_not_as_problems_found(tmp_path):
    """`stashpoint ... | head`: before, exit 1, which for verify and diff says problems were found."""
    stashpoint.save({f"t{i}": torch.ones(1) for i in range(3000)}, tmp_path / "ck")
    proc = subprocess.Popen(
        [sys.executable, "-m", "stashpoint", "inspect", str(tmp_path / "ck")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.stdout is not None and proc.stdout.read(10)
    proc.stdout.close()  # as `head` does
    assert proc.wait(timeout=60) == 141, proc.stderr.read() if proc.stderr else ""


def test_a_checkpoint_replaced_while_verified_is_said_to_be_so_not_damaged(tmp_path, monkeypatch):
    """A save with overwrite=True committing while verify reads: before, a problem per tensor of
    the shard it deleted ("No such file"), as if the checkpoint were damaged."""
    from stashpoint._tools import checking

    state = {f"w{i}": torch.randn(100) for i in range(50)}
    stashpoint.save(state, tmp_path / "ck")
    real = checking._verify_file
    calls = []

    def overwritten_first(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not calls:
            stashpoint.save(state, tmp_path / "ck", overwrite=True)  # a new save id, the old shard deleted
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(checking, "_verify_file", overwritten_first)
    report = checking.verify(tmp_path / "ck")
    assert len(report.problems) == 1 and "replaced while it was checked" in report.problems[0], report.problems
    monkeypatch.undo()
    assert checking.verify(tmp_path / "ck").ok


def test_ls_reads_each_steps_summary_not_its_catalog(tmp_path, monkeypatch):
    """Before: ls parsed every step's whole catalog to show its age and metrics (0.35 s a step of
    20,000 tensors). The seal is still checked: a damaged manifest is shown unreadable."""
    import stashpoint._load.manifest as manifest_module

    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=None) as mgr:
        for step in (1, 2):
            mgr.save(step, {f"w{i}": torch.ones(2) for i in range(50)}, metrics={"loss": 1.0 / step})

    def no_catalog(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("ls parsed a catalog")

    monkeypatch.setattr(manifest_module, "parse_head", no_catalog)
    raw = (tmp_path / "run" / "step-00000002" / "manifest.json").read_bytes()
    (tmp_path / "run" / "step-00000002" / "manifest.json").write_bytes(raw.replace(b'"w1"', b'"w9"', 1))
    r = cli("ls", "--json", tmp_path / "run")
    assert r.exit_code == 0, r.output
    rows = {row["step"]: row for row in json.loads(r.stdout)}
    assert rows[1]["status"] == "committed" and rows[1]["metrics"] == {"loss": 1.0}
    assert rows[2]["status"] == "unreadable" and "checksum does not match" in rows[2]["error"], rows[2]


def test_a_linked_step_is_said_to_be_a_link_not_misnamed(tmp_path):
    with stashpoint.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"w": torch.ones(2)})
    (tmp_path / "run" / "step-00000009").symlink_to(tmp_path / "run" / "step-00000001")
    (tmp_path / "run" / "notes").mkdir()
    warnings = stashpoint.verify(tmp_path / "run").warnings
    assert any("step-00000009 was not written by stashpoint's manager (a file or a link" in w for w in warnings)
    assert any("notes was not written by stashpoint's manager (not a step-XXXXXXXX directory)" in w for w in warnings)


def test_control_characters_in_names_and_values_are_printed_escaped(tmp_path):
    evil = "\x1b]0;pwned\x07\x1b[2J"
    state = {f"w{evil}\nforged line": torch.ones(2), "note": f"v{evil}", "x\u202eevil": 1}
    stashpoint.save(state, tmp_path / "c", metadata={f"k{evil}": f"m{evil}"})
    with stashpoint.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"w": torch.ones(2)}, metrics={f"loss{evil}": 1.0})
    for r in (
        cli("inspect", tmp_path / "c"),
        cli("diff", tmp_path / "c", tmp_path / "run" / "step-00000001"),
        cli("ls", tmp_path / "run"),
    ):
        assert "\x1b" not in r.output and "\x07" not in r.output and "\u202e" not in r.output, r.output
        assert "forged line" not in [ln.strip() for ln in r.output.splitlines()]  # no line of its own
    assert "\\x1b]0;pwned" in cli("inspect", tmp_path / "c").output
    doc = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    doc["created"] = "2026-12-05\nrecoverable without storage: forged"
    (tmp_path / "c" / "manifest.json").write_bytes(seal(doc))
    lines = [ln.strip() for ln in cli("inspect", tmp_path / "c").output.splitlines()]
    assert "recoverable without storage: forged" not in lines, lines  # before: a line of its own


def test_a_hostile_recoverable_marker_is_passed_by(tmp_path):
    """A node-local step's ``recoverable.json`` with counts no save writes (beyond 2**63, negative):
    no claim shown, and no traceback (an OverflowError escaped while printing its sizes)."""
    stashpoint.save({"w": torch.ones(4)}, tmp_path / "c")
    for bad in (10**400, -1, 1 << 63):
        doc = {"replicas": 1, "nodes": 2, "own_bytes": bad, "replica_bytes": 0}
        (tmp_path / "c" / "recoverable.json").write_text(json.dumps(doc))
        r = cli("inspect", tmp_path / "c")
        assert r.exit_code == 0 and r.exception is None, r.output
    for text in (json.dumps({"replicas": 10**400, "nodes": 2}), "[" * 2000):  # the second: nested too deep
        (tmp_path / "c" / "recoverable.json").write_text(text)
        r = cli("inspect", tmp_path / "c")
        assert r.exit_code == 0 and "recoverable without storage" not in r.output, r.output


def test_a_file_name_that_is_not_utf8_is_shown_by_its_bytes(tmp_path):
    stashpoint.save({"w": torch.ones(2)}, tmp_path / "c")
    (tmp_path / "c" / os.fsdecode(b"shard-r00000-0001-\xff.safetensors")).write_bytes(b"x")
    r = cli("verify", tmp_path / "c")
    assert r.exit_code == 0 and "shard-r00000-0001-\\xff.safetensors is not listed" in r.output, r.output
    stashpoint.save({"k\ud800": torch.ones(1)}, tmp_path / "lone")  # a lone surrogate in a key
    r = cli("inspect", tmp_path / "lone")
    assert r.exit_code == 0 and "k\\ud800" in r.output, r.output


def test_importing_a_damaged_dcp_checkpoint_is_one_clear_line(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(1000)}, checkpoint_id=str(tmp_path / "dcp"))
    data = next((tmp_path / "dcp").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:10])
    dcp.save({"w": torch.ones(10)}, checkpoint_id=str(tmp_path / "meta"))
    (tmp_path / "meta" / ".metadata").write_bytes(bytes(range(7, 107)))  # DCP logs this one on the root logger
    for damaged in ("dcp", "meta"):
        r = subprocess.run(
            [sys.executable, "-m", "stashpoint", "import", str(tmp_path / damaged), str(tmp_path / "out")],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        )
        assert r.returncode == 2
        assert r.stderr.startswith("stashpoint import: error: could not read the DCP checkpoint"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists(), r.stderr


def test_the_command_line_gives_up_on_an_unreachable_object_store_within_seconds():
    import time

    env = {k: v for k, v in os.environ.items() if k != "STASHPOINT_S3_RETRY_SECONDS"}
    env.update(
        PYTHONPATH=str(ROOT / "src"),
        AWS_ENDPOINT_URL="http://127.0.0.1:1",
        AWS_ACCESS_KEY_ID="x",
        AWS_SECRET_ACCESS_KEY="y",
        AWS_REGION="us-east-1",
    )  # nothing listens on port 1
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "stashpoint", "verify", "s3://missing-bucket/x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "STASHPOINT_S3_RETRY_SECONDS" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 40


def test_ls_inspect_verify_and_diff_do_not_import_torch(single, tmp_path: Path) -> None:
    """The everyday commands start fast: they read manifests and checksums, never torch (diff
    imports it only to compare tensors whose recorded bytes differ; here none do)."""
    run = tmp_path / "run"
    shutil.copytree(single[0], run / "step-00000001")
    probe = (
        "import sys\nfrom stashpoint._tools.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code)\n"
    )
    commands = (["ls", run], ["inspect", single[0]], ["verify", single[0]], ["verify", run], ["diff", *single[:1] * 2])
    for args in commands:
        out = subprocess.run(
            [sys.executable, "-c", probe, *map(str, args)], capture_output=True, text=True, timeout=60, check=False
        )
        assert out.stdout.strip().endswith("NO-TORCH 0"), (args, out.stdout[-500:], out.stderr[-2000:])


def test_urls_where_a_command_takes_local_files_and_a_missing_s3_extra_are_one_line(tmp_path, monkeypatch):
    stashpoint.save({"w": torch.ones(2)}, tmp_path / "ck")
    monkeypatch.chdir(tmp_path)
    one_line_error(cli("export", tmp_path / "ck", "s3://bucket/out/model.safetensors"), "is a URL", "local path")
    one_line_error(cli("import", "s3://bucket/some.pt", tmp_path / "o"), "is a URL")
    assert not (tmp_path / "s3:").exists(), "no local directory named 's3:'"
    monkeypatch.setitem(sys.modules, "obstore", None)
    one_line_error(cli("ls", "s3://bucket/run"), "pip install 'stashpoint[s3]'")


def test_ls_and_verify_of_a_run_whose_retention_removes_a_step_meanwhile(tmp_path: Path, monkeypatch) -> None:
    """Retention deletes a step (its manifest first) between the listing and the look at it."""
    import shutil

    from stashpoint._core.naming import MANIFEST_NAME
    from stashpoint._storage.local import LocalStorage

    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=None) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((4,), float(step))})
    for target in ("ls", "verify"):
        shutil.copytree(tmp_path / "run", tmp_path / target)
    listed = LocalStorage.list

    def list_then_retention(self):
        names = listed(self)
        if self.root.name == "step-00000001" and self.root.parent.name == "ls":
            shutil.rmtree(self.root)
        return names

    with monkeypatch.context() as m:
        m.setattr(LocalStorage, "list", list_then_retention)
        r = cli("ls", tmp_path / "ls", "--json")
    assert r.exit_code == 0, r.output
    assert [s["step"] for s in json.loads(r.stdout)] == [2]

    looked = LocalStorage.exists
    looks = []

    def exists_then_retention(self, name=None):
        found = looked(self, name)
        if found and name == MANIFEST_NAME and self.root == tmp_path / "verify" / "step-00000001":
            looks.append(1)
            if len(looks) == 2:  # seen committed by verify's loop: now retention removes it
                (self.root / MANIFEST_NAME).unlink()
        return found

    with monkeypatch.context() as m:
        m.setattr(LocalStorage, "exists", exists_then_retention)
        r = cli("verify", tmp_path / "verify")
    assert r.exit_code == 0, r.output
    assert "step 1 was removed while it was checked" in r.output


def _crafted_dcp(root: Path, edit) -> Path:
    """A DCP checkpoint whose .metadata ``edit`` changed (the test's own file: unpickled here)."""
    import pickle

    import torch.distributed.checkpoint as dcp

    ck = root / f"ck-{len(list(root.iterdir()))}"
    dcp.save({"w": torch.ones(3), "note": {"a": 1}}, checkpoint_id=str(ck), no_dist=True)
    metadata = pickle.loads((ck / ".metadata").read_bytes())
    edit(metadata)
    (ck / ".metadata").write_bytes(pickle.dumps(metadata))
    return ck


def test_import_reads_only_the_dcp_checkpoints_own_files_and_only_what_they_hold(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    secret = tmp_path / "elsewhere.pt"
    torch.save({"api_key": "not yours"}, secret)

    def place_all(where: str, length: int | None = None):
        def edit(metadata) -> None:
            for index, info in metadata.storage_data.items():
                n = info.length if length is None else length
                metadata.storage_data[index] = _StorageInfo(where, info.offset, n)

        return edit

    def huge(metadata) -> None:
        for entry in metadata.state_dict_metadata.values():
            if isinstance(entry, TensorStorageMetadata):
                entry.size = torch.Size([1 << 40])

    def repeated(metadata) -> None:
        entry = metadata.state_dict_metadata["w"]
        entry.chunks = [entry.chunks[0]] * 50

    cases = {
        "absolute": (place_all(str(secret)), "not a file name inside"),
        "parent": (place_all("../elsewhere.pt"), "not a file name inside"),
        "past the end": (place_all("__0_0.distcp", 1 << 30), "past its end"),
        "huge tensor": (huge, "more than its files hold"),
        "a chunk listed 50 times": (repeated, "must tile it once"),  # before: the tensor read 50 times
    }
    for name, (edit, says) in cases.items():
        ck = _crafted_dcp(tmp_path, edit)
        r = cli("import", ck, tmp_path / "out")
        assert r.exit_code == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, (name, r.stderr)
        assert not (tmp_path / "out").exists(), name
    ck = _crafted_dcp(tmp_path, lambda m: None)
    data = next(ck.glob("*.distcp"))
    data.rename(tmp_path / "moved.distcp")
    data.symlink_to(tmp_path / "moved.distcp")  # a link where a data file belongs
    one_line_error(cli("import", ck, tmp_path / "out"), "is a symbolic link", "cp -rL")


def test_import_refuses_a_small_file_that_would_take_hours_or_write_gigabytes(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(1).expand(1 << 28)}, tmp_path / "expanded.pt")  # 1.5 KB; 1 GiB written before
    one_line_error(cli("import", tmp_path / "expanded.pt", tmp_path / "o"), "'w' is a view of 4 bytes expanded to")
    p = (1 << 61) - 1
    torch.save({k * p: 0 for k in range(1, 3000)}, tmp_path / "keys.pt")  # every key hashes alike: quadratic
    one_line_error(cli("import", tmp_path / "keys.pt", tmp_path / "o"), "more than 1000 integers of one hash")
    assert not (tmp_path / "o").exists()


def test_import_takes_what_real_files_hold_shared_layers_large_ints_and_damage_named(tmp_path: Path) -> None:
    """What the bounds above must let through: a layer shared 16 times (its aliases are saved
    once), thousands of distinct 64-bit ints (hashes kept as values); a damaged zip still fails
    as a CheckpointError, a sparse CSR tensor with the save's own refusal."""
    block = torch.nn.Linear(512, 512)
    torch.save(torch.nn.ModuleList([block] * 16).state_dict(), tmp_path / "shared.pt")
    torch.save({"hashes": [hash(f"t{i}") | (1 << 62) for i in range(3000)]}, tmp_path / "ints.pt")
    for name in ("shared.pt", "ints.pt"):
        r = cli("import", tmp_path / name, tmp_path / f"o-{name}")
        assert r.exit_code == 0, (name, r.output)
    import random

    from stashpoint._tools.convert import import_checkpoint

    torch.save({"w": torch.arange(64.0), "n": {"a": 1, "b": [1, 2]}}, tmp_path / "good.pt")
    good, rng = (tmp_path / "good.pt").read_bytes(), random.Random(0)
    for i in range(60):  # bytes flipped in the zip's directory at its end, or anywhere
        raw = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw) - 200, len(raw)) if i % 2 else rng.randrange(len(raw))] = rng.randrange(256)
        (tmp_path / "damaged.pt").write_bytes(bytes(raw))
        try:
            import_checkpoint(tmp_path / "damaged.pt", tmp_path / f"d{i}")
        except stashpoint.CheckpointError:
            pass  # before: zipfile's UnicodeDecodeError or EOFError escaped the scan for 21 of 150 such files
    torch.save({"w": torch.eye(3).to_sparse_csr()}, tmp_path / "csr.pt")
    one_line_error(cli("import", tmp_path / "csr.pt", tmp_path / "o"), "'w'")


def test_export_writes_the_mx_scale_and_float4_dtypes_safetensors_stores(tmp_path: Path) -> None:
    """Before: refused as dtypes safetensors cannot store (its loader's table lacks them; its
    writer and reader handle them), so no MXFP8/MXFP4 checkpoint could be exported."""
    scale = torch.tensor([1.0, 2.0, 0.5, 8.0]).to(torch.float8_e8m0fnu)
    packed = torch.randint(0, 255, (4, 2), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    stashpoint.save({"model": {"w_scale": scale, "w": packed}}, tmp_path / "ck")
    r = cli("export", tmp_path / "ck", tmp_path / "out.safetensors", "--select", "model")
    assert r.exit_code == 0, r.output
    got = load_file(str(tmp_path / "out.safetensors"))
    assert got["w_scale"].dtype == torch.float8_e8m0fnu and torch.equal(
        got["w_scale"].view(torch.uint8), scale.view(torch.uint8)
    )
    assert got["w"].dtype == torch.float4_e2m1fn_x2 and torch.equal(
        got["w"].view(torch.uint8), packed.view(torch.uint8)
    )


def test_import_of_one_ranks_torch_save_of_dtensors_says_what_it_is(tmp_path: Path) -> None:
    """Before: "not a readable torch.save file", a CorruptCheckpointError, passing on torch's advice
    to load with weights_only=False."""
    code = (
        "import sys, torch, torch.distributed as dist\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor import Shard, distribute_tensor\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "w = distribute_tensor(torch.ones(4, 4), init_device_mesh('cpu', (1,)), [Shard(0)])\n"
        "torch.save({'w': w}, sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "rank0.pt")], check=True, timeout=120)
    # a fresh process, which has not imported torch.distributed.tensor: torch.load refuses the DTensors
    fresh = subprocess.run(
        [sys.executable, "-m", "stashpoint", "import", str(tmp_path / "rank0.pt"), str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    # and one that has (a training program's): torch.load reads them
    import torch.distributed.tensor  # noqa: F401

    r = cli("import", tmp_path / "rank0.pt", tmp_path / "ck")
    for code_, out in ((fresh.returncode, fresh.stderr), (r.exit_code, r.output)):
        assert code_ == 2, out
        assert "holds DTensors: one rank's shards" in out and "full_state_dict=True" in out, out
        assert "weights_only=False will likely succeed" not in out, out
    assert not (tmp_path / "ck").exists()
