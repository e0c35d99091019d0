"""From the ranks' raw results to one entry per method: figures, ratios, and the issue's targets.

On several ranks each figure of a save or a load is the slowest rank's, then the median over the
repeats; memory is the largest rank's. Ratios against the raw disk use the reference measured
in the same run and regime on the same byte count.
"""

from __future__ import annotations

from typing import Any

from .common import GB, median
from .methods import FAILED, METHODS, OK


def _worst(ranks: list[dict[str, Any]], key: str) -> list[float]:
    """Per repeat, the slowest rank's ``key``."""
    per_rank = [r["saves"]["records"] for r in ranks]
    return [max(rec[key] for rec in same) for same in zip(*per_rank, strict=True)]


def _errors(ranks: list[dict[str, Any]]) -> str | None:
    errs = sorted({r["error"] for r in ranks if "error" in r})
    return "; ".join(errs) if errs else None


def save_entry(ranks: list[dict[str, Any]], total_bytes: int, disk: dict[str, Any] | None) -> dict[str, Any]:
    """The figures of one method's saves in one regime."""
    e: dict[str, Any] = {}
    for key in ("blocking_s", "staged_s", "written_s", "durable_s"):
        vals = _worst(ranks, key)
        e[key] = median(vals)
        e[f"all_{key}"] = vals
    if all("harness_fsync_s" in rec for r in ranks for rec in r["saves"]["records"]):
        e["harness_fsync_s"] = median(_worst(ranks, "harness_fsync_s"))
    e["first_blocking_s"] = max(r["saves"]["first"]["blocking_s"] for r in ranks)
    e["first_durable_s"] = max(r["saves"]["first"]["durable_s"] for r in ranks)
    e["peak_extra_gb"] = max(r["saves"]["peak_extra_gb"] for r in ranks)
    e["extra_per_state"] = max(r["saves"]["peak_extra_gb"] * GB / r["local_bytes"] for r in ranks)
    e["retained_gb"] = max(r["saves"]["retained_gb"] for r in ranks)
    biggest = max(ranks, key=lambda r: r["saves"]["peak_extra_gb"])["saves"]
    for key in ("peak_in_save", "peak_processes"):  # where the largest rank's peak came from
        if key in biggest:
            e[key] = biggest[key]
    e["bytes_on_disk"] = ranks[0]["saves"]["records"][-1].get("bytes_on_disk")
    e["gbps"] = total_bytes / e["durable_s"] / GB if e["durable_s"] else None
    if disk is not None and e["gbps"] is not None:
        e["frac_buffered_write"] = e["gbps"] / disk["buffered_write_gbps"]
    if all("raw_write_s" in rec for r in ranks for rec in r["saves"]["records"]):
        # paired: each save against the direct-I/O write of the same bytes made right after it
        raw = _worst(ranks, "raw_write_s")
        e["raw_write_gbps"] = total_bytes / median(raw) / GB
        e["frac_direct_write"] = median([w / d for w, d in zip(raw, e["all_durable_s"], strict=True)])
        e["durable_over_raw"] = median([d / w for w, d in zip(raw, e["all_durable_s"], strict=True)])
    elif disk is not None and e["gbps"] is not None:  # results of runs without paired references
        e["frac_direct_write"] = e["gbps"] / disk["direct_write_gbps"]
    lib = {
        k: median([rec[k] for rec in ranks[0]["saves"]["records"] if k in rec]) for k in ranks[0]["saves"]["records"][0]
    }
    e["lib"] = {k: v for k, v in lib.items() if k.startswith("lib_")}
    return e


def load_entry(ranks: list[dict[str, Any]], total_bytes: int, disk: dict[str, Any] | None) -> dict[str, Any] | None:
    if not all(r.get("loads") for r in ranks):
        return None
    per_rank = [r["loads"] for r in ranks]
    times = [max(rec["load_s"] for rec in same) for same in zip(*per_rank, strict=True)]
    t = median(times)
    e: dict[str, Any] = {"load_s": t, "all_load_s": times, "gbps": total_bytes / t / GB if t else None}
    e["first_load_s"] = times[0]
    e["verified"] = all(rec["verified"] for recs in per_rank for rec in recs)
    e["in_place"] = all(rec["in_place"] for recs in per_rank for rec in recs)
    if all("raw_read_s" in rec for recs in per_rank for rec in recs):
        raw = [max(rec["raw_read_s"] for rec in same) for same in zip(*per_rank, strict=True)]
        e["raw_read_gbps"] = total_bytes / median(raw) / GB
        e["frac_direct_read"] = median([r / t for r, t in zip(raw, times, strict=True)])
    elif disk is not None and e["gbps"] is not None:
        e["frac_direct_read"] = e["gbps"] / disk["direct_read_gbps"]
    return e


