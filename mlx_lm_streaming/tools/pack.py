"""``mlx_lm_streaming pack CKPT``: repack the routed experts for one aligned read per expert.

The file format, its reader and its writer are in packfile.py; this is the subcommand, and the
index of the checkpoint it packs, built the way loading builds it.
"""

import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

from ..files.packfile import PACK_NAME, pack_path, write_pack
from ..runtime.sizes import decimal_gb


def index_checkpoint(model_path: Path):
    """The ``ExpertIndex`` of a checkpoint, built the way loading builds it (no expert bytes read)."""
    from ..integration.integration import load_to_stream
    from ..runtime.options import StreamingOptions

    model, _ = load_to_stream(Path(model_path), StreamingOptions())
    state = model.expert_streaming
    index = state.index
    state.close()
    return index


def pack_checkpoint(
    model_path, out: Optional[Path] = None, progress: bool = True, index=None, force: bool = False
) -> Path:
    """Write ``experts.pack`` for the checkpoint at ``model_path`` (``packfile.write_pack``); the
    index is built only if a pack must be written."""
    return write_pack(
        model_path, index or (lambda: index_checkpoint(model_path)), out, progress, force
    )


def add_arguments(parser) -> None:
    parser.add_argument("model", help="checkpoint directory (safetensors shards + config.json)")
    parser.add_argument(
        "--out",
        default=None,
        help=f"pack file (a new one needs an extension: DIR/q.pack), or a directory to write "
        f"{PACK_NAME} into (a new one needs a trailing /: newdir/) (default: MODEL/{PACK_NAME}); "
        "another disk than the model's spreads the reads over both",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="write it even if a valid pack exists, or over another model's pack",
    )
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
    print(f"{out}: {decimal_gb(size)} (a second copy of the experts), {done}")
    print(f"use it with: {use_command(args.model, out)}")
    return 0


def command_word(name: str) -> str:
    """How a shell runs the installed command ``name`` (``mlx_lm.generate``) of this interpreter:
    its name where ``PATH`` finds it, else its path (a virtual environment not activated)."""
    here = Path(sys.executable).parent / name
    found = shutil.which(name)
    if not here.is_file() or found is not None and os.path.samefile(found, here):
        return name
    return str(here)


def use_command(model, pack) -> str:
    """The ``mlx_lm.generate`` command line that streams ``model``'s experts from ``pack``."""
    words = [command_word("mlx_lm.generate"), "--model", os.path.abspath(model)]
    words += ["--streaming-experts"]
    words += ["--expert-store", "packed"]
    if os.path.abspath(pack) != os.path.abspath(pack_path(model)):
        words += ["--expert-pack", os.path.abspath(pack)]
    return shlex.join(words)


def _mtime(path):
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None
