"""The reports of ``experts.py``: the markdown tables against the targets, the plot, the machine.
What each figure means and how it is computed: docs/benchmarks/methods/experts.md."""

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
    ("prefill (cold) vs max(stock prefill, reading each expert once)", "prefill_cold_vs_limit",
     ">= 0.75"),
    ("peak RSS (cold) vs resident weights + cache budget", "rss_cold_over_budget", "<= +15%"),
]


def fmt(v, pct=False):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if pct:
        return f"{v:+.0%}"
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def _spread(res):
    """min-max over rounds of the paired decode ratios, and the ratio of each configuration's
    fastest round (on a shared machine other load only slows a round down), as text."""
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


def cold_lines(res):
    """The cold configuration's rows replayed offline beside its hit rate, its limit, the GB/s its
    reads achieved beside the disk probe's best, its lookahead's precision and recall."""
    rp, cold, r = res.get("replay"), res["decode"].get("cold"), res["ratios"]
    if not rp or not cold:
        return []
    slots = "/".join(map(str, sorted(set(rp["slots"]))))
    p = cold.get("prefetch") or {}
    ahead = (f" Lookahead: precision {fmt(p.get('lookahead_precision'))}, recall "
             f"{fmt(p.get('lookahead_recall'))}." if p else "")  # fmt: skip
    return [
        "",
        f"Cold, replayed ({rp['rows_decode']} measured rows per layer after {rp['rows_warm']} "
        f"warm-up rows, {slots} slots of {rp['num_experts']} experts, top {rp['top_k']}): hit rate "
        f"{_pct(cold['hit_rate'])}; its policy {_pct(rp['policy_hit_rate'])} ({rp['policy']}), "
        f"LRU {_pct(rp['lru_hit_rate'])}, Belady {_pct(rp['belady_hit_rate'])}, slots / experts "
        f"{_pct(rp['random_hit_rate'])}. Limit {r['cold_limit_tok_s']:.2f} tok/s, cold / limit "
        f"{r['cold_vs_limit_totals']:.3f} from the totals. Read GB/s: "
        f"{_gbps(cold.get('read_gbps_in_flight'))} in flight "
        f"({_gbps(cold.get('read_gbps_store_seconds'))} over the store's read seconds, "
        f"{_gbps(cold.get('read_gbps_io_wait'))} over the I/O wait); probe best "
        f"{res['disk_best_gbps']:.2f}.{ahead}",
    ]


def markdown(report):
    lines = [f"# Expert streaming benchmark: {report['tag']}", ""]
    m = report["machine"]
    lines += [f"Machine: {m['summary']}. Command: `{report['command']}`. {report['when']}.", ""]
    for res in report["archs"]:
        r = res["ratios"]
        lines += [
            f"## {res['label']} experts ({res['layers']} layers, {res['experts']} experts of "
            f"{res['expert_bytes'] / MB:.2f} MB, {res['total_expert_bytes'] / GB:.2f} GB of experts"
            f"; routing: {res['routing']})",
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
        lines += [
            "",
            "| configuration | tok/s | vs stock (paired) | hit rate | MB read / token | "
            "I/O wait ms / token | install ms / token | bit-exact logits |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for key, d in res["decode"].items():
            hr = d["hit_rate"]
            paired = fmt(r.get(f"{key}_vs_stock")) if key != "stock" else "1"
            lines.append(
                f"| {key} | {d['tok_s']:.2f} | {paired} | "
                f"{'' if hr is None else f'{hr:.1%}'} | {d['bytes_per_token'] / MB:.1f} | "
                f"{d['io_wait_s_per_token'] * 1e3:.0f} | {d['install_s_per_token'] * 1e3:.0f} | "
                f"{res['same_tokens'].get(key, 'n/a')} |"
            )
        lines += cold_lines(res)
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
                want = want if k != "stock" else res["checkpoint_bytes"]
                net = v["peak_rss"] - v["rss_after_imports"]
                peak = v["peak_rss"] / GB
                lines.append(f"| {k} | {peak:.2f} | {net / GB:.2f} | {want / GB:.2f} |")
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
        colors = ["#555" if k == "stock" else "#2a7" if k.startswith(("warm", "cold")) else "#c53"
                  for k in keys]
        ax.bar(range(len(keys)), vals, color=colors)
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
        title = f"{res['label']} ({res['layers']} layers, {report['device']}, {res['routing']})"
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def machine(device):
    import mlx.core as mx

    info = dict(platform=platform.platform(), cpus=os.cpu_count(), python=platform.python_version())
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
            query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
            info["gpu"] = subprocess.run(query, capture_output=True, text=True).stdout.strip()
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


def render(src: Path) -> str:
    """``experts.py --render FILE.json``: the .md and .png of a results JSON again, next to it."""
    report = json.loads(src.read_text())
    src.with_suffix(".md").write_text(markdown(report))
    note = plot(report, src.with_suffix(".png"))
    return note or f"wrote {src.with_suffix('.md')} and {src.with_suffix('.png')}"
