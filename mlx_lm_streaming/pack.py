"""``mlx_lm_streaming pack CKPT``: repack the routed experts for one aligned read per expert.

The file format, its reader and its writer are in packfile.py; this is the subcommand.
"""

import os
import time

from .packfile import PACK_NAME, pack_checkpoint


def add_arguments(parser) -> None:
    parser.add_argument("model", help="checkpoint directory (safetensors shards + config.json)")
    parser.add_argument("--out", default=None, help=f"pack file (default: MODEL/{PACK_NAME})")
    parser.add_argument("--force", action="store_true", help="write it even if a valid pack exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    start = time.time()
    out = pack_checkpoint(args.model, args.out, progress=not args.quiet, force=args.force)
    size = os.path.getsize(out)
    print(
        f"{out}: {size / 2**30:.3f} GB in {time.time() - start:.1f} s; use it with "
        f"--expert-store packed (store='packed')"
    )
    return 0
