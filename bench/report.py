"""The reports of ``experts.py``: the markdown tables against the targets, the plot, the machine."""

import json
import math
import os
import platform
import subprocess
from pathlib import Path

from harness import GB, MB, log

TARGETS = [
    ("warm decode vs stock resident", "warm_vs_stock", ">= 0.95 (GPU: >= 0.9)"),
    ("cold decode vs max(stock compute, miss bytes / disk bandwidth)", "cold_vs_limit", ">= 0.87"),
    (
        "prefill (cold) vs max(stock prefill, reading each expert once)",
        "prefill_cold_vs_limit",
        ">= 0.75",
    ),
    ("peak RSS (cold) vs resident weights + cache budget", "rss_cold_over_budget", "<= +15%"),
]


def fmt(v, pct=False):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if pct:
        return f"{v:+.0%}"
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def _spread(res):
    """min-max over rounds of the paired decode ratios, and the ratio of each configuration's fastest
    round (on a shared machine other load only slows a round down), as text."""
    rounds = res.get("rounds") or []
    out = {}

    def span(vals):
        return f"rounds {min(vals):.2f}-{max(vals):.2f}" if vals else None

    def best(key):
        return min(r[key] for r in rounds)

    if rounds and "stock_again" in rounds[0]:
        out["stock_again_vs_stock"] = span([r["stock"] / r["stock_again"] for r in rounds])
    if rounds and "warm" in rounds[0]:
        out["warm_vs_stock"] = span([r["stock"] / r["warm"] for r in rounds])
        out["warm_vs_stock"] += f"; fastest rounds {best('stock') / best('warm'):.2f}"
    dec = res.get("decode", {})
    if rounds and "cold" in rounds[0] and "cold" in dec:
        io = dec["cold"]["miss_bytes_per_token"] / (res["disk_best_gbps"] * GB)
        out["cold_vs_limit"] = span([max(r["stock"], io) / r["cold"] for r in rounds])
        out["cold_vs_limit"] += f"; fastest rounds {max(best('stock'), io) / best('cold'):.2f}"
    return {k: v for k, v in out.items() if v}


def _pct(v):
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1%}"


def _gbps(v):
    return "n/a" if v is None else f"{v:.2f}"


