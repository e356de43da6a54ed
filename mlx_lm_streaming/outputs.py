"""The files we write for a user: a routing trace, a timeline, an expert pack, a plot.

Three rules keep a user's files safe (issue 21):

1. ``check_output`` looks at an output path before anything is opened for writing, and refuses, in one
   ``ConfigurationError`` naming the path, an empty path, a directory, anything that is not a regular
   file (a device, a FIFO), one of the model's own files, and an existing file that is not an output
   of the same kind by its first bytes (an empty file holds nothing to lose and is taken).
2. A file is opened only once every other check of the run has passed: the routing trace at the
   first token, the timeline at its first write, a pack or a plot written beside the old one and
   renamed over it at the end (``replace_whole``).
3. A trace or timeline that fails while the run goes (a full disk, a revoked permission, an I/O
   error) is given up with one line on stderr naming the file and the error (``say_failed``); the
   generation goes on.
"""

import json
import os
import stat
import sys
from pathlib import Path

from .errors import ConfigurationError

ROUTING_TRACE = "routing trace"
TIMELINE = "timeline"
PACK = "expert pack"
PLOT = "plot"

# the first bytes of the files we write (routing_trace.FORMAT, packfile.MAGIC are these)
TRACE_FORMAT = "moe-routing-trace"
PACK_MAGIC = b"MLXSPK01"
# plot formats --plot writes, by extension, and the bytes such a file starts with
PLOT_MAGIC = {".png": (b"\x89PNG\r\n\x1a\n",), ".svg": (b"<?xml", b"<svg"), ".pdf": (b"%PDF-",)}
HEAD_BYTES = 1 << 16


def _head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(HEAD_BYTES)


def _is_routing_trace(head: bytes) -> bool:
    line = head.split(b"\n", 1)[0]
    try:
        header = json.loads(line)
    except ValueError:
        return False
    return isinstance(header, dict) and header.get("format") == TRACE_FORMAT


def _is_timeline(head: bytes) -> bool:
    # timeline.Timeline writes "[" and then its process_name event first
    return head.startswith(b'[\n{"name":"process_name"') and b"mlx-lm-streaming" in head[:400]


def _is_pack(head: bytes) -> bool:
    return head.startswith(PACK_MAGIC)


def _is_plot(path: Path, head: bytes) -> bool:
    return head.startswith(PLOT_MAGIC.get(path.suffix.lower(), (b"\0\0\0\0",)))


def is_output_of_kind(path: Path, kind: str) -> bool:
    """Whether the file at ``path`` is, by its first bytes, a ``kind`` that we wrote."""
    head = _head(path)
    if kind == PLOT:
        return _is_plot(path, head)
    return {ROUTING_TRACE: _is_routing_trace, TIMELINE: _is_timeline, PACK: _is_pack}[kind](head)


def _model_files(model_path) -> set:
    """The real paths of the model directory's files (shards may be symlinks into a Hugging Face
    cache's blobs), but the expert pack that ``pack`` writes there by default."""
    try:
        return {
            os.path.realpath(p) for p in Path(model_path).iterdir() if p.name != "experts.pack"
        }
    except OSError:
        return set()


def _a(kind: str) -> str:
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def check_output(path, kind: str, model_path=None) -> Path:
    """``path`` as a ``Path`` if a ``kind`` may be written there; else ``ConfigurationError``
    naming it. Opens nothing for writing (see the module's docstring)."""
    if path is None or not str(path).strip():
        raise ConfigurationError(f"an empty path for the {kind}; give a file name")
    path = Path(path)
    keep = f"refusing to overwrite it: give another path for the {kind}, or remove the file"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        parent = path.parent
        if not parent.is_dir():
            raise ConfigurationError(f"{path}: cannot write the {kind}: no directory {parent}")
        if not os.access(parent, os.W_OK):
            raise ConfigurationError(
                f"{path}: cannot write the {kind}: the directory {parent} is not writable"
            )
        return path
    except OSError as e:
        raise ConfigurationError(f"{path}: cannot write the {kind} ({e.strerror or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigurationError(f"{path}: is a directory, not a file for the {kind}")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigurationError(f"{path}: not a regular file (a device or a pipe?); {keep}")
    if st.st_size == 0:
        return path  # nothing in it to lose
    try:
        same_kind = is_output_of_kind(path, kind)
    except OSError as e:
        raise ConfigurationError(f"{path}: cannot read it to check it ({e.strerror or e}); {keep}")
    if same_kind:
        return path
    if model_path is not None and os.path.realpath(path) in _model_files(model_path):
        raise ConfigurationError(f"{path}: one of the model's files, not {_a(kind)}; {keep}")
    raise ConfigurationError(f"{path}: exists and is not {_a(kind)} (by its first bytes); {keep}")


_said = set()


def say_failed(path, kind: str, error: BaseException) -> None:
    """One line on stderr, once per file: writing it failed, it is given up, the run goes on."""
    key = (str(path), kind)
    if key in _said:
        return
    _said.add(key)
    reason = getattr(error, "strerror", None) or error
    try:
        sys.stderr.write(
            f"mlx-lm-streaming: {path}: writing the {kind} failed ({reason}); stopped writing it, "
            "the generation goes on\n"
        )
        sys.stderr.flush()
    except Exception:
        pass


def close_quietly(file) -> None:
    """Close a file whose writing failed; what it still holds is lost (its error already said)."""
    try:
        file.close()
    except Exception:
        pass


def replace_whole(path, kind: str, write) -> Path:
    """Write ``path`` through ``write(tmp_path)`` beside it and rename it over the old one at the
    end: an old file of the same kind is replaced only as a whole, never left half written."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        if isinstance(e, OSError):
            raise ConfigurationError(
                f"{path}: cannot write the {kind} ({e.strerror or e})"
            ) from None
        raise
    return path
