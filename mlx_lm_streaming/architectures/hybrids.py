"""Hybrid families: routed experts beside recurrent or linear-attention layers (``ArraysCache``).

The experts stream as in every other family; what is particular to these models is their cache:
the verified step puts each layer's recurrent state back as it was when a step misses
(``runtime/decode/step_caches.py``), and layer-major prefill puts it back between a layer's two runs of
a chunk, or falls back to chunk by chunk where the model makes a layer's masks from the caches
and says so (``--streaming-stats``; docs/architectures.md lists which). Each adapter says only where
the experts are and how Hugging Face names them (``raw_key=None``: HF fuses them, so only
converted checkpoints stream). ``SWITCH_MLP``: phixtral, the other family whose experts are a
``SwitchMLP``, though not a hybrid.
"""

import importlib
from dataclasses import dataclass

from ..errors import CheckpointError
from .adapter import ArchitectureAdapter


@dataclass(frozen=True)
class TextConfigAdapter(ArchitectureAdapter):
    """A wrapper model whose language model's fields sit in ``text_config`` when the checkpoint has
    one, at the top level otherwise (``ModelArgs.from_dict`` takes both: qwen3_5 / qwen3_5_moe,
    kimi_k3); the counts are checked against the language model's own args class, ``text_args``
    (``module:class`` in mlx-lm)."""

    text_args: str = "mlx_lm.models.qwen3_5:TextModelArgs"

    def check_config(self, config, args_class, path):
        module, name = self.text_args.split(":")
        text_args = getattr(importlib.import_module(module), name)
        section = config.get("text_config", config)
        if not isinstance(section, dict):
            raise CheckpointError(f"{path}: text_config must be a JSON object")
        if not section.get(self.num_experts_key):
            return  # no routed experts (a dense Qwen3.5): nothing of ours to check
        super().check_config(section, text_args, path)


# fc1 / fc2 of a SwitchMLP, as nemotron_h's sanitize stacks them from experts.{e}.up/down_proj
NEMOTRON_NAMES = {"fc1": "up_proj", "fc2": "down_proj"}
W123 = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
ROUTED = {"num_experts_key": "n_routed_experts"}


def block_sparse_moe_key(parts):
    """Kimi's raw names, ``model.layers.{l}.block_sparse_moe.experts.{e}.w1.{part}`` for each of
    ``parts`` (what the family's sanitize stacks into ``model.layers.{l}.mlp.switch_mlp``)."""

    def raw_key(path, expert, proj, part):
        parent, tail = path.rsplit(".", 1)[0], ".mlp"
        if not parent.endswith(tail) or part not in parts:
            return None
        return f"{parent[: -len(tail)]}.block_sparse_moe.experts.{expert}.{W123[proj]}.{part}"

    return raw_key


HYBRIDS = [
    # gated delta net + attention; mlp.experts.{e}.{gate,up,down}_proj
    ArchitectureAdapter(("qwen3_next",)),
    # Qwen3.5 / 3.6: qwen3_next's sparse block; HF fuses experts.gate_up_proj, and qwen3_5's
    # sanitize stacks nothing. prism_hadamard_qwen35: Qwen3.5 whose packed linear layers take
    # Hadamard-rotated inputs; its experts stay a 2-bit SwitchGLU
    TextConfigAdapter(("qwen3_5", "qwen3_5_moe", "prism_hadamard_qwen35"), raw_key=None),
    # Mamba-2 + attention + SwitchMLP experts: mixer.experts.{e}.{up,down}_proj
    ArchitectureAdapter(("nemotron_h",), raw_projections=NEMOTRON_NAMES, **ROUTED),
    # Mamba + attention: feed_forward.experts.{e}.{gate,up,down}_proj
    ArchitectureAdapter(("jamba",)),
    # short convolutions + attention: feed_forward.experts.{e}.w1/w3/w2
    ArchitectureAdapter(("lfm2_moe",), raw_projections=W123),
    # Mamba-2 + attention; HF fuses the experts (block_sparse_moe.input_linear)
    ArchitectureAdapter(("granitemoehybrid",), raw_key=None, num_experts_key="num_local_experts"),
    # gated linear attention + softmax attention / MLA; KDA + MLA (bailing_moe_v3, which mlx-lm
    # builds for bailing_hybrid checkpoints of BailingMoeV3ForCausalLM): mlp.experts.{e}.*
    ArchitectureAdapter(("bailing_moe_linear", "bailing_hybrid", "bailing_moe_v3")),
    # Kimi delta attention + MLA: block_sparse_moe.experts.{e}.w1/w3/w2
    ArchitectureAdapter(
        ("kimi_linear",),
        raw_key=block_sparse_moe_key(("weight",)),
        top_k_key="num_experts_per_token",
    ),
    # Kimi K3: delta attention + MLA, its layers returning (h, blocks); HF's int4 experts
    # (weight_packed / weight_scale, int32 viewed as uint32 by sanitize) need mlx_lm.convert
    TextConfigAdapter(
        ("kimi_k3",),
        raw_key=block_sparse_moe_key(("weight", "scales", "biases")),
        top_k_key="num_experts_per_token",
        text_args="mlx_lm.models.kimi_k3:TextArgs",
    ),
]

# not a hybrid: the other family whose experts are a SwitchMLP (fc1 / fc2 with biases, GELU);
# raw: transformer.h.{l}.moe.mlp.{e}.fc1.weight
SWITCH_MLP = [
    ArchitectureAdapter(
        ("phixtral",),
        raw_key="{parent}.mlp.{expert}.{proj}.{part}",
        num_experts_key="num_local_experts",
    ),
]
