"""The expert cache under memory pressure: the decode's resident set over time, beside another
process's that takes nearly all the available memory for a while (issue 48).

    python bench/memory_pressure.py [--layers 8] [--leave-gb 1.5] [--hold 40] [--ckpt-dir DIR]
        [--out DIR] [--tag NAME] [--quick]

A streaming decode with no budget given (the cache follows free memory) runs in a child process
and reports, every half second, its RSS, its cache budget and the tokens so far. Once its cache
has grown (every expert resident), another child takes all but ``--leave-gb`` of /proc/meminfo's
MemAvailable, touches it, holds it ``--hold`` s (giving some back at once should MemAvailable fall
under ``SAFETY_GB``: other programs on the machine move too) and exits; the decode runs on until
its budget grew back, then stops. Then a stock model decodes as many tokens greedily, in a process
of its own, and the two token lists are compared. Prints the time series (decode RSS, the other
process's RSS, MemAvailable, the budget) and writes ``<out>/<tag>.json`` and ``.md``.

``--quick`` (CI): the tiny shape, and the pressure simulated: the other process takes a few MB and,
while it holds them, a file says the machine is short, which the decode's reader of free memory
reads in place of /proc (``ExpertCache.memory_reader``); the rest runs as for real.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness import ROOT, checkpoint, load_stock, load_streaming, log

SAFETY_GB = 1.0
PROMPT = [3, 17, 42, 5, 9, 101, 7, 64]
GiB = 1 << 30


def meminfo(name: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(name)


def rss_of(pid) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError):
        return 0


def simulated_reader(pressure_file: str):
    """``--quick``: memory short (nothing available) while ``pressure_file`` exists, else 90% free."""
    from mlx_lm_streaming.runtime.free_memory import Reading

    total = meminfo("MemTotal")

    def read():
        short = os.path.exists(pressure_file)
        return Reading(0 if short else int(0.9 * total), total, source="simulated")

    return read


def decode_child(path: str, stop_file: str, stock: bool, tokens: int, pressure_file=None) -> None:
    """Greedy decode through mlx-lm's ``generate_step``; streaming: until ``stop_file`` exists,
    a JSON status line every half second; at the end the tokens, as JSON."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from mlx_lm_streaming.runtime import moving_budget

    model, _ = load_stock(path) if stock else load_streaming(path, stats=False)
    out, done = [], threading.Event()
    cache = None if stock else model.expert_streaming.cache
    if cache is not None and pressure_file:
        cache.memory_reader = simulated_reader(pressure_file)
        moving_budget.GROW_AFTER_SECONDS = 1.0

    def report():
        start = time.monotonic()
        while not done.wait(0.5):
            line = dict(
                t=round(time.monotonic() - start, 2), rss=rss_of("self"), tokens=len(out),
                budget=cache.budget_bytes, cache=cache.resident_bytes,
                complete=bool(cache.all_complete),
            )  # fmt: skip
            print("STATUS " + json.dumps(line), flush=True)

    if cache is not None:
        threading.Thread(target=report, daemon=True).start()
    steps = generate_step(mx.array(PROMPT), model, max_tokens=tokens if stock else 100_000)
    for token, _ in steps:
        out.append(int(token))
        if stock and len(out) >= tokens:
            break
        if not stock and os.path.exists(stop_file):
            break
    done.set()
    summary = {} if stock else model.expert_streaming.stats()
    summary.pop("per_layer", None)
    summary.pop("decode_costs", None)
    print("TOKENS " + json.dumps(out), flush=True)
    print("STATS " + json.dumps(summary), flush=True)