def steps_entry(ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not all(r.get("steps") for r in ranks):
        return None
    first = ranks[0]["steps"]
    e = {k: first[k] for k in ("steps", "saves", "baseline_steps", "every", "batch", "width")}

    def worst(key: str) -> float | None:
        vals = [r["steps"][key] for r in ranks if r["steps"].get(key) is not None]
        return max(vals) if vals else None

    keys = ("base_step_ms", "during_persist_steps", "during_persist_ratio", "loop_ratio", "lost_per_checkpoint_s")
    for key in (*keys, "max_step_s"):
        e[key] = worst(key)
    return e


def method_entry(
    name: str, by_regime: dict[str, list[dict[str, Any]]], total_bytes: int, disks: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """One method's entry from its workers' results, regime by regime."""
    m = METHODS[name]
    e: dict[str, Any] = {"label": m.label, "kind": m.kind, "fsyncs": m.fsyncs, "note": m.note, "saves": {}}
    errors: dict[str, str] = {}
    for i, (regime, ranks) in enumerate(by_regime.items()):
        err = _errors(ranks)
        if err is not None:
            errors[regime] = err
            continue
        if m.kind != "reference":
            e["saves"][regime] = save_entry(ranks, total_bytes, disks.get(regime))
        phase_errors = {k: v for r in ranks for k, v in r.get("phase_errors", {}).items()}
        if phase_errors:
            errors.update({f"{k} ({regime})": v for k, v in phase_errors.items()})
        if i == 0:  # loads and the training loop run in the first regime's workers
            e["load"] = load_entry(ranks, total_bytes, disks.get(regime))
            if e["load"] is not None:
                e["load"]["label"] = m.load
            e["steps"] = steps_entry(ranks)
    e["status"] = OK if e["saves"] or (m.kind == "reference" and e.get("steps")) else FAILED
    if errors:
        e["errors"] = errors
        e["reason"] = "; ".join(f"{k}: {v}" for k, v in errors.items())
    return e


def _get(methods: dict[str, Any], name: str, regime: str, key: str) -> float | None:
    e = methods.get(name)
    if not e or e.get("status") != OK or regime not in e["saves"]:
        return None
    v = e["saves"][regime].get(key)
    return float(v) if v is not None else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _target(name: str, method: str, regime: str | None, value: float | None, *, limit: float, at_least: bool) -> Any:
    met = None if value is None else (value >= limit if at_least else value <= limit)
    return {"target": name, "method": method, "regime": regime, "value": value, "limit": limit, "met": met}


def targets(cfg: dict[str, Any], regimes: list[str]) -> list[dict[str, Any]]:
    """The issue's targets, checked on this configuration's figures (``met`` None where not measured).

    Blocking against DCP is checked twice: on the call, and on the time until the live state may
    change (DCP's async staging returns before its copy is done; the next optimizer step waits).
    """
    ms, disks, out = cfg["methods"], cfg["disk"], []
    dcp_async = [n for n in ms if n.startswith("dcp_async")]
    for regime in regimes:
        ts = _get(ms, "torch_save", regime, "blocking_s")
        for name, limit in (("stashpoint_async", 10.0), ("stashpoint_overlap", 50.0)):
            value = _ratio(ts, _get(ms, name, regime, "blocking_s"))
            out.append(_target(f"blocking: >= {limit:g}x below torch.save+fsync", name, regime, value, limit=limit,
                               at_least=True))  # fmt: skip
        for key, what in (("blocking_s", "call"), ("staged_s", "until the state is free")):
            best = [v for n in dcp_async if (v := _get(ms, n, regime, key)) is not None]
            for name in ("stashpoint_async", "stashpoint_overlap"):
                value = _ratio(_get(ms, name, regime, key), min(best) if best else None)
                out.append(_target(f"blocking: <= 1/2 of the best DCP async_save ({what})", name, regime, value,
                                   limit=0.5, at_least=False))  # fmt: skip
        disk = disks.get(regime) or {}
        raw = disk.get("direct_write_gbps")
        bound = 1.25 * cfg["state_bytes"] / (raw * GB) if raw else None
        for name in ("stashpoint_async", "stashpoint_process"):
            paired = _get(ms, name, regime, "durable_over_raw")
            value = paired / 1.25 if paired is not None else _ratio(_get(ms, name, regime, "durable_s"), bound)
            out.append(_target("until durable / (1.25 x bytes / raw direct-I/O write): <= 1", name, regime, value,
                               limit=1.0, at_least=False))  # fmt: skip
    load = (ms.get("stashpoint_save") or {}).get("load") or {}
    dcp_load = (ms.get("dcp_save") or {}).get("load") or {}
    raw_kind = "cached" if cfg.get("load_regime") == "same-node" else "direct-I/O"
    out.append(_target(f"load: >= 0.8x raw {raw_kind} read", "stashpoint_save", None, load.get("frac_direct_read"),
                       limit=0.8, at_least=True))  # fmt: skip
    out.append(_target("load: faster than dcp.load (speedup)", "stashpoint_save", None,
                       _ratio(dcp_load.get("load_s"), load.get("load_s")), limit=1.0, at_least=True))  # fmt: skip
    for name in ("stashpoint_async", "stashpoint_process", "stashpoint_overlap"):
        st = (ms.get(name) or {}).get("steps") or {}
        out.append(_target("step time while a persist runs: <= 1.1x undisturbed", name, None,
                           st.get("during_persist_ratio"), limit=1.1, at_least=False))  # fmt: skip
    first = regimes[0] if regimes else None
    for name in ("stashpoint_async", "stashpoint_process", "stashpoint_overlap"):
        value = _get(ms, name, first, "extra_per_state") if first else None
        out.append(_target("extra host memory per in-flight save: <= 1.1x the state", name, first, value, limit=1.1,
                           at_least=False))  # fmt: skip
    return out
