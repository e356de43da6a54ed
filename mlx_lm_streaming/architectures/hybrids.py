"""Hybrid families: routed experts beside recurrent or linear-attention layers (``ArraysCache``).

The experts stream as in every other family; what is particular to these models is their cache:
the verified step puts each layer's recurrent state back as it was when a step misses
(``runtime/verified_step.py``), and layer-major prefill, which runs a layer twice per chunk, falls
back to chunk by chunk for them and says so (``--streaming-stats``). Each adapter says only where
the experts are and how Hugging Face names them (``raw_key=None``: HF fuses them, so only
converted checkpoints stream).
"""

from ..errors import CheckpointError
from .adapter import ArchitectureAdapter


class TextConfigAdapter(ArchitectureAdapter):
    """A wrapper model whose language model's fields sit in ``text_config`` when the checkpoint has
    one, at the top level otherwise (qwen3_5 / qwen3_5_moe: ``ModelArgs.from_dict`` takes both);
    the counts are checked against the language model's own args class."""

    def check_config(self, config, args_class, path):
        from mlx_lm.models.qwen3_5 import TextModelArgs

        section = config.get("text_config", config)
        if not isinstance(section, dict):
            raise CheckpointError(f"{path}: text_config must be a JSON object")
        if section.get(self.num_experts_key, 0) == 0:
            return  # no routed experts (a dense Qwen3.5): nothing of ours to check
        super().check_config(section, TextModelArgs, path)


# fc1 / fc2 of a SwitchMLP, as nemotron_h's sanitize stacks them from experts.{e}.up/down_proj
NEMOTRON_NAMES = {"fc1": "up_proj", "fc2": "down_proj"}
ROUTED = {"num_experts_key": "n_routed_experts"}

HYBRIDS = [
    # gated delta net + attention; mlp.experts.{e}.{gate,up,down}_proj
    ArchitectureAdapter(("qwen3_next",)),
    # Qwen3.5 / 3.6: qwen3_next's sparse block; HF fuses experts.gate_up_proj, and qwen3_5's
    # sanitize stacks nothing
    TextConfigAdapter(("qwen3_5", "qwen3_5_moe"), raw_key=None),
    # Mamba-2 + attention + SwitchMLP experts: mixer.experts.{e}.{up,down}_proj
    ArchitectureAdapter(("nemotron_h",), raw_projections=NEMOTRON_NAMES, **ROUTED),
]
