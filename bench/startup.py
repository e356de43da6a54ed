"""What the startup hook costs an interpreter that never imports mlx_lm.

Runs ``python -c pass`` many times with the hook on and with it off (``MLX_LM_STREAMING_HOOK=0``
makes the .pth line skip the import), interleaved, and prints the difference of the fastest runs (the least disturbed by other load on
a shared machine; medians moved by several ms on a loaded box). It
also prints the hook's own import time from ``python -X importtime`` and checks that start-up
imports nothing of mlx or mlx_lm.

    python bench/startup.py [--python PATH] [--runs N] [--check]
    python bench/startup.py --quick     # 2 runs per setting: what it finds, not a timing

``--check`` exits 1 when the extra start-up time is 5 ms or more (by either measure), or when mlx
is imported at start-up. The interpreter must have mlx-lm-streaming installed (not editable).
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

LIMIT_MS = 5.0
HOOK_ENV = "MLX_LM_STREAMING_HOOK"


def environ(hook: bool) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env[HOOK_ENV] = "1" if hook else "0"
    return env


def hook_file(python: str) -> str:
    """The installed ``mlx_lm_streaming.pth`` of ``python``, or exit saying it is missing."""
    code = (
        "import os, site, sys\n"
        "dirs = site.getsitepackages() + [site.getusersitepackages()]\n"
        "hits = [os.path.join(d, 'mlx_lm_streaming.pth') for d in dirs]\n"
        "print(next((h for h in hits if os.path.isfile(h)), ''))"
    )
    out = subprocess.run(
        [python, "-c", code], env=environ(False), capture_output=True, text=True
    )
    path = out.stdout.strip()
    if out.returncode or not path:
        sys.exit(
            f"{python}: mlx_lm_streaming.pth is not in its site-packages; install the package "
            "(pip install ., not editable) first"
        )
    return path


def wall_ms(python: str, runs: int) -> tuple:
    """Fastest wall time of ``python -c pass`` with the hook on and off, in ms."""
    times = {True: [], False: []}
    for _ in range(3):  # warm the page cache
        for hook in times:
            subprocess.run([python, "-c", "pass"], env=environ(hook), check=True)
    for _ in range(runs):
        for hook in times:
            start = time.perf_counter()
            subprocess.run([python, "-c", "pass"], env=environ(hook), check=True)
            times[hook].append((time.perf_counter() - start) * 1e3)
    return min(times[True]), min(times[False])


def importtime_ms(python: str, runs: int) -> float:
    """Median of the cumulative import time of our start-up modules (``-X importtime``)."""
    totals = []
    for _ in range(runs):
        out = subprocess.run(
            [python, "-X", "importtime", "-c", "pass"],
            env=environ(True),
            capture_output=True,
            text=True,
            check=True,
        )
        total = 0
        for line in out.stderr.splitlines():
            # "import time: self [us] | cumulative | imported package"
            parts = [p.strip() for p in line.split("|")]
            if len(parts) == 3 and parts[2] == "mlx_lm_streaming._bootstrap":
                total += int(parts[1])
            elif len(parts) == 3 and parts[2] == "mlx_lm_streaming":
                total += int(parts[0].rsplit(" ", 1)[-1])
        totals.append(total / 1e3)
    return statistics.median(totals)


def imported_at_startup(python: str) -> list:
    code = (
        "import sys; print(' '.join(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('mlx', 'mlx_lm'))))"
    )
    out = subprocess.run(
        [python, "-c", code], env=environ(True), capture_output=True, text=True
    )
    return out.stdout.split()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--python", default=sys.executable, help="interpreter to measure"
    )
    parser.add_argument("--runs", type=int, default=40, help="runs per setting")
    parser.add_argument("--quick", action="store_true", help="2 runs per setting")
    parser.add_argument(
        "--check", action="store_true", help=f"exit 1 at >= {LIMIT_MS} ms"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.runs = 2

    pth = hook_file(args.python)
    on, off = wall_ms(args.python, args.runs)
    own = importtime_ms(args.python, max(5, args.runs // 4))
    leaked = imported_at_startup(args.python)
    extra = on - off
    print(f"hook: {pth}")
    print(
        f"python -c pass: {on:.2f} ms with the hook, {off:.2f} ms without "
        f"(fastest of {args.runs}): {extra:+.2f} ms"
    )
    print(f"hook import time (-X importtime): {own:.3f} ms")
    print(f"mlx modules imported at start-up: {' '.join(leaked) or 'none'}")
    print(f"startup overhead: {max(extra, own):.2f} ms (limit {LIMIT_MS:.0f} ms)")
    if args.check and (extra >= LIMIT_MS or own >= LIMIT_MS or leaked):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
