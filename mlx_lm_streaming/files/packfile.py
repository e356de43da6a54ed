"""The expert pack file: its format, the reader (``PackFile``) and the writer (``write_pack``).

``mlx_lm_streaming pack CKPT`` (pack.py) writes it; the ``packed`` store (stores/packed.py) reads it.

A converted checkpoint keeps each projection's experts stacked (``switch_mlp.gate_proj.weight`` of shape
``(experts, ...)``), so one expert is 6 to 9 ranges spread over the shard (weight, scales and biases of
three projections), and a raw Hugging Face checkpoint is worse. The pack file holds every expert's
tensors back to back, in the order the slot banks use, starting on a 4 KiB boundary and padded to one:
one ``preadv`` (scatter-read into the per-tensor buffers) per expert, and O_DIRECT-capable.

Layout of ``experts.pack`` (beside the shards, unless ``--out``)::

    0   magic  b"MLXSPK01"
    8   u64    header length H
    16  32 B   sha256 of the header
    48  H B    header: JSON (format version, alignment, source shards with size and header sha256,
               one entry per expert: layer, expert, offset, bytes, crc32, and its tensors' source ranges)
    ... zero padding to the alignment
    D   data   (the file ends exactly where the last expert's padding ends)

Written to a temporary file in the same directory, fsynced, then renamed over the old pack (and the
directory fsynced): a pack is either complete or absent. One run at a time writes it: the run holds
``experts.pack.lock`` beside it (``outputs.lock_beside``) and a second is refused. The ``packed``
store (``stores/packed.py``) checks magic, header hash, file size and the sources when it opens the
pack, and each expert's crc32 on its first read.
"""

import hashlib
import json
import os
import shutil
import struct
import sys
import time
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..errors import (
    CheckpointChangedError,
    CheckpointError,
    ConfigurationError,
    ExpertIOError,
    StreamingError,
)
from ..runtime.reads.safetensors_header import FileIdentity
from .outputs import PACK_MAGIC
from .pack_target import PACK_NAME, pack_path, pack_target, write_failed

MAGIC = PACK_MAGIC
VERSION = 1
ALIGN = 4096
PREFIX = 48  # magic, header length, header sha256


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def shard_fingerprint(path: Path) -> dict:
    """Size, mtime and sha256 of the safetensors header: what a pack is checked against.

    The mtime catches a shard rewritten in place with the same header (new expert bytes); a copy
    that does not keep mtimes (``cp -r``, not ``cp -a``) needs a new pack."""
    with open(path, "rb") as f:
        head = f.read(8)
        (hlen,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
        header = f.read(min(hlen, 100_000_000))
        st = os.fstat(f.fileno())
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "header_sha256": hashlib.sha256(head + header).hexdigest(),
    }


def check_free_space(out: Path, need: int) -> None:
    """Refuse, before writing anything, a pack of ``need`` bytes that ``out``'s disk cannot hold.

    The new pack is written beside the old one and renamed over it, so an existing pack's bytes do
    not count as free."""
    free = shutil.disk_usage(out.parent).free
    if need > free:
        from ..runtime.sizes import decimal_gb

        raise ExpertIOError(
            f"{out.parent}: not enough free space for {out.name}: it needs {decimal_gb(need)}, "
            f"{decimal_gb(free)} are free; free some or write the pack to another disk with "
            "--out DIR"
        )


HINT = "write it again with `mlx_lm_streaming pack MODEL --force`, or use the default store"


class PackOfAnotherModel(CheckpointError):
    """A pack made from another model's directory whose shards this model's do not match."""

    def __init__(self, path, made_for: str, model_path, why: str):
        self.made_for = made_for
        self.hint = (
            f"give {model_path}'s own pack (--expert-pack), or write one with `mlx_lm_streaming "
            f"pack {model_path}`"
        )
        super().__init__(
            f"{path}: the expert pack of another model: made from the checkpoint at {made_for}, "
            f"not {model_path} ({why}); {self.hint}"
        )


