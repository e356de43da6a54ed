"""Peak RSS of expert streaming against stock mlx-lm: does memory stay within weights + budget?

    python bench/memory.py [--quick] [--device-kind cpu|gpu] [--archs qwen3,mixtral,dsv2]
        [--prefill-tokens N] [--ckpt-dir DIR] [--out DIR] [--tag NAME]

Per shape (``harness.ARCHS``; ``--quick``: the tiny one) the peak RSS of stock, of a streaming
model whose budget holds every expert (``full``) and of one at 25% of the expert bytes (``cold``),
each in a process of its own, against its weights + budget; writes ``<out>/<tag>.json`` and
``.md``. RSS is host memory: on CUDA the weights and the banks are the GPU's, so the figure there
is the host side only. What is measured and how: docs/benchmarks/methods.md (memory.py).
"""

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

from harness import (
    ARCHS, BUDGET_GB, GB, checkpoint, common_arguments, drop_page_cache,
    expert_sizes, load_stock, load_streaming, log, machine, shards, use_device,
)  # fmt: skip

from mlx_lm_streaming.tools.parity import vocab_size

COLD_SHARE = 0.25
REAL_SHAPES = ["qwen3", "mixtral", "dsv2"]  # the default --archs (not "tiny")


def peak_rss() -> int:
    """This process's peak RSS in bytes (VmHWM: ru_maxrss counts the parent's, kept over exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_child(path, which, budget_gb, prefill_tokens, decode_tokens=8):
    """``--rss-child``: load one configuration, prefill and decode, print its peak RSS as JSON."""
    import mlx.core as mx
    import mlx_lm.utils  # noqa: F401  (imports are the interpreter's, not the model's memory)
    from mlx_lm.generate import generate_step

    import routing_replay

    from mlx_lm_streaming.integration.integration import install

    install()
    routing_replay.unwind_on_rewind()  # verified steps that run a forward again
    base = peak_rss()
    out = {"which": which, "budget": 0, "resident_bytes": None}
    if which == "stock":
        model, config = load_stock(path)
    else:
        drop_page_cache(shards(path))
        model, config = load_streaming(path, expert_cache_gb=budget_gb)
        cache = model.expert_streaming.cache
        cache.ensure_planned()
        out["budget"] = cache.resident_bytes
        out["resident_bytes"] = model.expert_streaming.resident_bytes
    vocab = vocab_size(config)
    rng = random.Random(1)
    tokens = mx.array([rng.randrange(vocab) for _ in range(prefill_tokens)])
    routing = routing_replay.ForcedRouting(routing_replay._expert_counts(model)[0])
    routing_replay.wrap(model, routing)
    for _ in generate_step(tokens, model, max_tokens=decode_tokens):
        pass
    out.update(peak_rss=peak_rss(), rss_after_imports=base, mlx_peak=mx.get_peak_memory())
    if which != "stock":
        out["staging_limit"] = model.expert_streaming.cache.prefetcher.max_bytes
    print("RSS_JSON " + json.dumps(out), flush=True)


def measure_rss(path, res, tokens, device_kind):
    """Peak RSS of stock, full and cold, each in a process of its own (``rss_child``), and each
    one's over its weights + budget (stock: the checkpoint's bytes)."""
    out = {}
    total = res["total_expert_bytes"] / BUDGET_GB
    for which, gb in (("stock", 0), ("full", total * 1.001), ("cold", total * COLD_SHARE)):
        cmd = [
            sys.executable, __file__, "--rss-child", which, "--rss-path", str(path), "--rss-gb",
            repr(gb), "--rss-prefill", str(tokens), "--device-kind", device_kind,
        ]  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True)
        line = [l for l in p.stdout.splitlines() if l.startswith("RSS_JSON ")]
        if p.returncode or not line:
            log(f"rss child {which} failed: {p.stderr[-2000:]}")
            continue
        r = out[which] = json.loads(line[-1][len("RSS_JSON ") :])
        want = res["checkpoint_bytes"] if which == "stock" else r["resident_bytes"] + r["budget"]
        r["weights_and_budget"] = want
        r["over_weights_and_budget"] = (r["peak_rss"] - r["rss_after_imports"]) / want - 1
        log(f"rss {which}: {r['peak_rss'] / GB:.2f} GB")
    if "cold" in out:
        res["rss_cold_over_budget"] = out["cold"]["over_weights_and_budget"]
    return out


def rss_figures(args, dtype: str) -> None:
    """``measure_rss`` per shape of ``--archs``; the report after each shape (a run cut
    short keeps the shapes done)."""
    archs = args.archs.split(",") if args.archs else (["tiny"] if args.quick else REAL_SHAPES)
    tag = args.tag or f"rss-{args.device_kind}{'-quick' if args.quick else ''}"
    tokens = int(args.prefill_tokens or (512 if args.device_kind == "gpu" else 64))
    report = dict(
        tag=tag, device=args.device_kind,
        command=" ".join(["python", "bench/memory.py"] + sys.argv[1:]),
        when=time.strftime("%Y-%m-%d %H:%M"), machine=machine(args.device_kind),
        prefill_tokens=tokens, archs=[],
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in archs:
        path = checkpoint(Path(args.ckpt_dir), name, dtype)
        spec = ARCHS[name]
        res = {"arch": name, "label": spec["label"], "layers": spec["layers"], "path": str(path)}
        ckpt_bytes = sum(os.path.getsize(f) for f in shards(path))
        res.update(expert_sizes(path), checkpoint_bytes=ckpt_bytes)
        res["rss"] = measure_rss(path, res, tokens, args.device_kind)
        report["archs"].append(res)
        (out / f"{tag}.json").write_text(json.dumps(report, indent=1, default=str))
        (out / f"{tag}.md").write_text(rss_table(report))
    print(rss_table(report))
    print(f"wrote {out / tag}.json")


def rss_table(report) -> str:
    """``rss_figures``'s report as markdown: one row per shape and configuration."""
    lines = [
        f"# Peak RSS: {report['tag']}",
        "",
        f"Machine: {report['machine']['summary']}. Command: `{report['command']}`. "
        f"{report['when']}. Each configuration in a process of its own: loaded, "
        f"{report['prefill_tokens']} tokens prefilled, 8 decoded.",
        "",
        "| shape (layers) | configuration | peak RSS GB | net of interpreter GB "
        "| weights + budget GB | net over weights + budget |",
        "|---|---|---|---|---|---|",
    ]
    for res in report["archs"]:
        for key, r in res["rss"].items():
            net = r["peak_rss"] - r["rss_after_imports"]
            lines.append(
                f"| {res['label']} ({res['layers']}) | {key} | {r['peak_rss'] / GB:.2f} "
                f"| {net / GB:.2f} | {r['weights_and_budget'] / GB:.2f} "
                f"| {r['over_weights_and_budget']:+.0%} |"
            )
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(ap, "comma-separated of " + ",".join(ARCHS))
    ap.add_argument("--prefill-tokens", type=int, default=None,
                    help="the prompt's tokens (default 64 on the CPU, 512 on a GPU)")
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rss-path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rss-gb", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--rss-prefill", type=int, default=64, help=argparse.SUPPRESS)
    args = ap.parse_args()
    dtype = use_device(args.device_kind)
    if args.rss_child:
        return rss_child(Path(args.rss_path), args.rss_child, args.rss_gb, args.rss_prefill)
    return rss_figures(args, dtype)


if __name__ == "__main__":
    main()
