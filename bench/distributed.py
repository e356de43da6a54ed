"""Streaming decode on 1 rank vs 2 pipeline ranks (mlx.launch, ring backend, this machine).

    python bench/distributed.py [--model PATH] [--expert-cache-gb GB] [--device cpu|gpu]
        [--max-tokens N] [--warm] [--json FILE]
    python bench/distributed.py --quick     # seconds: a tiny checkpoint, 2 tokens, no stock runs

Prints per rank and configuration (budget B on 1 rank, B per rank on 2, 2B on 1, stock on 1 and
2) decode and prompt tok/s, hit rate, misses, staged experts and GB read, and whether every run
made the same text. What is run: docs/benchmarks/methods.md (distributed.py); figures:
docs/distributed.md. Needs mlx-lm-streaming installed (``pip install .``).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import ARCHS, drop_page_cache, shards  # (stdlib only at import)

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
# mlx.launch's own entry point (an mlx installed with pip --target has no console script)
LAUNCH = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"
TIMEOUT_S = 600


def default_checkpoint(quick: bool) -> Path:
    """Built once under /tmp: the Qwen3-30B-A3B shape, or with ``quick`` a tiny one."""
    name = "tiny_4l" if quick else "qwen3_30b_4l"
    path = Path(tempfile.gettempdir()) / f"mlx_lm_streaming_bench_{name}"
    if not (path / "config.json").is_file():
        from synthetic import build_checkpoint

        print(f"building {path} (once) ...", file=sys.stderr, flush=True)
        overrides = None if quick else ARCHS["qwen3"]["overrides"]
        build_checkpoint(path, "qwen3_moe", "affine4", num_layers=4, shards=4, overrides=overrides)
    return path


def free_port_pair() -> int:
    """A free port whose next one is free too (the ring backend takes one a rank)."""
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            try:
                b.bind(("127.0.0.1", a.getsockname()[1] + 1))
                return a.getsockname()[1]
            except OSError:
                continue


def run(model: Path, ranks: int, budget_gb, args, workdir: Path) -> dict:
    """One generation (``budget_gb=None``: stock, no streaming): each rank's report, wall time."""
    stats = workdir / f"n{ranks}-b{budget_gb}-rank{{rank}}.json"
    command = ["-m", "mlx_lm_streaming.pipeline_generate", "--stats-json", str(stats)]
    command += ["--model", str(model), "--prompt", PROMPT, "--max-tokens", str(args.max_tokens)]
    if budget_gb is not None:
        command += ["--streaming-experts", "--expert-cache-gb", repr(budget_gb)]
    if args.device is not None:
        command += ["--device", args.device]
    python = sys.executable
    cmd = [python, *command]
    if ranks > 1:
        cmd = [python, "-c", LAUNCH, "-n", str(ranks), "--backend", "ring"]
        cmd += ["--starting-port", str(free_port_pair()), "--python", python, "--", *command]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_LM_STREAMING_")}
    if not args.warm:
        drop_page_cache(shards(model))
    start = time.perf_counter()
    # stdin stays an open pipe: at EOF, mlx.launch's input loop spins a core
    pipe = subprocess.PIPE
    with subprocess.Popen(cmd, env=env, stdin=pipe, stdout=pipe, stderr=pipe) as proc:
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        finally:
            proc.kill()
    wall = time.perf_counter() - start
    reports = {}
    for rank in range(ranks):
        f = Path(str(stats).replace("{rank}", str(rank)))
        if not f.is_file():
            sys.exit(f"rank {rank} wrote no report:\n{out.decode()}\n{err.decode()}")
        reports[rank] = json.loads(f.read_text())
    return {"ranks": ranks, "budget_gb": budget_gb, "wall_s": wall, "reports": reports}


def rows_of(result: dict) -> list:
    """One row a rank; the tok/s are rank 0's (``stream_generate``'s)."""
    r0 = result["reports"][0]
    return [
        dict(
            ranks=result["ranks"], budget_gb_per_rank=result["budget_gb"], rank=rank,
            layers=f"{r['layers'][0]}-{r['layers'][1] - 1}",
            slots=sorted(set(r.get("slots", {}).values())), decode_tok_s=r0["generation_tps"],
            prompt_tok_s=r0["prompt_tps"], hit_rate=r.get("hit_rate"),
            experts_read=r.get("experts_read"),
            # read ahead by the prefetcher (used later, or dropped)
            experts_staged=sum(r["staged_experts"].values()) if "staged_experts" in r else None,
            gb_read=r.get("gb_read"), io_s=r.get("io_seconds"), wall_s=result["wall_s"],
        )
        for rank, r in sorted(result["reports"].items())
    ]


def table_line(r: dict) -> str:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    budget = "stock" if r["budget_gb_per_rank"] is None else f"{r['budget_gb_per_rank']:g}"
    slots = ",".join(map(str, r["slots"])) or "-"
    return (
        f"| {r['ranks']} | {budget} | {r['rank']} | {r['layers']} | {slots} "
        f"| {r['decode_tok_s']:.2f} | {r['prompt_tok_s']:.1f} | {fmt(r['hit_rate'], '.1%')} "
        f"| {fmt(r['experts_read'], 'd')} | {fmt(r['experts_staged'], 'd')} "
        f"| {fmt(r['gb_read'], '.3f')} | {fmt(r['io_s'], '.2f')} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="checkpoint (default: built once under /tmp)")
    budget_help = "budget B per rank in GB (0.25: 21 of the default's 128 experts a layer, 1 rank)"
    parser.add_argument("--expert-cache-gb", type=float, default=0.25, help=budget_help)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--warm", action="store_true", help="keep the page cache between runs")
    parser.add_argument("--device", choices=("cpu", "gpu"), help="MLX device of every rank")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    quick_help = "a tiny checkpoint (unless --model), 2 tokens, 2 slots a layer, no stock runs"
    parser.add_argument("--quick", action="store_true", help=quick_help)
    args = parser.parse_args()
    b = args.expert_cache_gb
    configs = [(1, b), (2, b), (1, 2 * b), (1, None), (2, None)]
    if args.quick:
        args.max_tokens = 2
        if args.model is None:
            b = 0.00004  # 1-3 of the tiny checkpoint's 8 experts a layer
        configs = [(1, b), (2, b), (1, 2 * b)]
    model = args.model or default_checkpoint(args.quick)
    rows, texts = [], set()
    with tempfile.TemporaryDirectory() as tmp:
        for ranks, budget in configs:
            result = run(model, ranks, budget, args, Path(tmp))
            texts.update(r["text"] for r in result["reports"].values())
            rows.extend(rows_of(result))
            what = "stock" if budget is None else f"{budget:g} GB per rank"
            print(f"done: {ranks} rank(s), {what}", file=sys.stderr, flush=True)

    cache = "warm" if args.warm else "dropped before each run"
    print(f"model: {model}  tokens: {args.max_tokens}  cpu cores: {os.cpu_count()}  "
          f"device: {args.device or 'default'}  page cache: {cache}")
    print(f"same text in every run and rank: {len(texts) == 1}")
    print(
        "| ranks | GB/rank | rank | layers | slots/layer | decode tok/s | prompt tok/s | hit rate "
        "| misses | staged | GB read | s in I/O |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(table_line(r))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "same_text": len(texts) == 1}, indent=1))


if __name__ == "__main__":
    main()
