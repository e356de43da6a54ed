"""Safetensors headers, parsed and checked without reading tensor data.

``read_header`` parses one file's header (8-byte length, JSON) into ``TensorRef`` records (file,
absolute byte offset, length, dtype, shape) and checks every entry against the file: dtype known, shape
of non-negative integers, ``data_offsets`` ordered, inside the file, no overlaps, byte count equal to the
shape times the item size. Errors name the file and the tensor.
"""

import json
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Tuple

import mlx.core as mx

from ...errors import CheckpointError

# safetensors dtype name -> (mlx dtype, bytes per element)
DTYPES = {
    name: (dtype, dtype.size)
    for name, dtype in (
        ("BOOL", mx.bool_), ("U8", mx.uint8), ("I8", mx.int8), ("U16", mx.uint16),
        ("I16", mx.int16), ("F16", mx.float16), ("BF16", mx.bfloat16), ("U32", mx.uint32),
        ("I32", mx.int32), ("F32", mx.float32), ("U64", mx.uint64), ("I64", mx.int64),
    )
}  # fmt: skip


def mx_dtype(name: str):
    """The mlx dtype of a safetensors dtype name."""
    return DTYPES[name][0]


# The safetensors format caps headers at 100 MB; a larger length field is a lie.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorRef:
    """One contiguous byte range of a checkpoint file holding one tensor."""

    file: Path
    name: str
    offset: int
    nbytes: int
    dtype: str
    shape: Tuple[int, ...]

    @property
    def mx_dtype(self):
        return DTYPES[self.dtype][0]


@dataclass(frozen=True)
class FileIdentity:
    """What we saw of a file at load time; a later mismatch means it changed on disk."""

    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileIdentity":
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


def _brief(value, limit: int = 120) -> str:
    """``repr(value)``, cut short: a damaged header must not make a megabyte error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _open_regular(path: Path):
    """Open a checkpoint file for reading; anything but a regular file (a FIFO would block, a device
    never end) is refused."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: not a regular file")
        return os.fdopen(fd, "rb"), st
    except BaseException:
        os.close(fd)
        raise


def _unique_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            # readers disagree on which duplicate wins: refuse rather than guess
            raise ValueError(f"key {_brief(key)} appears twice")
        out[key] = value
    return out


def _parse_json(path: Path, raw: bytes, what: str):
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except RecursionError:
        raise CheckpointError(f"{path}: {what} JSON is nested too deeply") from None
    except ValueError as e:  # also UnicodeDecodeError and over-long integers
        raise CheckpointError(f"{path}: {what} is not valid JSON: {e}") from e


def read_header(path: Path) -> Tuple[Dict[str, TensorRef], FileIdentity]:
    """Parse one safetensors header into ``TensorRef`` records, checking every range."""
    path = Path(path)
    try:
        f, st = _open_regular(path)
        with f:
            size = st.st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{path}: file is {size} bytes, too short for a safetensors header "
                    "(truncated download?)"
                )
            (hlen,) = struct.unpack("<Q", head)
            if hlen > MAX_HEADER_BYTES or hlen > size - 8:
                raise CheckpointError(
                    f"{path}: header length field says {hlen} bytes but the file holds "
                    f"{size - 8} after it (truncated or not a safetensors file)"
                )
            raw = f.read(hlen)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read safetensors header: {e}") from e
    header = _parse_json(path, raw, "safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")

    data_start = 8 + hlen
    data_len = size - data_start
    refs = {}
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        refs[name] = _parse_entry(path, name, entry, data_start, data_len)
        spans.append((refs[name].offset, refs[name].offset + refs[name].nbytes, name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(
                f"{path}: tensors {n0!r} and {n1!r} overlap in the file (damaged header)"
            )
    return refs, FileIdentity.of(st)


def _parse_entry(path, name, entry, data_start, data_len) -> TensorRef:
    def bad(why):
        return CheckpointError(f"{path}: tensor {_brief(name)}: {why}")

    if not isinstance(entry, dict):
        raise bad("header entry is not an object")
    dtype = entry.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"unsupported dtype {_brief(dtype)} (known: {', '.join(DTYPES)})")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise bad(f"shape {_brief(shape)} is not a list of non-negative integers")
    offsets = entry.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise bad(f"data_offsets {_brief(offsets)} is not a pair of integers")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise bad(f"data_offsets {offsets} are reversed or negative")
    if end > data_len:
        raise bad(
            f"data_offsets end at byte {end} but the file's data section holds only "
            f"{data_len} bytes (truncated file?)"
        )
    # multiplied step by step and stopped once past the file: a header of a million huge dims
    # would otherwise take minutes of big-integer arithmetic
    nbytes = 0 if 0 in shape else DTYPES[dtype][1]
    for d in shape:
        nbytes *= d
        if nbytes > data_len:
            break
    if nbytes != end - begin:
        needs = f"more than {data_len}" if nbytes > data_len else f"{nbytes}"
        raise bad(
            f"shape {_brief(shape)} of {dtype} needs {needs} bytes but data_offsets give "
            f"{end - begin}"
        )
    return TensorRef(path, name, data_start + begin, nbytes, dtype, tuple(shape))
