"""What the startup hook costs an interpreter that never imports mlx_lm.

    python bench/startup.py [--runs N] [--check]
    python bench/startup.py --quick     # 2 runs per setting: what it finds, not a timing

Prints the extra wall time of ``python -c pass`` with the hook on against off, the hook's own
import time and any mlx module imported at start-up; ``--check`` exits 1 at 5 ms or more, or when
mlx is imported. Run it with the interpreter that has mlx-lm-streaming installed (not editable).
How it measures: docs/benchmarks/methods.md (startup.py).
"""

import argparse
import os
import site
import statistics
import subprocess
import sys
import time

LIMIT_MS = 5.0
PYTHON = sys.executable


def python(*args, hook=True, check=True, capture=True):
    """``python ARGS`` with the hook on or off, no PYTHONPATH; its finished process."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MLX_LM_STREAMING_HOOK"] = "1" if hook else "0"
    cmd = [PYTHON, *args]
    return subprocess.run(cmd, env=env, capture_output=capture, text=True, check=check)


def hook_file() -> str:
    """This interpreter's installed ``mlx_lm_streaming.pth``, or exit saying it is missing."""
    for folder in site.getsitepackages() + [site.getusersitepackages()]:
        path = os.path.join(folder, "mlx_lm_streaming.pth")
        if os.path.isfile(path):
            return path
    sys.exit(f"{PYTHON}: no mlx_lm_streaming.pth in site-packages (pip install ., not editable)")


def wall_ms(runs: int) -> tuple:
    """Fastest wall time of ``python -c pass`` with the hook on and off, in ms, interleaved."""
    times = {True: [], False: []}
    for i in range(3 + runs):  # the first 3 warm the page cache
        for hook in times:
            start = time.perf_counter()
            python("-c", "pass", hook=hook, capture=False)
            if i >= 3:
                times[hook].append((time.perf_counter() - start) * 1e3)
    return min(times[True]), min(times[False])


def importtime_ms(runs: int) -> float:
    """Median of the cumulative import time of our start-up modules (``-X importtime``)."""
    totals = []
    for _ in range(runs):
        total = 0
        for line in python("-X", "importtime", "-c", "pass").stderr.splitlines():
            # "import time: self [us] | cumulative | imported package"
            parts = [p.strip() for p in line.split("|")]
            if len(parts) == 3 and parts[2] == "mlx_lm_streaming._bootstrap":
                total += int(parts[1])
            elif len(parts) == 3 and parts[2] == "mlx_lm_streaming":
                total += int(parts[0].rsplit(" ", 1)[-1])
        totals.append(total / 1e3)
    return statistics.median(totals)


def imported_at_startup() -> list:
    """The modules of mlx and mlx_lm that the interpreter has imported at start-up."""
    modules = python("-c", "import sys; print(*sorted(sys.modules))", check=False).stdout.split()
    return [m for m in modules if m.split(".")[0] in ("mlx", "mlx_lm")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40, help="runs per setting")
    parser.add_argument("--quick", action="store_true", help="2 runs per setting")
    parser.add_argument("--check", action="store_true", help=f"exit 1 at >= {LIMIT_MS} ms")
    args = parser.parse_args(argv)
    runs = 2 if args.quick else args.runs

    pth = hook_file()
    on, off = wall_ms(runs)
    own = importtime_ms(max(5, runs // 4))
    leaked = imported_at_startup()
    extra = on - off
    print(f"hook: {pth}")
    print(
        f"python -c pass: {on:.2f} ms with the hook, {off:.2f} ms without "
        f"(fastest of {runs}): {extra:+.2f} ms"
    )
    print(f"hook import time (-X importtime): {own:.3f} ms")
    print(f"mlx modules imported at start-up: {' '.join(leaked) or 'none'}")
    print(f"startup overhead: {max(extra, own):.2f} ms (limit {LIMIT_MS:.0f} ms)")
    return 1 if args.check and (extra >= LIMIT_MS or own >= LIMIT_MS or leaked) else 0


if __name__ == "__main__":
    sys.exit(main())
