"""Where ``mlx_lm_streaming pack`` writes its pack (``--out``), and how a failure to write there is
reported: a path that cannot be written at all is a bad option (exit status 2), like the refusals of
``outputs.check_output``; any other failure while writing is the disk's (``ExpertIOError``, 1)."""

import errno
import os
from pathlib import Path
from typing import Optional, Tuple

from ..errors import ConfigurationError, ExpertIOError, StreamingError

PACK_NAME = "experts.pack"


def pack_path(model_path, out=None) -> Path:
    """Where the pack goes: ``out``, ``out/experts.pack`` when ``out`` is a directory (or ends in
    ``/``), or ``model_path/experts.pack``."""
    if out is None:
        return Path(model_path) / PACK_NAME
    names_dir = _names_directory(out)
    out = Path(out)
    return out / PACK_NAME if names_dir or out.is_dir() else out


def _names_directory(out) -> bool:
    text = os.fspath(out)
    return text.endswith(tuple(filter(None, (os.sep, os.altsep))))


def pack_target(model_path, out=None) -> Tuple[Path, Optional[Path]]:
    """Where ``pack --out OUT`` writes, and the directory it must create first (None: none).

    ``OUT`` is a pack file (an existing one, or a new name with an extension, ``disk2/q.pack``),
    or a directory: an existing one, or a new one named with a trailing ``/`` (``newdir/``), made
    inside an existing directory. A new name without extension or ``/`` (``--out /disk2`` where
    there is no ``/disk2``) is refused: it would become a file where a directory was meant.
    ``ConfigurationError`` naming the path (exit status 2, as every output path refused before
    anything is written)."""
    path = pack_path(model_path, out)
    if out is None:
        return path, None
    text = os.fspath(out)
    folder = Path(text)
    if _names_directory(text):
        if folder.is_dir():
            return path, None
        if folder.exists():
            raise ConfigurationError(f"--out {text}: {folder} exists and is not a directory")
        if not folder.parent.is_dir():
            raise ConfigurationError(
                f"--out {text}: cannot make the directory {folder}: no directory {folder.parent}"
            )
        return path, folder
    if not folder.suffix and not folder.exists():
        raise ConfigurationError(
            f"--out {text}: no such directory; for a new directory end the path with a slash "
            f"(--out {text}/), for a pack file give it an extension (--out {text}.pack)"
        )
    if not path.parent.is_dir():
        raise ConfigurationError(f"{path}: cannot write the pack: no directory {path.parent}")
    return path, None


NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def write_failed(path, error: OSError, what: str) -> StreamingError:
    """The error for an ``OSError`` while writing the pack at ``path``: permission denied, or a
    read-only file system, making ``path`` or a file beside it (the temporary file, the lock) is
    the path's fault; anything else (a full disk, an I/O error, a shard that went away) the disk's
    or the checkpoint's."""
    name = getattr(error, "filename", None)
    ours = name is None or os.path.basename(os.fspath(name)).startswith(Path(path).name)
    if error.errno in NOT_WRITABLE and ours:
        return ConfigurationError(
            f"{path}: {what} ({error.strerror or error}); give --out a directory you can write "
            "to; the checkpoint is untouched"
        )
    return ExpertIOError(
        f"{path}: {what} ({error}); no partial pack was left and the checkpoint is untouched"
    )
