"""``mlx_lm_streaming pack CKPT``: repack the routed experts for one aligned read per expert.

The file format, its reader and its writer are in packfile.py; this is the subcommand.
"""

import os
import shlex
import time

from .packfile import PACK_NAME, pack_checkpoint, pack_path


def add_arguments(parser) -> None:
    parser.add_argument("model", help="checkpoint directory (safetensors shards + config.json)")
    parser.add_argument(
        "--out",
        default=None,
        help=f"pack file, or an existing directory to write {PACK_NAME} into (default: "
        f"MODEL/{PACK_NAME}); another disk than the model's spreads the reads over both",
    )
    parser.add_argument("--force", action="store_true", help="write it even if a valid pack exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    start = time.time()
    before = _mtime(pack_path(args.model, args.out))
    out = pack_checkpoint(args.model, args.out, progress=not args.quiet, force=args.force)
    size = os.path.getsize(out)
    if _mtime(out) == before:
        done = "kept: it matches the checkpoint (--force writes it again)"
    else:
        done = f"written in {time.time() - start:.1f} s"
    print(f"{out}: {_decimal(size)} (a second copy of the experts), {done}")
    print(f"use it with: {use_command(args.model, out)}")
    return 0


def use_command(model, pack) -> str:
    """The ``mlx_lm.generate`` command line that streams ``model``'s experts from ``pack``."""
    words = ["mlx_lm.generate", "--model", os.path.abspath(model), "--streaming-experts"]
    words += ["--expert-store", "packed"]
    if os.path.abspath(pack) != os.path.abspath(pack_path(model)):
        words += ["--expert-pack", os.path.abspath(pack)]
    return shlex.join(words)


def _decimal(nbytes: int) -> str:
    return f"{nbytes / 1e9:.3f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _mtime(path):
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None
