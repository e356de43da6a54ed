"""Draw one step of a ``--streaming-trace`` timeline as a PNG: a lane per thread, time across.

    python bench/timeline_png.py TRACE.json [--out FILE.png]

Draws the decode step that read the most bytes (of a file cut short too). Where the traces of
docs/benchmarks/timeline-*.png come from: docs/benchmarks/methods.md (timeline_png.py). Needs
matplotlib (``pip install matplotlib``).
"""

import argparse
from collections import defaultdict
from pathlib import Path

from timeline_summary import load_events

# category -> (colour, legend); a thread's lane has one row per group of categories
CATEGORIES = {
    "layer": ("#d9d9d9", "MoE layer call"),
    "sync": ("#d62728", "host sync (router ids to the host)"),
    "read": ("#1f77b4", "expert read"),
    "install": ("#9467bd", "install (staged bytes into slots)"),
    "compute": ("#2ca02c", "compute submitted (the mx.async_eval call)"),
    "wait": ("#ff7f0e", "wait (for reads or compute)"),
}
CALLER_NAMES = {"sync": "host sync", "wait": "waiting", "compute": "submitting"}


def overlaps(e, step):
    return e["ts"] <= step["ts"] + step["dur"] and e["ts"] + e["dur"] >= step["ts"]


def pick_step(events):
    """The decode step that read the most bytes (any step where none is a decode step)."""
    steps = [e for e in events if e.get("cat") == "step"]
    decode = [s for s in steps if s["args"]["phase"] == "decode"] or steps
    if not decode:
        raise SystemExit("no step in the trace: did any MoE layer run with a host sync?")
    reads = [e for e in events if e.get("name") == "read"]
    return max(decode, key=lambda s: sum(e["args"]["bytes"] for e in reads if overlaps(e, s)))


def lanes(events, step):
    """``[(label, [events])]`` overlapping the step: the calling thread's layer calls, then its
    other events, then each other thread's."""
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}

    def name(tid):
        return names.get(tid, str(tid))

    by_tid = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e["cat"] != "step" and overlaps(e, step):
            by_tid[e["tid"]].append(e)
    caller = by_tid.pop(step["tid"], [])
    out = [
        (f"{name(step['tid'])}: layers", [e for e in caller if e["cat"] == "layer"]),
        (name(step["tid"]), [e for e in caller if e["cat"] != "layer"]),
    ]
    return out + [(name(tid), by_tid[tid]) for tid in sorted(by_tid, key=name)]


def render(events, step, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = lanes(events, step)
    t0 = step["ts"]
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.45 * len(rows)))
    for y, (_, evs) in enumerate(rows):
        for e in sorted(evs, key=lambda e: -e["dur"]):  # short ones on top
            x, w = (e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 0.02)
            h = 0.8 if e["cat"] != "wait" else 0.4
            colour = CATEGORIES.get(e["cat"], ("#777",))[0]
            ax.broken_barh([(x, w)], (y - h / 2, h), color=colour, edgecolor="white", linewidth=0.5)
            label = bar_label(e)
            if label and w > 0.03 * step["dur"] / 1e3:
                ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, step["dur"] / 1e3)
    ax.set_xlabel("ms from the step's first MoE layer call")
    args = step["args"]
    reads = [e for _, evs in rows for e in evs if e.get("name") == "read"]
    mb = sum(e["args"]["bytes"] for e in reads) / 1e6
    spent = ", ".join(f"{k} {v:.1f} ms" for k, v in time_on_caller(rows[1][1], step).items())
    ax.set_title(
        f"{args['phase']} step {args['step']}: {step['dur'] / 1e3:.1f} ms, "
        f"{len(reads)} expert reads ({mb:.1f} MB)\ncalling thread: {spent}",
        fontsize=9,
    )
    handles = [Patch(color=c, label=label) for c, label in CATEGORIES.values()]
    below = (0.5, -0.35 if len(rows) < 5 else -0.2)
    ax.legend(handles=handles, fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=below)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def time_on_caller(evs, step):
    """Milliseconds of the step the calling thread spent per category (within the step)."""
    start, end = step["ts"], step["ts"] + step["dur"]
    spent = defaultdict(float)
    for e in evs:
        spent[e["cat"]] += max(0.0, min(end, e["ts"] + e["dur"]) - max(start, e["ts"])) / 1e3
    ranked = sorted(spent.items(), key=lambda kv: -kv[1])
    return {CALLER_NAMES.get(k, k): v for k, v in ranked}


def bar_label(e):
    a = e["args"]
    if e["cat"] == "read":
        return f"e{a['expert']}"
    if e["cat"] == "layer":
        layer = next((p for p in a["layer"].split(".") if p.isdigit()), a["layer"])
        return f"L{layer} {a.get('misses', 0)} miss"
    return ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="a --streaming-trace file")
    ap.add_argument("--out", default=None, help="PNG to write (default: next to the trace)")
    args = ap.parse_args()
    out = Path(args.out) if args.out else Path(args.trace).with_suffix(".png")
    events = load_events(args.trace)
    step = pick_step(events)
    render(events, step, out)
    print(f"wrote {out} (step {step['args']['step']})")


if __name__ == "__main__":
    main()