class PackFile:
    """A validated pack: its header and entries, and an open file descriptor."""

    def __init__(self, path: Path, model_path: Path, direct: bool = False):
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            default = Path(model_path) / PACK_NAME
            out = "" if self.path == default else f" --out {self.path}"
            raise CheckpointError(
                f"{self.path}: no expert pack; write one with `mlx_lm_streaming pack "
                f"{model_path}{out}` (--expert-store packed needs it), or use the default store"
            ) from None
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open the expert pack: {e}; {HINT}") from e
        try:
            st = os.fstat(fd)
            prefix = os.pread(fd, PREFIX, 0)
            if len(prefix) < PREFIX or prefix[:8] != MAGIC:
                raise CheckpointError(f"{self.path}: not an expert pack (bad magic); {HINT}")
            (hlen,) = struct.unpack("<Q", prefix[8:16])
            if hlen > st.st_size - PREFIX:
                raise CheckpointError(f"{self.path}: header runs past the end of the file; {HINT}")
            header = os.pread(fd, hlen, PREFIX)
            if hashlib.sha256(header).digest() != prefix[16:48]:
                raise CheckpointError(f"{self.path}: header checksum mismatch (damaged); {HINT}")
            meta = json.loads(header)
            if meta.get("version") != VERSION:
                raise CheckpointError(
                    f"{self.path}: pack format version {meta.get('version')}, this reader knows "
                    f"{VERSION}; {HINT}"
                )
            end = meta["data_start"] + meta["data_bytes"]
            if st.st_size != end:
                raise CheckpointError(
                    f"{self.path}: is {st.st_size} bytes but its header says {end} (partial or "
                    f"damaged pack); {HINT}"
                )
            made_for = meta.get("model")
            other = made_for and made_for != str(Path(model_path).resolve())
            for name, want in meta["sources"].items():
                shard = Path(model_path) / name
                have = shard_fingerprint(shard) if shard.is_file() else None
                if have != want and other:
                    why = (
                        f"{model_path} has no {name}"
                        if have is None
                        else f"its {name} has other tensors than {shard}"
                        if have["header_sha256"] != want.get("header_sha256")
                        else f"its {name} differs: size or modification time"
                    )
                    raise PackOfAnotherModel(self.path, made_for, model_path, why)
                if have is None:
                    raise CheckpointError(f"{self.path}: made from {name}, missing now; {HINT}")
                if have["header_sha256"] != want.get("header_sha256"):
                    raise CheckpointError(
                        f"{self.path}: made from another checkpoint: its {name} has other "
                        f"tensors than {shard} (the safetensors headers differ); {HINT}"
                    )
                if have != want:
                    raise CheckpointError(
                        f"{self.path}: {shard} changed since the pack was made (size or "
                        f"modification time); {HINT}"
                    )
        except BaseException:
            os.close(fd)
            raise
        self.identity = FileIdentity.of(st)
        self.fd = fd
        self.direct_fd = None
        if direct:
            try:
                self.direct_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except (OSError, AttributeError) as e:
                os.close(fd)
                raise ConfigurationError(f"{self.path}: O_DIRECT not available here: {e}") from e
        self.entries = meta["entries"]
        self.align = meta.get("align", ALIGN)
        # (shard name, offset) -> (entry number, offset inside the expert)
        self.where: Dict[Tuple[str, int], Tuple[int, int]] = {}
        for i, entry in enumerate(self.entries):
            inner = 0
            for _, fname, off, n in entry["parts"]:
                self.where[(fname, off)] = (i, inner)
                inner += n
        self.verified = bytearray(len(self.entries))

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd is not None:
                os.close(fd)
        self.fd = self.direct_fd = None


