"""Expert index: where every routed expert's bytes live in the checkpoint.

Only safetensors headers are read, never tensor data. ``CheckpointFiles`` parses the header of every
``model*.safetensors`` (the files mlx-lm's ``load_model`` reads) into ``TensorRef`` records: file, absolute
byte offset, length, dtype and shape, each validated against the file size. ``ExpertIndex`` then maps
(layer, expert, projection, part) to the byte range of that one expert, for both layouts:

- stacked ``...switch_mlp.{gate,up,down}_proj.{weight,scales,...}`` (``fc1``, ``fc2`` for a
  ``SwitchMLP``) of shape ``(num_experts, ...)`` (converted checkpoints): expert ``e`` is the
  contiguous range ``offset + e * stride``;
- one tensor per expert, as Hugging Face ships them (named by the architecture adapter).
"""

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from ...errors import CheckpointChangedError, CheckpointError
from .safetensors_header import (
    DTYPES,
    FileIdentity,
    TensorRef,
    _brief,
    _open_regular,
    _parse_json,
    read_header,
)

def natural_key(name: str):
    """Sort key that orders ``layers.2`` before ``layers.10``."""
    return [(1, int(p), "") if p.isdigit() else (0, 0, p) for p in re.split(r"(\d+)", name)]


# model.safetensors.index.json of a 1T-parameter model is a few MB
MAX_INDEX_BYTES = 100_000_000

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# the projections of mlx-lm's ``SwitchMLP`` (nemotron_h, phixtral): ``fc2(activation(fc1(x)))``
MLP_PROJECTIONS = ("fc1", "fc2")


def projections_of(module) -> Tuple[str, ...]:
    """The projections of a routed-experts module: ``MLP_PROJECTIONS`` for a ``SwitchMLP`` (or a
    subclass), else ``PROJECTIONS`` (a ``SwitchGLU``)."""
    from mlx_lm.models.switch_layers import SwitchMLP

    return MLP_PROJECTIONS if isinstance(module, SwitchMLP) else PROJECTIONS


class CheckpointFiles:
    """The safetensors shards of one model directory, with every header parsed.

    ``allow_missing``: shards that the weight index names may be absent (a pipeline rank holds only
    the shards of its own layers, see docs/distributed.md); ``missing`` maps each absent shard to
    the tensors the index puts in it, and ``layer_missing`` says whether a layer has any."""

    def __init__(
        self, model_path, files: Optional[Sequence[Path]] = None, allow_missing: bool = False
    ):
        self.model_path = Path(model_path)
        self.missing: Dict[str, List[str]] = {}
        self._missing_layers: Optional[set] = None
        if files is None:
            files = sorted(self.model_path.glob("model*.safetensors"))
            self.missing = self._check_index(files, allow_missing)
            for f in files:
                self._check_inside(f)
        if not files:
            raise CheckpointError(f"No safetensors found in {self.model_path}")
        self.tensors: Dict[str, TensorRef] = {}
        self.identity: Dict[Path, FileIdentity] = {}
        for f in files:
            refs, ident = read_header(f)
            self.identity[Path(f)] = ident
            self.tensors.update(refs)

    def _check_index(self, files, allow_missing: bool = False) -> Dict[str, List[str]]:
        """Every shard the index names must be a plain file name present in the directory (with
        ``allow_missing``, absent ones are returned: ``{shard: [tensor, ...]}``).

        The index is never used to choose what to open (that is the ``model*.safetensors`` glob, as in
        mlx-lm); it is checked so an incomplete download or a tampered index fails at load."""
        index_file = self.model_path / "model.safetensors.index.json"
        if not index_file.exists():
            return {}
        try:
            f, st = _open_regular(index_file)
            with f:
                if st.st_size > MAX_INDEX_BYTES:
                    raise CheckpointError(
                        f"{index_file}: {st.st_size} bytes is too large for a weight index"
                    )
                raw = f.read()
        except OSError as e:
            raise CheckpointError(f"{index_file}: cannot read weight index: {e}") from e
        data = _parse_json(index_file, raw, "weight index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_file}: not a valid weight index (no weight_map object)")
        present = {f.name for f in files}
        for tensor, name in weight_map.items():
            if (
                not isinstance(name, str)
                or name in ("", ".", "..")
                or Path(name).name != name
                or "\\" in name
                or "\0" in name
            ):
                raise CheckpointError(
                    f"{index_file}: tensor {_brief(tensor)} is mapped to shard {_brief(name)}, "
                    f"which is not a plain file name inside {self.model_path}"
                )
        missing: Dict[str, List[str]] = {}
        for tensor, name in weight_map.items():
            if name in present:
                continue
            if not allow_missing:
                raise CheckpointError(
                    f"{index_file}: tensor {_brief(tensor)} is in shard {_brief(name)}, which "
                    f"is missing from {self.model_path} (incomplete download?)"
                )
            missing.setdefault(name, []).append(tensor)
        return missing

    def missing_needed(self, start: int, end: int) -> Optional[Tuple[str, str]]:
        """``(tensor, shard)`` of an absent shard that layers ``start..end-1`` or the weights
        outside any layer (embeddings, final norm, head) need, or None. Tensors are matched to
        layers by number, as mlx-lm's ``sharded_load`` chooses the shards a rank downloads."""
        for shard, tensors in sorted(self.missing.items()):
            for tensor in tensors:
                layer = checkpoint_layer(tensor)
                if layer is None or start <= layer < end:
                    return tensor, shard
        return None

    def layer_missing(self, layer: Optional[int]) -> bool:
        """Whether an absent shard holds a tensor of checkpoint layer ``layer``."""
        if self._missing_layers is None:
            self._missing_layers = {
                checkpoint_layer(t) for tensors in self.missing.values() for t in tensors
            }
        return layer is not None and layer in self._missing_layers

    def _check_inside(self, path: Path) -> None:
        """A shard may be a symlink only to a file inside the model directory or, for a Hugging Face
        cache snapshot (``<repo>/snapshots/<rev>/``), inside that repo's ``blobs/``."""
        root = self.model_path.resolve()
        real = path.resolve()
        if real.is_relative_to(root):
            return
        if root.parent.name == "snapshots" and real.parent == root.parent.parent / "blobs":
            return
        raise CheckpointError(
            f"{path}: shard is a symlink to {real}, outside the model directory {root}; "
            "streaming reads only files inside it (copy the file in, or symlink the whole "
            "model directory instead)"
        )

    def check_unchanged(self, path: Path, st: os.stat_result) -> None:
        """Raise if ``path`` is not the file whose header we parsed."""
        if FileIdentity.of(st) != self.identity[path]:
            raise CheckpointChangedError(
                f"{path} changed on disk after the model was loaded (size, mtime or inode "
                "differ); reload the model"
            )


