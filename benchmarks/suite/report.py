"""The markdown report: per configuration, the raw disk, the saves per regime, the loads, the
training loop and the targets; methods that did not run are listed with the reason."""

from __future__ import annotations

from typing import Any

from .common import GB
from .methods import OK


def _f(x: float | None, fmt: str = ".3f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{fmt}}{suffix}"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else (f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s")


def _unavailable_row(e: dict[str, Any], cols: int) -> str:
    return f"| {e['label']} | {e['status']}: {e.get('reason', '')} |" + " |" * (cols - 2)


def config_title(cfg: dict[str, Any]) -> str:
    what = {"single": "one process", "ddp": "replicated on every rank (DDP)", "fsdp": "sharded with FSDP2"}
    return (
        f"{cfg['ranks']} rank{'s' if cfg['ranks'] > 1 else ''}, {cfg['state_bytes'] / GB:.2f} GB state "
        f"({what[cfg['layout']]}; {cfg['num_tensors']} tensors{' per rank' if cfg['ranks'] > 1 else ''})"
    )


def disk_table(cfg: dict[str, Any]) -> list[str]:
    lines = [
        "| raw disk, same byte count | direct-I/O write + fsync | direct-I/O read | buffered write + fsync "
        "| buffered read (evicted) |",
        "|---|---:|---:|---:|---:|",
    ]
    for regime, d in cfg["disk"].items():
        if "error" in d:
            lines.append(f"| {regime} | failed: {d['error']} | | | |")
            continue
        lines.append(
            f"| {regime} | {_f(d['direct_write_gbps'], '.2f')} GB/s | {_f(d['direct_read_gbps'], '.2f')} GB/s "
            f"| {_f(d['buffered_write_gbps'], '.2f')} GB/s | {_f(d['buffered_read_gbps'], '.2f')} GB/s |"
        )
    fl = cfg.get("floor")
    if fl and "error" not in fl:
        lines += [
            "",
            f"Copy floor: `copy_` of the whole state into reused host buffers {_ms(fl['copy_s'])} "
            f"({_f(fl['gbps'], '.1f')} GB/s); into fresh memory (first touch) {_ms(fl['first_touch_copy_s'])}.",
        ]
    return lines


def save_table(cfg: dict[str, Any], regime: str) -> list[str]:
    lines = [
        f"Saves, {regime} page cache (median of {cfg['repeats']} after a warm-up; on several ranks the slowest rank):",
        "",
        "| method | blocking | state free | until durable | GB/s | x raw direct write | first call | "
        "peak extra memory (x state) | on disk GB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in cfg["methods"].values():
        if e.get("kind") == "reference":  # no checkpoint: the training loop's table only
            continue
        if e["status"] != OK:
            lines.append(_unavailable_row(e, 9))
            continue
        s = e["saves"].get(regime)
        if s is None:
            lines.append(f"| {e['label']} | failed in this regime: {e['errors'].get(regime, '?')} |" + " |" * 7)
            continue
        durable = _ms(s["durable_s"]) + ("" if e["fsyncs"] else " *")
        lines.append(
            f"| {e['label']} | {_ms(s['blocking_s'])} | {_ms(s['staged_s'])} | {durable} | {_f(s['gbps'], '.2f')} "
            f"| {_f(s.get('frac_direct_write'), '.2f')} | {_ms(s['first_blocking_s'])} "
            f"| {_f(s['peak_extra_gb'], '.2f')} GB ({_f(s['extra_per_state'], '.2f')}) "
            f"| {_f((s['bytes_on_disk'] or 0) / GB, '.2f')} |"
        )
    return lines


def load_table(cfg: dict[str, Any]) -> list[str]:
    rows = [e for e in cfg["methods"].values() if e["status"] == OK and e.get("load")]
    if not rows:
        return []
    same_node = cfg.get("load_regime") == "same-node"
    where = (
        "the page cache as the save and an idle wait left it (a process restarted on the same node); the raw read "
        "reads as many bytes as a rank's load (all of the state where every rank holds it) from the page cache"
        if same_node
        else "checkpoint pages evicted first (a fresh node)"
    )
    lines = [
        f"Loads into the live state, {where}, each verified against the saved values:",
        "",
        f"| method | load | GB/s | x raw {'cached' if same_node else 'direct'} read | first load | verified "
        "| in place |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for e in rows:
        ld = e["load"]
        lines.append(
            f"| {ld['label']} | {_ms(ld['load_s'])} | {_f(ld['gbps'], '.2f')} "
            f"| {_f(ld.get('frac_direct_read'), '.2f')} | {_ms(ld['first_load_s'])} "
            f"| {'yes' if ld['verified'] else 'NO'} | {'yes' if ld['in_place'] else 'no'} |"
        )
    return lines


def steps_table(cfg: dict[str, Any]) -> list[str]:
    rows = [e for e in cfg["methods"].values() if e["status"] == OK and e.get("steps")]
    if not rows:
        return []
    st0 = rows[0]["steps"]
    # a reference measured in the loop only has no row elsewhere: say here why it is missing
    missing = [e for e in cfg["methods"].values() if e.get("kind") == "reference" and e["status"] != OK]
    lines = [
        f"Training loop (an MLP step of ~{_f(st0['base_step_ms'], '.0f')} ms; a checkpoint every {st0['every']} "
        "steps, against the same loop's undisturbed steps):",
        "",
        "| method | undisturbed step | step while a persist runs (x) | whole loop (x) | time lost per checkpoint "
        "| longest step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [_unavailable_row(e, 6) for e in missing]
    for e in rows:
        st = e["steps"]
        lines.append(
            f"| {e['label']} | {_f(st['base_step_ms'], '.1f')} ms | {_f(st['during_persist_ratio'], '.2f')} "
            f"| {_f(st['loop_ratio'], '.2f')} | {_ms(st['lost_per_checkpoint_s'])} | {_ms(st['max_step_s'])} |"
        )
    return lines


def targets_table(cfg: dict[str, Any]) -> list[str]:
    lines = ["| target | method | regime | measured | met |", "|---|---|---|---:|---|"]
    for t in cfg["targets"]:
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['target']} | {t['method']} | {t['regime'] or '-'} | {_f(t['value'], '.2f')} | {met} |")
    return lines


def short_title(cfg: dict[str, Any]) -> str:
    layout = "" if cfg["layout"] == "single" else f" {cfg['layout']}"
    return f"{cfg['ranks']}r{layout} {cfg['size_gb']:g} GB"


def targets_overview(doc: dict[str, Any]) -> list[str]:
    """Every target (row) on every configuration (column): the measured value, and whether met."""
    cfgs = doc["configs"]
    rows: dict[tuple[str, str, str], dict[int, dict[str, Any]]] = {}
    for i, cfg in enumerate(cfgs):
        for t in cfg["targets"]:
            rows.setdefault((t["target"], t["method"], t["regime"] or "-"), {})[i] = t
    lines = [
        "| target | method | regime | " + " | ".join(short_title(c) for c in cfgs) + " |",
        "|---|---|---|" + "---:|" * len(cfgs),
    ]
    for (target, method, regime), by_cfg in rows.items():
        cells = []
        for i in range(len(cfgs)):
            t = by_cfg.get(i)
            if t is None or t["met"] is None:
                cells.append("n/a")
            else:
                cells.append(f"{_f(t['value'], '.2f')}" + ("" if t["met"] else " **no**"))
        lines.append(f"| {target} | {method} | {regime} | " + " | ".join(cells) + " |")
    return lines


def _save_fig(regime: str, key: str) -> Any:
    def get(e: dict[str, Any]) -> float | None:
        s = e.get("saves", {}).get(regime)
        return None if s is None else s.get(key)

    return get


def _part_fig(part: str, key: str) -> Any:
    def get(e: dict[str, Any]) -> float | None:
        return (e.get(part) or {}).get(key)

    return get


def _best(cfg: dict[str, Any], names: list[str], get: Any) -> tuple[str, float] | None:
    vals = [(n, v) for n in names if (v := get(cfg["methods"][n])) is not None]
    return min(vals, key=lambda nv: nv[1]) if vals else None


def headline_table(cfg: dict[str, Any]) -> list[str]:
    """In short: per figure, the best stashpoint method against the best peer (all: lower is better)."""
    ms = {n: e for n, e in cfg["methods"].items() if e["status"] == OK and e.get("kind") != "reference"}
    ours = [n for n in ms if n.startswith("stashpoint")]
    peers = [n for n in ms if not n.startswith("stashpoint")]
    # memory: against the methods that also return before the data is written (they hold a copy)
    figs: list[tuple[str, Any, Any]] = []
    for regime in cfg["saves_regimes"]:
        figs += [
            (f"blocking ({regime})", _save_fig(regime, "blocking_s"), _ms),
            (f"until the state is free ({regime})", _save_fig(regime, "staged_s"), _ms),
            (f"until durable ({regime})", _save_fig(regime, "durable_s"), _ms),
        ]
    figs += [
        ("load", _part_fig("load", "load_s"), _ms),
        ("step while a persist runs (x undisturbed)", _part_fig("steps", "during_persist_ratio"),
         lambda v: _f(v, ".2f", "x")),
        ("time lost per checkpoint", _part_fig("steps", "lost_per_checkpoint_s"), _ms),
        (f"peak extra memory (x state, {cfg['saves_regimes'][0]}; peers: async ones)",
         _save_fig(cfg["saves_regimes"][0], "extra_per_state"), lambda v: _f(v, ".2f", "x")),
    ]  # fmt: skip
    ts = cfg["methods"].get("torch_save", {})
    lines = [
        "| figure | stashpoint (best) | best peer | torch.save+fsync | best peer / stashpoint |",
        "|---|---|---|---:|---:|",
    ]
    background = [n for n in peers if ms[n].get("kind") == "async"]
    for label, get, fmt in figs:
        a, b = _best(cfg, ours, get), _best(cfg, background if "memory" in label else peers, get)
        if a is None and b is None:
            continue
        t = get(ts) if ts.get("status") == OK else None

        def name(n: str, label: str = label) -> str:  # a load row names the load (torch.load, not torch.save)
            ld = ms[n].get("load") or {}
            return str(ld.get("label") or ms[n]["label"]) if label == "load" else str(ms[n]["label"])

        ours_s = "n/a" if a is None else f"{fmt(a[1])} ({name(a[0])})"
        peer_s = "n/a" if b is None else f"{fmt(b[1])} ({name(b[0])})"
        ratio = _f(b[1] / a[1], ".2f", "x") if a and b and a[1] > 0 else "n/a"
        lines.append(f"| {label} | {ours_s} | {peer_s} | {'n/a' if t is None else fmt(t)} | {ratio} |")
    floor = (cfg["methods"].get("io_floor") or {}).get("steps")
    if floor:
        lines += [
            "",
            "The I/O floor (a bare direct-I/O write of the same bytes, no checkpoint) in the same loop: step while "
            f"it runs {_f(floor['during_persist_ratio'], '.2f')}x, {_ms(floor['lost_per_checkpoint_s'])} lost per "
            "write.",
        ]
    return lines


def headline(doc: dict[str, Any]) -> list[str]:
    """The "in short" tables of every configuration, before the full ones."""
    out = ["In short: the best stashpoint method against the best other method, per figure (lower is better):"]
    for cfg in doc["configs"]:
        out += ["", f"**{short_title(cfg)}**", "", *headline_table(cfg)]
    return out


def run_lines(meta: dict[str, Any]) -> list[str]:
    """What ran: the machine, the versions, the load average and the command of one run."""
    mc, v = meta["machine"], meta["versions"]
    return [
        f"Run {meta['date']}: {mc['cpus']} CPUs, {mc['ram_gib']:.0f} GiB RAM, torch {v['torch']}, stashpoint "
        f"{v['stashpoint']} ({meta['commit']}), torchsnapshot {v['torchsnapshot']}, torch-checkpointing "
        f"{v['torch-checkpointing']}, accelerate {v['accelerate']}; load average {meta['loadavg_start'][0]:.2f} at "
        f"the start, {meta['loadavg_end'][0]:.2f} at the end; {meta['wall_s'] / 60:.0f} minutes.",
        "",
        f"Command: `{meta['command']}`",
    ]


def markdown(doc: dict[str, Any]) -> str:
    out: list[str] = []
    for i, meta in enumerate(doc["meta"].get("runs") or [doc["meta"]]):
        out += ([""] if i else []) + run_lines(meta)
    out += ["", *headline(doc)]
    if len(doc["configs"]) > 1:
        out += ["", "Targets of issue 5 on every configuration (the measured value; **no**: missed):", ""]
        out += targets_overview(doc)
    for cfg in doc["configs"]:
        out += ["", f"#### {config_title(cfg)}", "", *disk_table(cfg)]
        for name, command in cfg.get("remeasured", {}).items():
            label = cfg["methods"][name]["label"]
            out += ["", f"{label}: its figures here come from a later run, `{command}`."]
        for regime in cfg["saves_regimes"]:
            out += ["", *save_table(cfg, regime)]
        for part in (load_table(cfg), steps_table(cfg)):
            if part:
                out += ["", *part]
        out += ["", "Targets of issue 5 on these figures:", "", *targets_table(cfg)]
    out += [
        "",
        "Blocking: the save call (training stalled), state-dict construction included. State free: until the live "
        "state may change (later than the call for DCP's async staging, torch-checkpointing's staging and "
        "stashpoint's overlap mode, whose copies run in the background until the next optimizer step). Until "
        "durable: until fsynced; * = the library does not fsync, the harness fsyncs its files after it reports "
        "done (included). Peak extra memory: anonymous memory of the process and its children plus shared memory, "
        "above the state, during the saves. GB/s: the state's bytes over the time until durable. x raw direct "
        "write (read): against a direct-I/O write (read) of the same bytes by the same ranks right after each save "
        "(load), median over the repeats (the disk's speed swings within minutes on a shared machine); the raw disk "
        "table is measured once per configuration.",
    ]
    if doc.get("plots"):
        out += ["", "Plots: " + ", ".join(f"[{p}]({p})" for p in doc["plots"]) + "."]
    return "\n".join(out) + "\n"
