"""The side-by-side benchmark suite (python -m benchmarks) and `stashpoint bench`.

The end-to-end runs are real `--quick` runs of the suite on tiny states (each method in its own
processes, real files, real peers where installed); the rest checks the pieces the reports rest
on (method selection, availability, the training-loop figures, the targets) on known inputs.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks.suite import methods, steptime, summary
from benchmarks.suite.methods import METHODS, NOT_INSTALLED, OK, Method
from click.testing import CliRunner

from conftest import ROOT
from stashpoint._tools import cli as _cli
from stashpoint._tools import clibench

REQUESTED = ["torch_save", "dcp_save", "dcp_async_thread", "torchsnapshot_async", "stashpoint_save", "stashpoint_async"]


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG file; fails unless it has a PNG signature and an IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR", f"{path} has no IHDR chunk"
    width, height = struct.unpack(">II", data[16:24])
    assert data.rstrip(b"\x00")[-8:-4] == b"IEND", f"{path} is truncated"
    return width, height


def run_suite(out: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out), "--dir", str(out / "scratch"), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert proc.stdout.strip() == md.strip()  # the table on stdout is the markdown file
    return doc


def check_method(name: str, e: dict, regimes: list[str], *, steps: bool) -> None:
    """A measured entry has positive, consistent figures; any other says why it was not measured."""
    if e["status"] != OK:
        assert e["status"] in (NOT_INSTALLED, "failed", "not applicable", "not available"), e
        assert e["reason"], f"{name}: {e['status']} without a reason"
        return
    assert not e.get("errors"), e.get("errors")
    if e["kind"] == "reference":  # the I/O floor: the training loop only
        assert not e["saves"] and e["steps"]["base_step_ms"] > 0 and len(e["steps"]["saves"]) == 2
        return
    for regime in regimes:
        s = e["saves"][regime]
        assert 0 < s["blocking_s"] <= s["staged_s"] <= s["written_s"] <= s["durable_s"], s
        assert s["gbps"] > 0 and s["frac_direct_write"] > 0 and s["first_blocking_s"] > 0
        assert s["peak_extra_gb"] >= 0 and s["bytes_on_disk"] > 1e6
        if not e["fsyncs"]:
            assert s["harness_fsync_s"] > 0
    if METHODS[name].load is not None:
        ld = e["load"]
        assert ld["load_s"] > 0 and ld["verified"] is True and ld["frac_direct_read"] > 0
    if steps:
        st = e["steps"]
        assert st["base_step_ms"] > 0 and st["loop_ratio"] > 0
        assert len(st["saves"]) == 2 and all(sv["done_at"] >= sv["call_at"] for sv in st["saves"])
        assert len(st["steps"]) == st["baseline_steps"] + 2 * st["every"]


@pytest.mark.slow
def test_quick_run_one_rank_every_requested_method_reported(tmp_path):
    out = tmp_path / "suite"
    doc = run_suite(
        out, "--ranks", "1", "--regimes", "hot", "cold", "--methods", *REQUESTED, "accelerate", "io_floor"
    )
    (cfg,) = doc["configs"]
    assert cfg["ranks"] == 1 and cfg["layout"] == "single" and cfg["state_bytes"] > 1e7
    assert list(cfg["methods"]) == ["io_floor", *REQUESTED[:4], "accelerate", *REQUESTED[4:]]  # registry order
    for name, e in cfg["methods"].items():
        check_method(name, e, ["hot", "cold"], steps=True)
    for name in ("torch_save", "dcp_save", "stashpoint_save", "stashpoint_async"):
        assert cfg["methods"][name]["status"] == OK, cfg["methods"][name]
    for regime in ("hot", "cold"):
        assert cfg["disk"][regime]["direct_write_gbps"] > 0 and cfg["disk"][regime]["buffered_read_gbps"] > 0
    assert cfg["floor"]["copy_s"] > 0
    checked = [t for t in cfg["targets"] if t["met"] is not None]
    assert {t["target"].split(":")[0] for t in checked} >= {"blocking", "load"}
    # the step-time target is measured only where a training step fell inside a persist: a
    # persist of this small state can end within a step on a busy host, and then it says so
    stepped = {t["method"]: t for t in cfg["targets"] if t["target"].startswith("step time while a persist runs")}
    assert set(stepped) == {"stashpoint_async", "stashpoint_process", "stashpoint_overlap"}
    for name, t in stepped.items():
        steps = cfg["methods"].get(name, {}).get("steps") or {}
        assert (t["value"] is None) == (not steps.get("during_persist_steps")), (name, steps)
    md = (out / "results.md").read_text()
    for e in cfg["methods"].values():
        assert e["label"] in md
    if "plots_skipped" in doc:
        assert "pip install matplotlib" in doc["plots_skipped"]
    else:
        assert doc["plots"] == ["blocking.png", "timeline-1r-single-0.03gb.png"]
        for name in doc["plots"]:
            w, h = png_size(out / name)
            assert w > 300 and h > 200
            assert name in md
    # --from renders the same report from the JSON without measuring anything
    again = tmp_path / "again"
    cmd = [sys.executable, "-m", "benchmarks", "--from", str(out / "results.json"), "--out", str(again)]
    subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    assert (again / "results.md").read_text().split("Blocking:")[0] == md.split("Blocking:")[0]


@pytest.mark.slow
def test_quick_run_two_ranks_sharded(tmp_path):
    out = tmp_path / "suite2"
    doc = run_suite(
        out, "--ranks", "2", "--layouts", "fsdp", "--regimes", "hot",
        "--methods", "dcp_save", "dcp_async_thread", "stashpoint_save", "stashpoint_async", "accelerate",
    )  # fmt: skip
    (cfg,) = doc["configs"]
    assert cfg["ranks"] == 2 and cfg["layout"] == "fsdp"
    assert cfg["methods"]["accelerate"]["status"] == "not applicable"
    for name, e in cfg["methods"].items():
        check_method(name, e, ["hot"], steps=True)
        if name != "accelerate":
            assert e["status"] == OK, e


def test_bench_help_lists_the_options():
    r = CliRunner().invoke(_cli.main, ["bench", "--help"], prog_name="stashpoint")
    assert r.exit_code == 0, r.output
    for opt in ("--sizes", "--ranks", "--methods", "--regimes", "--quick", "--out", "--list"):
        assert opt in r.output
    assert "Usage: stashpoint bench [OPTIONS]" in r.output


def test_bench_runs_the_suite_of_this_checkout():
    assert clibench.bench_suite_root(clibench._bench_candidates()) == ROOT
    cmd = [sys.executable, "-m", "stashpoint", "bench", "--list"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    for name in METHODS:
        assert name in r.stdout


def test_bench_without_the_suite_says_how_to_get_it(tmp_path, monkeypatch):
    assert clibench.bench_suite_root([tmp_path]) is None
    (tmp_path / "benchmarks" / "suite").mkdir(parents=True)
    assert clibench.bench_suite_root([tmp_path]) is None
    (tmp_path / "benchmarks" / "suite" / "cli.py").write_text("")
    assert clibench.bench_suite_root([tmp_path / "nothing", tmp_path]) == tmp_path.resolve()
    monkeypatch.setattr(clibench, "_bench_candidates", lambda: [tmp_path / "nothing"])  # as from a wheel
    r = CliRunner().invoke(_cli.main, ["bench", "--quick"])
    assert r.exit_code == 1
    assert "source repository" in r.output and "pip install -e '.[bench]'" in r.output


def test_method_selection_and_groups():
    assert methods.expand(["stashpoint_async", "torch_save"]) == ["torch_save", "stashpoint_async"]
    assert methods.expand(["all"]) == list(METHODS)
    assert set(methods.expand(["peers"])) == {"torchsnapshot_take", "torchsnapshot_async", "torch_checkpointing",
                                             "accelerate"}  # fmt: skip
    with pytest.raises(ValueError, match=r"unknown method 'tensorstore'.*groups: all"):
        methods.expand(["tensorstore"])


def test_availability_names_what_to_install_and_why():
    missing = Method("x", "X", "peer", "async", module="no_such_module_for_stashpoint", pip="no-such-package")
    status, reason = methods.availability(missing, 1, "single")
    assert status == NOT_INSTALLED and "pip install no-such-package" in reason
    # a one-process method on 2 ranks (the module check aside: accelerate is in the bench extra only)
    one_process = dataclasses.replace(METHODS["accelerate"], module=None)
    status, reason = methods.availability(one_process, 2, "fsdp")
    assert status == "not applicable" and "1 process" in reason
    assert methods.availability(METHODS["stashpoint_async"], 2, "fsdp") is None
    import torch

    pinned = methods.availability(METHODS["dcp_async_pinned"], 1, "single")
    assert (pinned is None) == torch.cuda.is_available()


def test_step_metrics_on_known_steps():
    # 3 baseline steps, one disturbed by something else (0.9 s); then a save called in a step of
    # 0.5 s and done at t=2.3: the 2 steps starting before that ran while it persisted (0.2 s
    # each); the 2 after it did not, and count as undisturbed with the baseline's.
    steps = [(0.0, 0.1, False), (0.1, 0.9, False), (1.0, 0.1, False)]
    steps += [(1.1, 0.5, True), (1.6, 0.2, False), (1.8, 0.2, False), (2.4, 0.1, False), (2.5, 0.1, False)]
    saves = [{"step": 3, "call_at": 1.1, "blocking_s": 0.5, "done_at": 2.3}]
    m = steptime.metrics(steps, saves, baseline=3)
    assert m["undisturbed_steps"] == 5 and m["base_step_ms"] == pytest.approx(100)
    assert m["during_persist_steps"] == 2 and m["during_persist_ratio"] == pytest.approx(2.0)
    assert m["loop_ratio"] == pytest.approx((1.1 / 5) / 0.1)
    assert m["lost_per_checkpoint_s"] == pytest.approx(1.1 - 0.5)
    assert m["max_step_s"] == pytest.approx(0.5)


def test_targets_are_checked_against_the_right_figures():
    def ok(blocking: float, durable: float, staged: float | None = None, extra: float = 1.0) -> dict:
        s = {"blocking_s": blocking, "staged_s": staged or blocking, "durable_s": durable, "extra_per_state": extra}
        return {"status": OK, "saves": {"cold": s}}

    cfg = {
        "state_bytes": 2e9,
        "disk": {"cold": {"direct_write_gbps": 2.0}},
        "methods": {
            "torch_save": ok(5.0, 5.0),
            "dcp_async_thread": ok(0.4, 6.0),
            "dcp_async_async_staging": ok(0.05, 6.0, staged=0.3),
            "stashpoint_async": ok(0.1, 1.2, extra=1.05),
            "stashpoint_overlap": ok(0.2, 1.3, staged=0.3),
        },
    }
    res = {(t["target"], t["method"]): t for t in summary.targets(cfg, ["cold"])}
    assert res["blocking: >= 10x below torch.save+fsync", "stashpoint_async"]["value"] == pytest.approx(50)
    assert res["blocking: >= 10x below torch.save+fsync", "stashpoint_async"]["met"] is True
    assert res["blocking: >= 50x below torch.save+fsync", "stashpoint_overlap"]["met"] is False  # 25x
    call = res["blocking: <= 1/2 of the best DCP async_save (call)", "stashpoint_async"]
    assert call["value"] == pytest.approx(0.1 / 0.05) and call["met"] is False
    free = res["blocking: <= 1/2 of the best DCP async_save (until the state is free)", "stashpoint_async"]
    assert free["value"] == pytest.approx(0.1 / 0.3) and free["met"] is True
    durable = res["until durable / (1.25 x bytes / raw direct-I/O write): <= 1", "stashpoint_async"]
    assert durable["value"] == pytest.approx(1.2 / 1.25) and durable["met"] is True
    assert res["until durable / (1.25 x bytes / raw direct-I/O write): <= 1", "stashpoint_process"]["met"] is None
    assert res["extra host memory per in-flight save: <= 1.1x the state", "stashpoint_async"]["met"] is True
    assert res["load: >= 0.8x raw direct-I/O read", "stashpoint_save"]["met"] is None


@pytest.mark.parametrize(("layout", "world", "share"), [("single", 1, 1), ("ddp", 2, 2), ("fsdp", 2, 1)])
def test_io_floor_writes_this_ranks_share_of_the_bytes_durably(tmp_path, layout, world, share):
    from benchmarks.suite.savers import Ctx, make_saver
    from benchmarks.suite.state import build, choose_shape, local_bytes

    state = build("single", choose_shape(0.03), 0)
    saver = make_saver("io_floor", state, Ctx(1 % world, world, layout, 60.0))
    try:
        pending = saver.start(tmp_path / "p")
        assert pending.wait() == {} and pending.done()
    finally:
        saver.close()
    (f,) = (tmp_path / "p").iterdir()
    want = local_bytes(state)[0] // share
    assert f.name == f"raw-{1 % world}.bin" and 0 <= f.stat().st_size - want < 4096


def test_the_io_floor_is_reported_in_the_training_loop_only():
    from benchmarks.suite import report

    loop = {"steps": [{"t": 0.0, "s": 0.1, "save": True}], "saves": [], "baseline_steps": 0, "every": 30,
            "batch": 8, "width": 64, "base_step_ms": 70.0, "during_persist_ratio": 1.12, "loop_ratio": 1.03,
            "lost_per_checkpoint_s": 0.15, "max_step_s": 0.1}  # fmt: skip
    floor = summary.method_entry("io_floor", {"cold": [{"local_bytes": 10, "steps": loop}]}, 10, {})
    assert floor["status"] == OK and floor["saves"] == {} and floor["steps"]["during_persist_ratio"] == 1.12
    assert methods.availability(METHODS["io_floor"], 2, "ddp", no_steps=True)[0] == "not applicable"
    cfg = {"ranks": 1, "layout": "single", "state_bytes": 10, "num_tensors": 1, "repeats": 1, "disk": {},
           "saves_regimes": ["cold"], "methods": {"io_floor": floor}, "targets": []}  # fmt: skip
    assert floor["label"] not in "\n".join(report.save_table(cfg, "cold"))
    assert f"| {floor['label']} | 70.0 ms | 1.12 | 1.03 | 150 ms |" in "\n".join(report.steps_table(cfg))


def test_throughput_is_paired_with_the_disk_at_that_moment():
    """Each save's (load's) throughput is taken against the direct-I/O write (read) made right
    after it, worst rank per repeat, then the median; the durable target uses the same pairs."""

    def rank(durables, raws, loads, raw_reads):
        recs = [{"blocking_s": 0.01, "staged_s": 0.01, "written_s": d, "durable_s": d, "raw_write_s": w}
                for d, w in zip(durables, raws)]  # fmt: skip
        return {"local_bytes": 10**9, "saves": {"records": recs, "first": recs[0], "peak_extra_gb": 1.0,
                "retained_gb": 1.0}, "loads": [{"load_s": t, "raw_read_s": r, "verified": True, "in_place": True}
                for t, r in zip(loads, raw_reads)]}  # fmt: skip

    # the disk halves its speed between the two saves: the pairs see it, a fixed reference would not
    ranks = [rank([1.0, 2.0], [0.8, 1.6], [1.0, 2.0], [0.9, 1.8]), rank([0.5, 1.5], [0.8, 1.0], [0.5, 1.0], [0.5, 1.0])]
    e = summary.save_entry(ranks, 2 * 10**9, {"direct_write_gbps": 4.0, "buffered_write_gbps": 1.0})
    assert e["frac_direct_write"] == pytest.approx(0.8) and e["durable_over_raw"] == pytest.approx(1.25)
    assert e["raw_write_gbps"] == pytest.approx(2 / 1.2)
    ld = summary.load_entry(ranks, 2 * 10**9, {"direct_read_gbps": 9.0})
    assert ld["frac_direct_read"] == pytest.approx(0.9)
    cfg = {"state_bytes": 2e9, "disk": {"cold": {"direct_write_gbps": 4.0}},
           "methods": {"stashpoint_async": {"status": OK, "saves": {"cold": e}}}}  # fmt: skip
    durable = {t["method"]: t for t in summary.targets(cfg, ["cold"]) if t["target"].startswith("until durable")}
    assert durable["stashpoint_async"]["value"] == pytest.approx(1.0) and durable["stashpoint_async"]["met"] is True


def test_the_headline_sets_the_best_stashpoint_method_against_the_best_peer():
    from benchmarks.suite import report

    def ok(label: str, blocking: float, durable: float, load: float | None = None, extra: float = 1.0) -> dict:
        s = {"blocking_s": blocking, "staged_s": blocking, "durable_s": durable, "extra_per_state": extra}
        kind = "async" if blocking < durable else "sync"
        return {"status": OK, "kind": kind, "label": label, "saves": {"cold": s},
                "load": None if load is None else {"load_s": load}}  # fmt: skip

    cfg = {
        "ranks": 1, "layout": "single", "size_gb": 2.0, "saves_regimes": ["cold"],
        "methods": {
            "torch_save": ok("torch.save", 5.0, 5.0, load=3.0, extra=0.0),
            "dcp_async_thread": ok("DCP async", 0.4, 6.0, extra=2.0),
            "dcp_save": ok("dcp.save", 4.0, 4.0, load=2.0, extra=0.0),
            "stashpoint_async": ok("sp async", 0.1, 1.2),
            "stashpoint_overlap": ok("sp overlap", 0.02, 1.3),
            "accelerate": {"status": "failed", "label": "Accelerate", "reason": "boom"},
        },
    }  # fmt: skip
    rows = {r.split(" | ")[0].lstrip("| "): r for r in report.headline_table(cfg)}
    assert rows["blocking (cold)"] == "| blocking (cold) | 20 ms (sp overlap) | 400 ms (DCP async) | 5.00 s | 20.00x |"
    assert rows["until durable (cold)"].endswith("| 1.20 s (sp async) | 4.00 s (dcp.save) | 5.00 s | 3.33x |")
    assert rows["load"] == "| load | n/a | 2.00 s (dcp.save) | 3.00 s | n/a |"  # stashpoint's load not measured
    assert "step while a persist runs (x undisturbed)" not in rows  # measured by nobody: no row
    memory = next(r for k, r in rows.items() if k.startswith("peak extra memory"))
    assert memory.endswith("| 2.00x (DCP async) | 0.00x | 2.00x |")  # against the peers that hold a copy too
    assert "In short" in report.headline({"configs": [cfg]})[0]


def test_host_memory_counts_an_exec_d_child_but_not_a_fork_that_has_not_exec_d_yet():
    """A fork before its exec (how subprocess starts a writer process) shows the parent's whole
    anonymous memory as its own; counting it made a writer process's start look like a second
    copy of the state. A child that is a program of its own is counted."""
    import os
    import signal
    import time

    from benchmarks.suite.memory import tree_detail

    ballast = bytearray(64 << 20)
    ballast[::4096] = b"\x01" * len(ballast[::4096])  # touched: 64 MiB of anonymous memory
    pid = os.fork()
    if pid == 0:  # a fork that never execs: it shares the parent's pages
        time.sleep(30)
        os._exit(0)
    script = "import time; b = bytearray(48 << 20); b[::4096] = b'1' * len(b[::4096]); print('ready', flush=True); "
    child = subprocess.Popen([sys.executable, "-c", script + "time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        detail = {p: anon for p, anon, _ in tree_detail()}
        assert pid not in detail, "the fork that has not exec'd is not counted"
        assert child.pid in detail and detail[child.pid] >= 48 << 20, "the exec'd child and its memory are"
        assert detail[os.getpid()] >= 64 << 20
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        child.kill()
        child.wait()
    del ballast


def test_a_configuration_measured_again_takes_the_later_figures_of_what_ran_again():
    from benchmarks.suite.cli import join_configs

    def cfg(methods: dict) -> dict:
        return {"ranks": 1, "layout": "single", "size_gb": 4.0, "methods": methods, "disk": {"cold": "first"}}

    first = {
        "meta": {"command": "python -m benchmarks --sizes 4"},
        "configs": [
            cfg({
                "a": {"status": "ok", "saves": {"cold": 1, "hot": 2}, "load": 3, "steps": 4},
                "b": {"status": "ok", "saves": {"cold": 5}},
            }),
            {**cfg({}), "size_gb": 0.5},
        ],
    }  # fmt: skip
    again = {
        "meta": {"command": "python -m benchmarks --sizes 4 --methods a --no-loads --no-steps"},
        "configs": [cfg({"a": {"status": "ok", "saves": {"cold": 10}, "load": None}, "b": {"status": "failed"}})],
    }
    joined = join_configs([first, again])
    assert [c["size_gb"] for c in joined] == [4.0, 0.5]
    a, b = joined[0]["methods"]["a"], joined[0]["methods"]["b"]
    assert a == {"status": "ok", "saves": {"cold": 10, "hot": 2}, "load": 3, "steps": 4}, "only what ran again"
    assert b == {"status": "ok", "saves": {"cold": 5}}, "a method that did not run again keeps its figures"
    assert joined[0]["remeasured"] == {"a": again["meta"]["command"]} and joined[0]["disk"] == {"cold": "first"}
