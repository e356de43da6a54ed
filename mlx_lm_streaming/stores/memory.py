"""``memory``: serves byte ranges from whole files held in RAM. For tests and fault injection."""

import os
from pathlib import Path
from typing import Dict

from ..index import TensorRef
from .base import ExpertStore


class MemoryStore(ExpertStore):
    """Reads each checkpoint file into memory once, on first use, and serves ranges from it."""

    name = "memory"

    def __init__(self, files, **options):
        super().__init__(files)
        self._blobs: Dict[Path, bytes] = {}

    def read_into(self, ref: TensorRef, out: memoryview) -> None:
        blob = self._blobs.get(ref.file)
        if blob is None:
            self.files.check_unchanged(ref.file, os.stat(ref.file))
            blob = self._blobs[ref.file] = ref.file.read_bytes()
        out[:] = memoryview(blob)[ref.offset : ref.offset + ref.nbytes]

    def close(self) -> None:
        self._blobs.clear()
