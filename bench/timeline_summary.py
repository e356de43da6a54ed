"""Where a step's time goes, from a ``--streaming-trace`` timeline: milliseconds per decode step.

    python bench/timeline_summary.py TRACE.json [--last N]

Prints JSON: over the last ``N`` decode steps (all by default), the mean per step of the step's
wall time, the MoE layer calls, the time between them, the spans inside the layer calls, the reads,
and the per-layer ``split`` of a token's time. Used by ``bench/gpu_pipeline.py`` (variant word
``tl``). What each figure counts: docs/benchmarks/methods.md (timeline_summary.py).
"""

import argparse
import json
import sys
from collections import defaultdict

# names of the spans inside a layer call, on the calling thread (schedules/, reads/bank_reads.py)
INSIDE = ("host sync", "wait read", "wait staged", "wait compute", "submit", "install")

# span name -> its part of the per-layer split
PART_OF = {"host sync": "ids wait", "wait read": "reads", "wait staged": "reads",
           "wait ahead": "reads", "install": "installs", "submit": "compute",
           "wait compute": "compute"}  # fmt: skip
SPLIT_KEYS = ("ids wait", "host to submit", "reads", "installs", "compute", "rest",
              "between layers")  # fmt: skip


def load_events(path):
    """The events of a finished or cut-short trace file (no closing ``]``)."""
    text = open(path).read().rstrip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    return json.loads(text)


def span_union(spans):
    """Total length of the union of ``(start, end)`` spans."""
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def within(e, start, end):
    """Whether event ``e`` lies in ``[start, end]`` (1 us of slack at the end)."""
    return start <= e["ts"] and e["ts"] + e["dur"] <= end + 1


def summarize(path, last=None):
    """Mean milliseconds (and read figures) per decode step; see the module docstring."""
    events = [e for e in load_events(path) if e.get("ph") == "X"]
    steps = [e for e in events if e["cat"] == "step" and e["name"] == "decode"]
    if last:
        steps = steps[-last:]
    if not steps:
        return {"steps": 0}
    sums, split = defaultdict(float), defaultdict(float)
    calls = 0
    for step in steps:
        tid = step["tid"]
        inside = [e for e in events if within(e, step["ts"], step["ts"] + step["dur"])]
        layers = [e for e in inside if e["cat"] == "layer" and e["tid"] == tid]
        own = [e for e in inside if e["tid"] == tid and e["name"] in PART_OF and e["cat"] != "read"]
        reads = [e for e in inside if e["cat"] == "read" and e["name"] == "read"]
        sums["step"] += step["dur"]
        sums["layer calls"] += sum(e["dur"] for e in layers)
        for e in inside:
            if e["tid"] == tid and e["name"] in INSIDE:
                sums[e["name"]] += e["dur"]
        sums["reads"] += len(reads)
        sums["read bytes"] += sum(e["args"].get("bytes", 0) for e in reads)
        sums["read time summed"] += sum(e["dur"] for e in reads)
        sums["read in flight"] += span_union([(e["ts"], e["ts"] + e["dur"]) for e in reads])
        for layer in layers:
            end = layer["ts"] + layer["dur"]
            split_layer(layer, [e for e in own if within(e, layer["ts"], end)], split)
        split["between layers"] += step["dur"] - sum(e["dur"] for e in layers)
        calls += len(layers)
    n = len(steps)
    ms = {k: v / n / 1e3 for k, v in sums.items() if k not in ("reads", "read bytes")}
    out = {"steps": n}
    out.update({f"{k} ms": round(v, 3) for k, v in ms.items()})
    out["between layer calls ms"] = round(ms["step"] - ms["layer calls"], 3)
    inside_ms = sum(ms.get(k, 0.0) for k in INSIDE)
    out["other in layer calls ms"] = round(ms["layer calls"] - inside_ms, 3)
    out["reads per step"] = sums["reads"] / n
    out["MB read per step"] = round(sums["read bytes"] / n / 1e6, 3)
    flight = sums["read in flight"] / 1e6
    gbs = round(sums["read bytes"] / 1e9 / flight, 3) if flight else None
    out["GB/s while reads in flight"] = gbs
    out.update(verify_loads(events, steps))
    out["split"] = {
        "layer calls per token": calls / n,
        "ms per token": {k: round(split[k] / n / 1e3, 4) for k in SPLIT_KEYS},
        "ms per layer": {k: round(split[k] / calls / 1e3, 4) for k in SPLIT_KEYS} if calls else {},
    }
    return out


def verify_loads(events, steps):
    """Per decode step, the verified steps' loads of a token's misses (``verify load`` spans, on
    the calling thread between a pass and the pass run again, so outside the steps' spans) from
    the first step to the last: the decode's wait in them, the disk's idle time inside that wait
    (no read in flight) and the GB/s over the wait. Empty where the trace has none."""
    first, last = steps[0]["ts"], max(s["ts"] + s["dur"] for s in steps)
    loads = [e for e in events if e["name"] == "verify load" and first <= e["ts"] <= last]
    if not loads:
        return {}
    reads = [e for e in events if e["cat"] == "read" and e["name"] == "read"]
    waited = busy = nbytes = 0.0
    for load in loads:
        a, b = load["ts"], load["ts"] + load["dur"]
        inside = [e for e in reads if e["ts"] < b and e["ts"] + e["dur"] > a]
        waited += b - a
        busy += span_union([(max(a, e["ts"]), min(b, e["ts"] + e["dur"])) for e in inside])
        nbytes += sum(e["args"].get("bytes", 0) for e in inside if within(e, a, b))
    n = len(steps)
    return {
        "verify loads per step": len(loads) / n,
        "verify load ms": round(waited / n / 1e3, 3),
        "disk idle in verify loads ms": round((waited - busy) / n / 1e3, 3),
        "GB/s over verify loads": round(nbytes / 1e9 / (waited / 1e6), 3) if waited else None,
    }


def split_layer(layer, spans, sums):
    """Adds one MoE layer call's parts (``SPLIT_KEYS``) to ``sums``; ``spans``: its calling
    thread's spans of ``PART_OF`` names within the call."""
    syncs = [e for e in spans if e["name"] == "host sync"]
    sync_end = syncs[0]["ts"] + syncs[0]["dur"] if syncs else layer["ts"]
    submits = [e["ts"] for e in spans if e["name"] == "submit" and e["ts"] >= sync_end]
    first_submit = min(submits, default=layer["ts"] + layer["dur"])
    host = max(0.0, first_submit - sync_end)
    for e in spans:
        sums[PART_OF[e["name"]]] += e["dur"]
        before_submit = sync_end <= e["ts"] and e["ts"] + e["dur"] <= first_submit
        if e["name"] != "host sync" and before_submit:
            host -= e["dur"]  # a wait or install before the submission
    sums["host to submit"] += host
    sums["rest"] += layer["dur"] - sum(e["dur"] for e in spans) - host


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--last", type=int, default=None)
    args = ap.parse_args()
    json.dump(summarize(args.trace, args.last), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
