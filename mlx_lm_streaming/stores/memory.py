"""``memory``: serves byte ranges from whole files held in RAM. For tests and fault injection.

Each file is read once, on first use, and checked against what the index saw before and after the read;
later changes on disk do not matter, since the snapshot it serves is the one the index describes.
"""

import os
from pathlib import Path
from typing import Dict

from ..errors import CheckpointChangedError
from ..runtime.reads.safetensors_header import TensorRef
from .base import ExpertStore, shard_error


class MemoryStore(ExpertStore):
    """Reads each checkpoint file into memory once, on first use, and serves ranges from it."""

    name = "memory"

    def __init__(self, files, **options):
        super().__init__(files)
        self._blobs: Dict[Path, bytes] = {}

    def _blob(self, path: Path) -> bytes:
        return self._per_file(self._blobs, path, self._read_file)

    def _read_file(self, path: Path) -> bytes:
        try:
            with open(path, "rb") as f:
                self.files.check_unchanged(path, os.fstat(f.fileno()))
                blob = f.read()
                self.files.check_unchanged(path, os.fstat(f.fileno()))
        except OSError as e:
            raise shard_error(path, e, "read") from e
        if len(blob) != self.files.identity[path].size:
            raise CheckpointChangedError(
                f"{path}: read {len(blob)} bytes, the model was loaded from "
                f"{self.files.identity[path].size}; reload the model"
            )
        return blob

    def read_into(self, ref: TensorRef, out: memoryview) -> None:
        out[:] = memoryview(self._blob(ref.file))[ref.offset : ref.offset + ref.nbytes]

    def close(self, wait: bool = True) -> None:
        with self._lock:
            self._closed = True
            self._blobs.clear()