class _Progress:
    """The progress of ``pack``: bytes of expert data copied out of ``total`` (alignment padding
    not counted, so it ends at 100%), shown in decimal GB."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(
                    total=round(total / 1e9, 6),
                    unit="GB",
                    desc="packing experts",
                    bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.3g}/{total:.3g} GB "
                    "[{elapsed}<{remaining}]",
                )
            except ImportError:
                self.bar = None
        self.start = time.time()

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(round(self.done / 1e9, 6) - self.bar.n)
        else:
            pct = 100 * self.done / max(1, self.total)
            print(
                f"\rpacking experts: {pct:5.1f}% of {self.total / 1e9:.2f} GB",
                end="",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


def write_pack(
    model_path,
    index,
    out: Optional[Path] = None,
    progress: bool = True,
    force: bool = False,
) -> Path:
    """Write ``experts.pack`` for the checkpoint at ``model_path``; returns its path. ``index``: the
    checkpoint's ``ExpertIndex``, or a function that makes it (called only if a pack is written).

    ``out`` is the pack file or an existing directory to write ``experts.pack`` into (default: the
    model directory). An existing pack that matches the checkpoint is kept unless ``force``; one
    made for another model is replaced only with ``force``. Two runs never write one pack at once:
    the second is refused (``outputs.lock_beside``)."""
    from .outputs import PACK, check_output, lock_beside

    model_path = Path(model_path)
    if not model_path.is_dir():
        raise CheckpointError(
            f"{model_path}: no such model directory (pack needs a local checkpoint)"
        )
    if out is not None and not str(out).strip():
        raise ConfigurationError("--out: an empty path; leave it out for MODEL/experts.pack")
    out, folder = pack_target(model_path, out)
    if folder is not None:
        try:
            folder.mkdir()
        except OSError as e:
            raise write_failed(folder, e, f"cannot make the directory {folder}") from None
    try:
        # a file that is not a pack (a text, a shard, a device) is never overwritten; a pack is
        # replaced as a whole, below
        check_output(out, PACK, model_path)
        with lock_beside(out, PACK):
            return _write_pack(model_path, index, out, progress, force)
    except BaseException as e:
        if folder is not None:  # made for this pack, and left empty: take it away again
            try:
                folder.rmdir()
            except OSError:
                pass
        if isinstance(e, OSError) and not isinstance(e, StreamingError):
            raise write_failed(out, e, "writing the pack failed") from None
        raise


def _write_pack(model_path: Path, index, out: Path, progress: bool, force: bool) -> Path:
    # write_pack's, under the pack's lock
    if out.exists() and out.stat().st_size and not force:
        try:
            PackFile(out, model_path).close()
            return out
        except PackOfAnotherModel as e:
            if out.parent.resolve() != model_path.resolve():
                raise ConfigurationError(
                    f"{out}: holds the expert pack of another model ({e.made_for}), not of "
                    f"{model_path}; refusing to replace it: give another --out, or --force to "
                    "replace it"
                ) from None
            reason = str(e).replace(f"; {e.hint}", "")  # a copied model directory: its own place
            print(f"{reason}; writing a new pack", file=sys.stderr, flush=True)
        except (ValueError, KeyError, TypeError) as e:  # stale or damaged: say so, write it again
            reason = str(e).replace(f"; {HINT}", "")
            print(f"{reason}; writing a new pack", file=sys.stderr, flush=True)
    from ..runtime.reads.index import natural_key

    index = index() if callable(index) else index
    layers = sorted(index.layers.values(), key=lambda l: natural_key(l.path))
    files = index.files
    sources = {p.name: shard_fingerprint(p) for p in sorted(files.identity)}
    entries: List[dict] = []
    offset = 0
    for layer in layers:
        for e in range(layer.num_experts):
            refs = layer.refs(e)
            nbytes = sum(r.nbytes for r in refs)
            entries.append(
                {
                    "layer": layer.path,
                    "expert": e,
                    "offset": offset,  # relative to the data start until fixed below
                    "nbytes": nbytes,
                    "crc32": "00000000",
                    "parts": [[r.name, r.file.name, r.offset, r.nbytes] for r in refs],
                }
            )
            offset += align_up(nbytes)
    data_bytes = offset

    def header_bytes(data_start: int) -> bytes:
        body = {
            "format": "mlx_lm_streaming experts pack",
            "version": VERSION,
            "align": ALIGN,
            "data_start": data_start,
            "data_bytes": data_bytes,
            # where the checkpoint was, to tell another model's pack from a changed checkpoint
            "model": str(model_path.resolve()),
            "sources": sources,
            "entries": entries,
        }
        return json.dumps(body, separators=(",", ":")).encode()

    # crc32 are fixed-width hex, so the header's length depends only on the offsets, which depend
    # on where the data starts: settle both
    relative = [entry["offset"] for entry in entries]
    data_start = 0
    while True:
        for entry, rel in zip(entries, relative):
            entry["offset"] = data_start + rel
        need = align_up(PREFIX + len(header_bytes(data_start)))
        if need == data_start:
            break
        data_start = need
    hlen = len(header_bytes(data_start))

    for stale in out.parent.glob(out.name + ".tmp-*"):
        try:
            stale.unlink()
        except OSError:
            pass
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    bar = None
    fds: Dict[str, int] = {}
    try:
        with open(tmp, "wb") as f:
            # after the open, so that a directory we cannot write to is named as such
            check_free_space(out, data_start + data_bytes)
            bar = _Progress(sum(entry["nbytes"] for entry in entries), progress)
            f.truncate(data_start + data_bytes)
            for entry in entries:
                buf = bytearray(align_up(entry["nbytes"]))
                view = memoryview(buf)
                pos = 0
                for _, fname, src_off, n in entry["parts"]:
                    fd = fds.get(fname)
                    if fd is None:
                        fd = fds[fname] = os.open(model_path / fname, os.O_RDONLY)
                    got = 0
                    while got < n:
                        k = os.preadv(fd, [view[pos + got : pos + n]], src_off + got)
                        if k == 0:
                            raise CheckpointChangedError(
                                f"{model_path / fname}: ended early while packing (truncated?)"
                            )
                        got += k
                    pos += n
                entry["crc32"] = f"{zlib.crc32(view[: entry['nbytes']]):08x}"
                f.seek(entry["offset"])
                f.write(buf)
                bar.update(entry["nbytes"])
            header = header_bytes(data_start)
            assert len(header) == hlen
            f.seek(0)
            f.write(MAGIC + struct.pack("<Q", hlen) + hashlib.sha256(header).digest() + header)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
        dfd = os.open(out.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise  # (an OSError is the disk's or the path's: ``write_pack`` says which)
    finally:
        if bar is not None:
            bar.close()
        for fd in fds.values():
            os.close(fd)
    return out


# -- command line (wired into ``mlx_lm_streaming pack``) --------------------------------------------