def hog_child(take: int, hold: float, pressure_file=None) -> None:
    """Take ``take`` bytes, touched, for ``hold`` s; give back a GiB at a time while MemAvailable is
    under ``SAFETY_GB``. ``pressure_file`` (``--quick``): there while it holds."""
    import numpy as np

    if pressure_file:
        Path(pressure_file).write_text("short")

    blocks = []
    for _ in range(take // GiB):
        blocks.append(np.ones(GiB, dtype=np.uint8))
        if meminfo("MemAvailable") < SAFETY_GB * GiB:
            blocks.pop()
            break
    rest = take - len(blocks) * GiB
    if rest > 0 and meminfo("MemAvailable") - rest > SAFETY_GB * GiB:
        blocks.append(np.ones(rest, dtype=np.uint8))
    print(f"HOLDING {sum(b.nbytes for b in blocks)}", flush=True)
    end = time.monotonic() + hold
    while time.monotonic() < end:
        if meminfo("MemAvailable") < SAFETY_GB * GiB and blocks:
            blocks.pop()
            print("GAVE BACK a GiB (MemAvailable under the safety margin)", flush=True)
        time.sleep(0.2)
    if pressure_file:
        Path(pressure_file).unlink()


def run(args) -> dict:
    shape = "tiny" if args.quick else "qwen3"
    path = checkpoint(Path(args.ckpt_dir), shape, "float32", layers=args.layers)
    stop = Path(args.out) / f".{args.tag}.stop"
    stop.unlink(missing_ok=True)
    me = [sys.executable, __file__]
    simulated = []
    if args.quick:
        simulated = ["--pressure-file", str(Path(args.out) / f".{args.tag}.pressure")]
    decode = subprocess.Popen(
        me + ["--decode-child", str(path), "--stop-file", str(stop)] + simulated,
        stdout=subprocess.PIPE, text=True, bufsize=1,
    )  # fmt: skip
    rows, hog, phase, start = [], None, "growing", time.monotonic()
    events, tokens, stats, hog_end = [], None, None, None
    for line in decode.stdout:
        if line.startswith("TOKENS "):
            tokens = json.loads(line[7:])
            continue
        if line.startswith("STATS "):
            stats = json.loads(line[6:])
            continue
        if not line.startswith("STATUS "):
            continue
        s = json.loads(line[7:])
        now = time.monotonic() - start
        row = dict(
            t=round(now, 1), decode_rss=s["rss"], other_rss=rss_of(hog.pid) if hog else 0,
            available=meminfo("MemAvailable"), budget=s["budget"], cache=s["cache"],
            tokens=s["tokens"],
            phase=phase,
        )  # fmt: skip
        rows.append(row)
        log(
            f"{row['t']:6.1f} s  decode RSS {row['decode_rss'] / 1e9:6.3f} GB  other "
            f"{row['other_rss'] / 1e9:6.3f} GB  available {row['available'] / 1e9:6.3f} GB  "
            f"budget {row['budget'] / 1e9:6.3f} GB  cache {row['cache'] / 1e9:6.3f} GB  "
            f"tokens {row['tokens']}  ({phase})"
        )
        if phase == "growing" and s["complete"] and s["tokens"] >= 8:
            take = max(0, meminfo("MemAvailable") - int(args.leave_gb * GiB))
            if args.quick:
                take = 64 << 20
            hog = subprocess.Popen(
                me + ["--hog-child", str(take), "--hold", str(args.hold)] + simulated,
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            events.append((round(now, 1), f"other process starts, takes {take / 1e9:.2f} GB"))
            phase = "pressure"
        elif phase == "pressure" and hog.poll() is not None:
            events.append((round(now, 1), "other process exits"))
            hog_end, phase = now, "after"
        elif phase == "after" and (s["budget"] >= rows[0]["budget"] or now - hog_end > args.after):
            events.append((round(now, 1), "decode told to stop"))
            stop.write_text("stop")
            phase = "stopping"
    decode.wait()
    stop.unlink(missing_ok=True)
    if hog is not None:
        hog_out = hog.stdout.read()
        events.append((None, "other process said: " + " / ".join(hog_out.split("\n")).strip()))
    stock = subprocess.run(
        me + ["--stock-child", str(path), "--tokens", str(len(tokens or []))],
        capture_output=True, text=True,
    )  # fmt: skip
    stock_tokens = next(
        (json.loads(x[7:]) for x in stock.stdout.splitlines() if x.startswith("TOKENS ")), None
    )
    before = [r for r in rows if r["phase"] == "growing"]
    during = [r for r in rows if r["phase"] == "pressure"]
    after = [r for r in rows if r["phase"] in ("after", "stopping")]
    grown = before[-1]["decode_rss"] if before else 0
    least = min((r["decode_rss"] for r in during + after[:1]), default=grown)
    return dict(
        checkpoint=str(path), shape=shape, quick=args.quick, layers=args.layers, leave_gb=args.leave_gb, hold=args.hold,
        rows=rows, events=events, stats=stats, exit_status=decode.returncode,
        tokens=len(tokens or []), same_tokens=tokens == stock_tokens and tokens is not None,
        rss_grown=grown, rss_least_under_pressure=least, rss_given_back=grown - least,
        budget_after=after[-1]["budget"] if after else None,
        budget_before=before[-1]["budget"] if before else None,
    )  # fmt: skip


def shown_rows(rows, every: float = 5.0):
    """The rows the table shows: one per ``every`` s, and each where the phase, the budget or the
    cache's bytes changed (the JSON keeps every row)."""
    shown, last, before = [], None, None
    for row in rows:
        key = (row["phase"], row["budget"], row["cache"])
        if last is None or row["t"] - last >= every or key != before:
            shown.append(row)
            last = row["t"]
        before = key
    return shown


def markdown(r) -> str:
    lines = [
        f"# Memory pressure: {r['layers']} MoE layers of the Qwen3-30B-A3B expert shape",
        "",
        f"Another process takes all but {r['leave_gb']} GiB of MemAvailable for {r['hold']} s. "
        f"Decode exit status {r['exit_status']}; {r['tokens']} tokens, same as stock: "
        f"{r['same_tokens']}. Resident set when grown {r['rss_grown'] / 1e9:.3f} GB, least "
        f"under pressure {r['rss_least_under_pressure'] / 1e9:.3f} GB: "
        f"{r['rss_given_back'] / 1e9:.3f} GB given back; budget before "
        f"{(r['budget_before'] or 0) / 1e9:.3f} GB, at the end {(r['budget_after'] or 0) / 1e9:.3f} GB.",
        "",
        "| s | phase | decode RSS GB | other RSS GB | MemAvailable GB | budget GB | cache GB | tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in shown_rows(r["rows"]):
        lines.append(
            f"| {row['t']} | {row['phase']} | {row['decode_rss'] / 1e9:.3f} | "
            f"{row['other_rss'] / 1e9:.3f} | {row['available'] / 1e9:.3f} | "
            f"{row['budget'] / 1e9:.3f} | {row['cache'] / 1e9:.3f} | {row['tokens']} |"
        )
    lines += ["", "Events: " + "; ".join(f"{t} s: {e}" if t is not None else e
                                          for t, e in r["events"])]  # fmt: skip
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--leave-gb", type=float, default=1.5, help="GiB of MemAvailable left")
    ap.add_argument("--hold", type=float, default=40.0)
    ap.add_argument("--after", type=float, default=40.0, help="most s to wait for the regrowth")
    ckpt = Path.home() / ".cache" / "mlx_lm_streaming_bench"
    ap.add_argument("--ckpt-dir", default=os.environ.get("MLX_LM_STREAMING_BENCH_DIR", ckpt))
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--tag", default="memory-pressure")
    ap.add_argument("--decode-child", help=argparse.SUPPRESS)
    ap.add_argument("--stock-child", help=argparse.SUPPRESS)
    ap.add_argument("--stop-file", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--hog-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--pressure-file", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="tiny shape, pressure simulated (CI)")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.hold, args.after = 2, 3.0, 20.0
    if args.decode_child:
        return decode_child(args.decode_child, args.stop_file, False, 0, args.pressure_file)
    if args.stock_child:
        return decode_child(args.stock_child, "", True, args.tokens)
    if args.hog_child is not None:
        return hog_child(args.hog_child, args.hold, args.pressure_file)
    r = run(args)
    out = Path(args.out)
    (out / f"{args.tag}.json").write_text(json.dumps(r, indent=1) + "\n")
    (out / f"{args.tag}.md").write_text(markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
