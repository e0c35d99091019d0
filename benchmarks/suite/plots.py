"""PNG plots (matplotlib, Agg backend): blocking times, and training-loop timelines.

* ``blocking.png``: per configuration, a horizontal bar per method and regime: the blocking time
  (solid) and the time until durable (outline), on a log scale;
* ``timeline-<config>.png``: per method, each training step as a bar (as wide as it lasted, as
  high as its duration, log scale) against the wall clock, with every checkpoint call marked
  (red line) and the span until the library reported the save finished shaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .methods import OK

REGIME_COLORS = {"cold": "#1f77b4", "hot": "#ff7f0e"}


def available() -> str | None:
    """None if matplotlib can be imported, else what to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        return "plots skipped: matplotlib is not installed (pip install matplotlib, or pip install -e '.[bench]')"
    return None


def config_slug(cfg: dict[str, Any]) -> str:
    return f"{cfg['ranks']}r-{cfg['layout']}-{cfg['size_gb']:g}gb"


def blocking_chart(doc: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    cfgs = doc["configs"]
    heights = [max(1, sum(1 for e in c["methods"].values() if e["status"] == OK and e["saves"])) for c in cfgs]
    fig, axes = plt.subplots(len(cfgs), 1, figsize=(9, 1.2 + 0.42 * sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})  # fmt: skip
    from .report import config_title

    for ax, cfg in zip(axes[:, 0], cfgs, strict=True):
        rows = [e for e in cfg["methods"].values() if e["status"] == OK and e["saves"]]
        regimes = cfg["saves_regimes"]
        bar = 0.8 / max(1, len(regimes))
        for j, regime in enumerate(regimes):
            ys, blocking, durable = [], [], []
            for i, e in enumerate(rows):
                s = e["saves"].get(regime)
                if s is None:
                    continue
                ys.append(i + j * bar)
                blocking.append(s["blocking_s"])
                durable.append(s["durable_s"])
            color = REGIME_COLORS.get(regime, "gray")
            ax.barh(ys, durable, height=bar, fill=False, edgecolor=color, linewidth=0.8)
            ax.barh(ys, blocking, height=bar, color=color, label=f"{regime}: blocking (solid), until durable (outline)")
        ax.set_yticks([i + bar * (len(regimes) - 1) / 2 for i in range(len(rows))])
        ax.set_yticklabels([e["label"] for e in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("seconds (log scale)", fontsize=8)
        ax.set_title(config_title(cfg), fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="x", which="both", alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def timeline(cfg: dict[str, Any], path: Path) -> bool:
    """The training-loop timeline of one configuration; False if no method has one."""
    import matplotlib.pyplot as plt

    rows = [e for e in cfg["methods"].values() if e["status"] == OK and e.get("steps")]
    if not rows:
        return False
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 0.5 + 1.0 * len(rows)), sharex=True, squeeze=False)
    for ax, e in zip(axes[:, 0], rows, strict=True):
        st = e["steps"]
        t = [s["t"] for s in st["steps"]]
        dur = [s["s"] for s in st["steps"]]
        ms = [d * 1e3 for d in dur]
        base = st["base_step_ms"] or 1.0
        for sv in st["saves"]:
            end = sv.get("done_at", sv["call_at"] + sv["blocking_s"])
            ax.axvspan(sv["call_at"], end, color="#d62728", alpha=0.12, linewidth=0)
            ax.axvline(sv["call_at"], color="#d62728", linewidth=0.8)
        # each step as a bar as wide as it lasted: a stall shows as a tall, wide bar
        ax.bar(t, ms, width=dur, align="edge", color="#444444", edgecolor="white", linewidth=0.2)
        ax.axhline(base, color="gray", linestyle=":", linewidth=0.7)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(base / 2, max(max(ms), base * 2) * 1.3)
        ax.set_ylabel("step ms", fontsize=7)
        ax.tick_params(labelsize=6)
        during = st.get("during_persist_ratio")
        ax.set_title(
            f"{e['label']}: steps x{during:.2f} while persisting" if during else f"{e['label']} (blocking save)",
            fontsize=7,
            loc="left",
        )
    axes[-1, 0].set_xlabel(
        "seconds since the loop started (red: checkpoint call; shaded: until the save finished)", fontsize=7
    )
    from .report import config_title

    height = 0.5 + 1.0 * len(rows)
    fig.suptitle(f"Training step times, {config_title(cfg)}", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.25 / height))  # room for the title above the first panel
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return True


def write_all(doc: dict[str, Any], out: Path) -> list[str]:
    """Every plot into ``out``; the file names written."""
    names = ["blocking.png"]
    blocking_chart(doc, out / names[0])
    for cfg in doc["configs"]:
        name = f"timeline-{config_slug(cfg)}.png"
        if timeline(cfg, out / name):
            names.append(name)
    return names
