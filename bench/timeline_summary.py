"""Where a step's time goes, from a ``--streaming-trace`` timeline: milliseconds per decode step.

    python bench/timeline_summary.py TRACE.json [--last N]

For the last ``N`` decode steps (all by default), the mean per step of: the step's wall time (its
``decode`` span: first MoE layer call to last), the MoE layer calls, the time between them (attention,
norms, mlx-lm's own work), and inside the layer calls the host syncs, the waits for reads, for staged
reads and for compute, the compute submissions, the installs and what is left (the layer's other
host work: maps, graph building). Reads: how many, their bytes, the summed read time over threads,
the time at least one read was in flight, and the GB/s over that time (what the disk gave while the
layer waited on it). Used by ``bench/gpu_pipeline.py`` (word ``tl`` of a variant).
"""

import argparse
import json
import sys
from collections import defaultdict

# names of the spans inside a layer call, on the calling thread (switch.py, bank_io.py)
INSIDE = ("host sync", "wait read", "wait staged", "wait compute", "submit", "install")


def load_events(path):
    """The complete events of a finished or cut-short trace file."""
    text = open(path).read().rstrip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    return [e for e in json.loads(text) if e.get("ph") == "X"]


def span_union(spans):
    """Total length of the union of ``(start, end)`` spans (also ``experts.ReadSpans``)."""
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def summarize(path, last=None):
    """Mean milliseconds (and read figures) per decode step; see the module docstring."""
    events = load_events(path)
    steps = [e for e in events if e["cat"] == "step" and e["name"] == "decode"]
    if last:
        steps = steps[-last:]
    if not steps:
        return {"steps": 0}
    sums = defaultdict(float)
    for step in steps:
        a, b = step["ts"], step["ts"] + step["dur"]
        tid = step["tid"]
        inside = [e for e in events if a <= e["ts"] and e["ts"] + e["dur"] <= b + 1]
        layers = [e for e in inside if e["cat"] == "layer" and e["tid"] == tid]
        sums["step"] += step["dur"]
        sums["layer calls"] += sum(e["dur"] for e in layers)
        for e in inside:
            if e["tid"] == tid and e["name"] in INSIDE:
                sums[e["name"]] += e["dur"]
        reads = [e for e in inside if e["cat"] == "read"]
        sums["reads"] += len(reads)
        sums["read bytes"] += sum(e["args"].get("bytes", 0) for e in reads)
        sums["read time summed"] += sum(e["dur"] for e in reads)
        sums["read in flight"] += span_union([(e["ts"], e["ts"] + e["dur"]) for e in reads])
    n = len(steps)
    ms = {k: v / n / 1e3 for k, v in sums.items() if k not in ("reads", "read bytes")}
    out = {"steps": n}
    out.update({f"{k} ms": round(v, 3) for k, v in ms.items()})
    out["between layer calls ms"] = round(ms["step"] - ms["layer calls"], 3)
    out["other in layer calls ms"] = round(
        ms["layer calls"] - sum(ms.get(k, 0.0) for k in INSIDE), 3
    )
    out["reads per step"] = sums["reads"] / n
    out["MB read per step"] = round(sums["read bytes"] / n / 1e6, 3)
    flight = sums["read in flight"] / 1e6
    out["GB/s while reads in flight"] = (
        round(sums["read bytes"] / 1e9 / flight, 3) if flight else None
    )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--last", type=int, default=None)
    args = ap.parse_args()
    json.dump(summarize(args.trace, args.last), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