def routing_summary(report):
    """Per shape, one row per routing: the cold configuration's hit rate beside the replay's LRU and
    Belady at the same slots, tok/s against the limit, and the GB/s its reads achieved beside the
    disk probe's best (runs with ``res["replay"]``, written since 2026-12-01)."""
    runs = [res for res in report["archs"] if "replay" in res and "cold" in res["decode"]]
    if not runs:
        return []
    lines = [
        "## Cold decode by shape and routing",
        "",
        "`cold`: budget 25% of the expert bytes, page cache dropped before every decode step. Hit "
        "rate: the cold configuration's own (cache stats, measured steps). Beside it, its very rows "
        "(the ids its layers were called with, recorded from its cold start: the short prompt's "
        "rows and the warm-up steps warm the tables and are not counted, then every measured step) "
        "replayed through `mlx_lm_streaming.tools.replay` with its slots per layer: the cache's own "
        "policy, LRU, Belady (offline optimum), and slots / experts (what random choices hit). The "
        "replay takes a prompt row by row where the model took it in one call. Limit tok/s = 1 / "
        "max(stock s per token, miss bytes per token / probe best GB/s), from the run's totals; "
        "cold / limit = cold tok/s / limit tok/s (the paired median of per-round ratios in "
        "brackets). Read GB/s (GB = 2^30): bytes the store read over the wall time at least one "
        "read was in flight (union of the reads' spans); in brackets over the store's own read "
        "seconds (`store.stats.seconds`, summed over reads that overlap on its threads) and over "
        "the calling thread's I/O wait (`cache.stats.io_wait_seconds`).",
        "",
    ]
    by_shape = {}
    for res in runs:
        by_shape.setdefault(res["label"], []).append(res)
    for label, group in by_shape.items():
        lines += [
            f"### {label}",
            "",
            "| routing | layers x experts, top-k, slots | hit rate | replay: own policy | LRU | "
            "Belady | slots / experts | cold tok/s | stock tok/s | limit tok/s | cold / limit | "
            "MB read / token | read GB/s in flight (store s; I/O wait) | probe best GB/s | "
            "bit-exact logits |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for res in group:
            rp, d, r = res["replay"], res["decode"], res["ratios"]
            slots = sorted(set(rp["slots"]))
            exact = res["same_tokens"]
            bad = [k for k, v in exact.items() if not v]
            lines.append(
                f"| {res.get('routing_label', res['routing'])} | {res['layers']} x "
                f"{res['experts']}, top {rp['top_k']}, {'/'.join(map(str, slots))} | "
                f"{_pct(d['cold']['hit_rate'])} | {_pct(rp['policy_hit_rate'])} "
                f"({rp['policy']}) | {_pct(rp['lru_hit_rate'])} | {_pct(rp['belady_hit_rate'])} | "
                f"{_pct(rp['random_hit_rate'])} | {d['cold']['tok_s']:.2f} | "
                f"{d['stock']['tok_s']:.2f} | {r['cold_limit_tok_s']:.2f} | "
                f"{r['cold_vs_limit_totals']:.3f} ({fmt(r['cold_vs_limit'])}) | "
                f"{d['cold']['bytes_per_token'] / MB:.1f} | "
                f"{_gbps(d['cold'].get('read_gbps_in_flight'))} "
                f"({_gbps(d['cold'].get('read_gbps_store_seconds'))}; "
                f"{_gbps(d['cold'].get('read_gbps_io_wait'))}) | {res['disk_best_gbps']:.2f} | "
                f"{'all (' + ', '.join(exact) + ')' if not bad else 'NOT ' + ', '.join(bad)} |"
            )
        lines.append("")
        for res in group:
            rp = res["replay"]
            lines.append(
                f"- {res.get('routing_label', res['routing'])}: {rp['rows_decode']} measured rows "
                f"per layer replayed after {rp['rows_warm']} warm-up rows; "
                f"{res['decode']['cold']['tokens']} cold decode steps timed."
            )
        lines.append("")
    return lines


def markdown(report):
    lines = [f"# Expert streaming benchmark: {report['tag']}", ""]
    m = report["machine"]
    lines += [f"Machine: {m['summary']}. Command: `{report['command']}`. {report['when']}.", ""]
    lines += routing_summary(report)
    for res in report["archs"]:
        r = res["ratios"]
        routing = res.get("routing_label") or res.get("routing")
        lines += [
            f"## {res['label']} experts ({res['layers']} layers, {res['experts']} experts of "
            f"{res['expert_bytes'] / MB:.2f} MB, {res['total_expert_bytes'] / GB:.2f} GB of experts"
            + (f"; routing: {routing}" if routing and "routing_label" in res else "")
            + ")",
            "",
            "| target | measured | goal |",
            "|---|---|---|",
        ]
        spread = _spread(res)
        for label, key, goal in TARGETS:
            extra = f" ({spread[key]})" if key in spread else ""
            lines.append(
                f"| {label} | {fmt(r.get(key), pct=key.startswith('rss'))}{extra} | {goal} |"
            )
        for seed in ("seed_loop", "seed_stack"):  # runs from before bench/seeds.py was removed
            if f"cold_vs_{seed}" in r:
                lines.append(f"| cold decode vs {seed} (same budget, same disk) | "
                             f"{fmt(r[f'cold_vs_{seed}'])} | > 1 |")
        lines += [
            "",
            "| configuration | tok/s | vs stock (paired) | hit rate | MB read / token | "
            "I/O wait ms / token | install ms / token | "
            + ("bit-exact logits |" if report.get("exact_check") else "same greedy argmax |"),
            "|---|---|---|---|---|---|---|---|",
        ]
        for key, d in res["decode"].items():
            hr = d["hit_rate"]
            lines.append(
                f"| {key} | {d['tok_s']:.2f} | {fmt(r.get(f'{key}_vs_stock')) if key != 'stock' else '1'} | "
                f"{'' if hr is None else f'{hr:.1%}'} | {d['bytes_per_token'] / MB:.1f} | "
                f"{d['io_wait_s_per_token'] * 1e3:.0f} | {d['install_s_per_token'] * 1e3:.0f} | "
                f"{res['same_tokens'].get(key, 'n/a')} |"
            )
        p = res["decode"].get("cold", {}).get("prefetch") or {}
        if p:
            lines += [
                "",
                f"Lookahead (cold): precision {fmt(p.get('lookahead_precision'))}, recall "
                f"{fmt(p.get('lookahead_recall'))}.",
            ]
        if r.get("stock_again_vs_stock") is not None:
            lines += [
                "",
                f"Noise floor: a second stock model timed like the others (`stock_again`) ran at "
                f"{fmt(r['stock_again_vs_stock'])} of stock ({spread['stock_again_vs_stock']}): "
                f"differences between configurations smaller than its distance from 1 are within "
                f"this run's noise.",
            ]
        lines += ["", f"| prefill {res['prefill_tokens']} tokens | seconds |", "|---|---|"]
        for key, v in res["prefill_s"].items():
            lines.append(f"| {key} | {v:.2f} |")
        lines.append(
            f"| limit: max(stock, experts once / disk) | {fmt(r.get('prefill_limit_s'))} |"
        )
        lines += [
            "",
            "Disk GB/s (reads of one expert, page cache dropped): "
            + ", ".join(f"{k} {fmt(v)}" for k, v in res["disk_gbps"].items()),
        ]
        rss = res.get("rss", {})
        if rss:
            lines += [
                "",
                "| peak RSS | GB | net of interpreter | weights + budget |",
                "|---|---|---|---|",
            ]
            for k, v in rss.items():
                want = (v.get("resident_bytes") or 0) + v.get("budget", 0)
                lines.append(
                    f"| {k} | {v['peak_rss'] / GB:.2f} | {(v['peak_rss'] - v['rss_after_imports']) / GB:.2f} | "
                    f"{want / GB if k != 'stock' else res['checkpoint_bytes'] / GB:.2f} |"
                )
        lines.append("")
    return "\n".join(lines)


def plot(report, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    archs = report["archs"]
    cols = min(len(archs), 3)
    rows = -(-len(archs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(archs) :]:
        ax.set_visible(False)
    for ax, res in zip(axes.flat, archs):
        keys = list(res["decode"])
        vals = [res["decode"][k]["tok_s"] for k in keys]
        ax.bar(
            range(len(keys)),
            vals,
            color=[
                "#555" if k == "stock" else "#2a7" if k.startswith(("warm", "cold")) else "#c53"
                for k in keys
            ],
        )
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels(keys, rotation=45, ha="right", fontsize=8)
        ax.set_yscale("log")
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
        limit = res.get("ratios", {}).get("cold_limit_tok_s")
        if limit and "cold" in keys:
            i = keys.index("cold")
            ax.hlines(limit, i - 0.45, i + 0.45, colors="#000", linestyles="dashed")
            ax.text(i, limit, "limit", ha="center", va="bottom", fontsize=7)
        drawn = vals + ([limit] if limit else [])
        ax.set_ylim(bottom=min(drawn) * 0.5, top=max(drawn) * 1.25)
        ax.set_ylabel("decode tok/s (log scale)")
        routing = res.get("routing", "uniform")
        routing = "trace" if routing.startswith("trace:") else routing
        routing += ", folded" if res.get("routing_fold") else ""
        ax.set_title(
            f"{res['label']} ({res['layers']} layers, {report['device']}, {routing})", fontsize=9
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def machine(device):
    import mlx.core as mx

    info = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        import importlib.metadata as md

        info["mlx"] = md.version("mlx")
        info["mlx_lm"] = md.version("mlx-lm")
    except Exception:
        pass
    try:
        info["ram_gb"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    except (ValueError, OSError):
        pass
    info["device"] = str(mx.default_device())
    if device == "gpu":
        try:
            info["gpu"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
            ).stdout.strip()
        except OSError:
            pass
    info["summary"] = (
        f"{info.get('gpu') or platform.processor() or platform.machine()}, "
        f"{info['cpus']} CPUs, {info.get('ram_gb', 0):.0f} GiB RAM, mlx {info.get('mlx')}, "
        f"mlx-lm {info.get('mlx_lm')}, default device {info['device']}"
    )
    return info


def write(report, out: Path, tag: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps(report, indent=1, default=str))
    (out / f"{tag}.md").write_text(markdown(report))
    note = plot(report, out / f"{tag}.png")
    if note:
        report["plot"] = note
        log(note)


def render(files, out: Path, tag=None) -> str:
    """``experts.py --render``: the .md and .png of a results JSON again, next to it; several JSONs
    merged into ``<out>/<tag>``: one report, every run's sections."""
    report = json.loads(files[0].read_text())
    if len(files) > 1:
        for f in files[1:]:
            more = json.loads(f.read_text())
            report["archs"] += more["archs"]
            report["command"] += f"`; `{more['command']}"
        report["tag"] = tag or report["tag"]
        write(report, out, report["tag"])
        return f"wrote {out}/{report['tag']}.json, .md and .png"
    src = files[0]
    src.with_suffix(".md").write_text(markdown(report))
    note = plot(report, src.with_suffix(".png"))
    return note or f"wrote {src.with_suffix('.md')} and {src.with_suffix('.png')}"