def checkpoint_layer(name: str) -> Optional[int]:
    """The layer number in a tensor or module name (``model.layers.3.mlp...`` -> 3), or None."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name + ".")
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class PartSpec:
    """One tensor of one projection of one expert: e.g. ``gate_proj.scales``."""

    proj: str
    part: str
    dtype: str
    shape: Tuple[int, ...]  # of one expert

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][1]


class LayerExperts:
    """Byte ranges of every routed expert of one MoE layer."""

    def __init__(self, path: str, num_experts: int, parts: List[PartSpec], refs):
        self.path = path
        self.num_experts = num_experts
        self.parts = parts
        # refs[i][e] is the TensorRef of parts[i] for expert e
        self._refs = refs
        # asked once or more per layer call: computed once (the parts never change)
        self.expert_nbytes = sum(p.nbytes for p in parts)

    def refs(self, expert: int) -> List[TensorRef]:
        return [r[expert] for r in self._refs]

    def files(self) -> set:
        return {ref.file for r in self._refs for ref in r}


RawKey = Callable[[str, int, str, str], Optional[str]]


class ExpertIndex:
    """(layer, expert, projection, part) -> byte range, validated against the model's shapes."""

    def __init__(self, files: CheckpointFiles):
        self.files = files
        self.layers: Dict[str, LayerExperts] = {}

    def add_layer(
        self,
        path: str,
        num_experts: int,
        expected: Dict[Tuple[str, str], Tuple[int, ...]],
        raw_key: Optional[RawKey] = None,
    ) -> LayerExperts:
        """Index one layer. ``expected[(proj, part)]`` is the stacked shape the config implies."""
        parts, refs = [], []
        for (proj, part), shape in expected.items():
            per_expert = self._locate(path, num_experts, proj, part, shape, raw_key)
            dtypes = {r.dtype for r in per_expert}
            if len(dtypes) != 1:
                raise CheckpointError(
                    f"{path}.{proj}.{part}: experts disagree on dtype ({sorted(dtypes)})"
                )
            parts.append(PartSpec(proj, part, per_expert[0].dtype, tuple(shape[1:])))
            refs.append(per_expert)
        layer = LayerExperts(path, num_experts, parts, refs)
        self.layers[path] = layer
        return layer

    def _locate(self, path, num_experts, proj, part, shape, raw_key) -> List[TensorRef]:
        name = f"{path}.{proj}.{part}"
        tensors = self.files.tensors
        if name in tensors:
            ref = tensors[name]
            scales = f"{path}.{proj}.scales"
            if part == "weight" and ref.dtype == "U32" and scales not in tensors:
                raise CheckpointError(
                    f"{ref.file}: tensor {name!r} is quantized (packed uint32) but its "
                    f"{scales!r} tensor is missing from {self.files.model_path}"
                )
            if ref.shape != tuple(shape):
                raise CheckpointError(
                    f"{ref.file}: tensor {name!r} has shape {list(ref.shape)} but the "
                    f"config implies {list(shape)} (wrong config.json or quantization?)"
                )
            stride = ref.nbytes // num_experts
            return [
                TensorRef(
                    ref.file,
                    name,
                    ref.offset + e * stride,
                    stride,
                    ref.dtype,
                    ref.shape[1:],
                )
                for e in range(num_experts)
            ]
        raw_names = (
            [raw_key(path, e, proj, part) for e in range(num_experts)] if raw_key else []
        )
        if not raw_names or raw_names[0] not in tensors:
            looked = f" or {raw_names[0]!r}" if raw_names and raw_names[0] else ""
            raise CheckpointError(
                f"routed-expert tensor {name!r}{looked} not found in any of "
                f"{sorted(str(f.name) for f in self.files.identity)} in "
                f"{self.files.model_path} (incomplete or mismatched checkpoint?)"
            )
        out = []
        for e, raw in enumerate(raw_names):
            if raw not in tensors:
                raise CheckpointError(
                    f"routed-expert tensor {raw!r} (expert {e} of {path}) not found in "
                    f"{self.files.model_path}"
                )
            ref = tensors[raw]
            if ref.shape != tuple(shape[1:]):
                raise CheckpointError(
                    f"{ref.file}: tensor {raw!r} has shape {list(ref.shape)} but the "
                    f"config implies {list(shape[1:])}"
                )
            out.append(ref)
        return out

    def expert_names(self) -> Iterable[str]:
        """Every checkpoint tensor name the index serves (so loading can skip them)."""
        return {ref.name for layer in self.layers.values() for r in layer._refs for ref in r}
