"""Streaming decode on 1 rank vs 2 pipeline ranks (mlx.launch, ring backend, this machine).

    python bench/distributed.py [--model PATH] [--expert-cache-gb GB] [--max-tokens N] [--warm]
    python bench/distributed.py --quick     # seconds: a tiny checkpoint, 2 tokens, no stock runs

Every run is ``mlx_lm_streaming.pipeline_generate`` with ``--streaming-experts --stats-json``; the 2-rank
runs go through ``mlx.launch -n 2 --backend ring`` on 127.0.0.1. Three configurations:

- 1 rank, budget B: the whole model in one process;
- 2 ranks, budget B per rank (2B in all): rank 1 runs the first half of the layers, rank 0 the rest;
- 1 rank, budget 2B: the same total cache as the 2 ranks;

and, unless ``--no-stock``, the stock resident model (no streaming) on 1 and 2 ranks, which shows what
the pipeline itself costs here.

Reported: decode tok/s and prompt tok/s (rank 0, from ``stream_generate``), the generated text's
equality across runs, and per rank its layers, slots per layer, hit rate, misses (experts read when a
layer needed them), experts staged (read ahead of time by the prefetcher, where there is one), GB read
and seconds in I/O.

Without ``--model``, a Qwen3-30B-A3B-shaped checkpoint (hidden 2048, 128 experts of 768, top 8,
affine 4-bit, float32 scales) with 4 layers is built once under /tmp (1.5 GB). Unless ``--warm``,
the checkpoint is dropped from the page cache before each run (``posix_fadvise(DONTNEED)``), so the
expert reads come from the disk.

Both ranks run on this machine and share its CPU cores (2 on the development box): the 2-rank
figures show what pipeline parallelism costs and what each rank reads, not what two machines give.
The interpreter must have mlx-lm-streaming installed (``pip install .``).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ARCHS, GB, drop_page_cache, shards  # noqa: E402 (stdlib only at import)

QWEN3_30B_SHAPE = ARCHS["qwen3"]["overrides"]
PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle."
)


def default_checkpoint(quick: bool = False) -> Path:
    """Built once under /tmp: the Qwen3-30B-A3B shape, or with ``quick`` a tiny one (same layout)."""
    name = "tiny_4l" if quick else "qwen3_30b_4l"
    path = Path(tempfile.gettempdir()) / f"mlx_lm_streaming_bench_{name}"
    if not (path / "config.json").is_file():
        from synthetic import build_checkpoint

        print(f"building {path} (once) ...", file=sys.stderr, flush=True)
        build_checkpoint(
            path,
            "qwen3_moe",
            "affine4",
            num_layers=4,
            shards=4,
            overrides=None if quick else QWEN3_30B_SHAPE,
        )
    return path


def free_port_pair() -> int:
    while True:
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
        try:
            with socket.socket() as b:
                b.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue


def run(python: str, model: Path, ranks: int, budget_gb, args, workdir: Path) -> dict:
    """One generation (``budget_gb=None``: stock, no streaming); reports per rank and wall time."""
    stats = workdir / f"n{ranks}-b{budget_gb}-rank{{rank}}.json"
    command = [
        "-m",
        "mlx_lm_streaming.pipeline_generate",
        "--model",
        str(model),
        "--prompt",
        PROMPT,
        "--max-tokens",
        str(args.max_tokens),
        "--stats-json",
        str(stats),
    ]
    if budget_gb is not None:
        command += ["--streaming-experts", "--expert-cache-gb", repr(budget_gb)]
    if args.device is not None:
        command += ["--device", args.device]
    if ranks == 1:
        cmd = [python, *command]
    else:
        launch = [str(Path(python).parent / "mlx.launch")]
        if not Path(
            launch[0]
        ).is_file():  # mlx installed with --target: no console script
            launch = [
                python,
                "-c",
                "from mlx._distributed_utils.launch import main; main()",
            ]
        cmd = [*launch, "-n", str(ranks), "--backend", "ring"]
        cmd += [
            "--starting-port",
            str(free_port_pair()),
            "--python",
            python,
            "--",
            *command,
        ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_LM_STREAMING_")}
    if not args.warm:
        drop_page_cache(shards(model))
    start = time.perf_counter()
    # stdin stays an open pipe: at EOF, mlx.launch's input loop spins a core
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = proc.communicate(timeout=args.timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    wall = time.perf_counter() - start
    reports = {}
    for rank in range(ranks):
        f = Path(str(stats).replace("{rank}", str(rank)))
        if not f.is_file():
            sys.exit(f"rank {rank} wrote no report:\n{out.decode()}\n{err.decode()}")
        reports[rank] = json.loads(f.read_text())
    return {"ranks": ranks, "budget_gb": budget_gb, "wall_s": wall, "reports": reports}


def summarize(result: dict) -> list:
    rows = []
    r0 = result["reports"][0]
    for rank, r in sorted(result["reports"].items()):
        rows.append(
            {
                "ranks": result["ranks"],
                "budget_gb_per_rank": result["budget_gb"],
                "rank": rank,
                "layers": f"{r['layers'][0]}-{r['layers'][1] - 1}",
                "slots": sorted(set(r.get("slots", {}).values())),
                "decode_tok_s": r0["generation_tps"],
                "prompt_tok_s": r0["prompt_tps"],
                "hit_rate": r.get("hit_rate"),
                "experts_read": r.get("experts_read"),
                # read ahead by the prefetcher (used later, or dropped)
                "experts_staged": (
                    sum(r["staged_experts"].values()) if "staged_experts" in r else None
                ),
                "gb_read": r.get("gb_read"),
                "io_s": r.get("io_seconds"),
                "wall_s": result["wall_s"],
            }
        )
    return rows


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, help="Checkpoint (default: built once under /tmp)"
    )
    parser.add_argument(
        "--expert-cache-gb",
        type=float,
        default=0.25,
        help="Budget B per rank in GB (default 0.25: 21 of 128 experts a layer on 1 rank of the "
        "default checkpoint)",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--warm", action="store_true", help="Keep the page cache between runs"
    )
    parser.add_argument(
        "--no-stock", action="store_true", help="Skip the stock resident runs"
    )
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument(
        "--device", choices=("cpu", "gpu"), help="MLX device of every rank"
    )
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path, help="Also write the rows here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="A tiny checkpoint (unless --model), 2 tokens, 2 slots a layer, no stock runs: the "
        "script's every step in seconds",
    )
    args = parser.parse_args()
    if args.quick:
        args.max_tokens, args.no_stock = 2, True
        if args.model is None:
            args.expert_cache_gb = 0.00004  # 1-3 of the tiny checkpoint's 8 experts a layer

    model = args.model or default_checkpoint(args.quick)
    b = args.expert_cache_gb
    rows, texts = [], set()
    with tempfile.TemporaryDirectory() as tmp:
        configs = [(1, b), (2, b), (1, 2 * b)]
        if not args.no_stock:
            configs += [(1, None), (2, None)]
        for ranks, budget in configs:
            result = run(args.python, model, ranks, budget, args, Path(tmp))
            texts.update(r["text"] for r in result["reports"].values())
            rows.extend(summarize(result))
            what = "stock" if budget is None else f"{budget:g} GB per rank"
            print(f"done: {ranks} rank(s), {what}", file=sys.stderr, flush=True)

    print(
        f"model: {model}  tokens: {args.max_tokens}  cpu cores: {os.cpu_count()}  "
        f"device: {args.device or 'default'}  "
        f"page cache: {'warm' if args.warm else 'dropped before each run'}"
    )
    print(f"same text in every run and rank: {len(texts) == 1}")
    print(
        "| ranks | GB/rank | rank | layers | slots/layer | decode tok/s | prompt tok/s | hit rate "
        "| misses | staged | GB read | s in I/O |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        budget = (
            "stock"
            if r["budget_gb_per_rank"] is None
            else f"{r['budget_gb_per_rank']:g}"
        )
        print(
            f"| {r['ranks']} | {budget} | {r['rank']} | {r['layers']} "
            f"| {','.join(map(str, r['slots'])) or '-'} | {r['decode_tok_s']:.2f} "
            f"| {r['prompt_tok_s']:.1f} | {fmt(r['hit_rate'], '.1%')} "
            f"| {fmt(r['experts_read'], 'd')} | {fmt(r['experts_staged'], 'd')} "
            f"| {fmt(r['gb_read'], '.3f')} "
            f"| {fmt(r['io_s'], '.2f')} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"rows": rows, "same_text": len(texts) == 1}, indent=1)
        )


if __name__ == "__main__":
    main()
