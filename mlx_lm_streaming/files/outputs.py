"""The files we write for a user: a routing trace, a timeline, an expert pack, a plot.

Four rules keep a user's files safe (issues 21 and 27):

1. ``check_output`` looks at an output path before anything is opened for writing, and refuses, in one
   ``ConfigurationError`` naming the path, an empty path, a directory, anything that is not a regular
   file (a device, a FIFO), one of the model's own files, a file another process is writing, and an
   existing file that is not an output of the same kind: by its first bytes, and for a plot by the
   mark we write into it (``PLOT_MARK``); an empty file holds nothing to lose and is taken.
2. A file is opened only once every other check of the run has passed: the routing trace at the
   first token, the timeline at its first write, a pack or a plot written beside the old one and
   renamed over it at the end (``replace_whole``).
3. One writer per file: the routing trace and the timeline are opened under an exclusive lock held
   until they are closed (``open_for_run``), and not emptied if another process holds it or wrote
   the file since the run checked it; a pack is written under ``lock_beside``.
4. A trace or timeline that fails while the run goes (a full disk, a revoked permission, an I/O
   error, another writer) is given up with one line on stderr naming the file and the error
   (``say_failed``); the generation goes on.
"""

import errno
import json
import os
import stat
import sys
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # no advisory locks (Windows): one writer per file is then the user's care
    fcntl = None

from ..errors import ConfigurationError

ROUTING_TRACE = "routing trace"
TIMELINE = "timeline"
PACK = "expert pack"
PLOT = "plot"

# the first bytes of the files we write (routing_trace.FORMAT, packfile.MAGIC are these)
TRACE_FORMAT = "moe-routing-trace"
PACK_MAGIC = b"MLXSPK01"
# plot formats --plot writes, by extension, and the bytes such a file starts with
PLOT_MAGIC = {".png": (b"\x89PNG\r\n\x1a\n",), ".svg": (b"<?xml", b"<svg"), ".pdf": (b"%PDF-",)}
# the Creator --plot writes into a plot's metadata (a PNG tEXt chunk near the start, the SVG's
# metadata near the start, the PDF's Info dictionary near the end): only such a file is replaced
PLOT_MARK = "mlx-lm-streaming plan --plot"
HEAD_BYTES = 1 << 16


def _head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(HEAD_BYTES)


def _tail(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - HEAD_BYTES))
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
    if not head.startswith(PLOT_MAGIC.get(path.suffix.lower(), (b"\0\0\0\0",))):
        return False
    mark = PLOT_MARK.encode()
    return mark in head or mark in _tail(path)


def is_output_of_kind(path: Path, kind: str) -> bool:
    """Whether the file at ``path`` is a ``kind`` that we wrote: by its first bytes, and for a plot
    by our mark in it."""
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
    if _locked_elsewhere(path):
        raise ConfigurationError(
            f"{path}: another process is writing this {kind} now; give this run another path, "
            "or wait for that one to finish"
        )
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
    if kind == PLOT:
        raise ConfigurationError(
            f"{path}: exists and is not a plot that --plot wrote (no {PLOT_MARK!r} mark in it); "
            f"{keep}"
        )
    raise ConfigurationError(f"{path}: exists and is not {_a(kind)} (by its first bytes); {keep}")


def _locked_elsewhere(path) -> bool:
    """Whether another writer holds ``path``'s lock (``open_for_run``). A file of this process's
    own open trace or timeline is never checked here (their ``claimed``)."""
    if fcntl is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:  # no locks on this file system: nothing to learn
        return False
    finally:
        os.close(fd)


def identity(path):
    """What ``open_for_run`` compares the file with: its identity when the run checked it (None:
    no file)."""
    try:
        return _identity(os.stat(path))
    except OSError:
        return None


def _identity(st):
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def open_for_run(path, seen):
    """``open(path, "w")`` for the routing trace or the timeline of a run that checked ``path``
    when it was ``seen`` (``identity``): the file is locked before it is emptied, and the lock held
    until it is closed. ``OSError`` (the output is given up, the file left as it is) when another
    process holds the lock, or wrote the file since the run checked it."""

    def opener(name, flags):
        fd = os.open(name, flags & ~os.O_TRUNC, 0o666)
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise OSError(
                        errno.EBUSY, "another process is writing it; give each run its own file"
                    ) from None
            st = os.fstat(fd)
            if st.st_size and _identity(st) != seen:
                raise OSError(
                    errno.EEXIST,
                    "another process wrote it since this run began; left as it is, give each run "
                    "its own file",
                )
            os.ftruncate(fd, 0)
        except BaseException:
            os.close(fd)
            raise
        return fd

    return open(path, "w", encoding="utf-8", opener=opener)


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


@contextmanager
def lock_beside(path, kind: str):
    """Hold an exclusive lock on ``PATH.lock`` while ``path`` is written (the file itself is
    replaced by a rename, so it cannot carry the lock); ``ConfigurationError`` naming ``path`` if
    another process holds it. The lock file is removed when the lock is let go."""
    lock = Path(f"{path}.lock")
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            by = f"process {holder}" if holder.isdigit() else "another process"
            raise ConfigurationError(
                f"{path}: {by} is writing this {kind} now (it holds {lock}); wait for it to "
                "finish, or give another path"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        try:  # the lock file we locked may have been removed by its last holder: take the new one
            same = _identity(os.stat(lock))[:2] == _identity(os.fstat(fd))[:2]
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        try:
            lock.unlink()
        except OSError:
            pass
        os.close(fd)
