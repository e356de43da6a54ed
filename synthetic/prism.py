"""A tiny ``prism_hadamard_qwen35`` checkpoint: Qwen3.5 MoE whose packed linear layers take
Hadamard-rotated inputs (mlx-lm 0.32.1+).

Its args accept only uniform 2-bit affine quantization at group size 128 and a manifest of packed
modules, so it is built here rather than through ``build_checkpoint``'s variants: widths of 128,
every quantizable module at 2 bits (routers included), and one attention output projection packed
with a Hadamard block of 512 and random signs. The routed experts stay a (2-bit) ``SwitchGLU``.
"""

import contextlib
import copy
import io
import pathlib

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import utils as mlx_utils

QUANTIZATION = {"bits": 2, "group_size": 128, "mode": "affine"}
PACKED = "model.layers.1.self_attn.o_proj"


def prism_config(layers: int = 4) -> dict:
    from .configs import ARCHITECTURES

    text = copy.deepcopy(ARCHITECTURES["qwen3_5"]["text_config"])
    text.update(
        hidden_size=128,
        head_dim=128,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        intermediate_size=128,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        num_hidden_layers=layers,
        num_experts=16,
    )
    return {
        "model_type": "prism_hadamard_qwen35",
        "text_config": text,
        "schema_version": 1,
        "tensor_namespace": "mlx-lm-text",
        "modules": [{"path": PACKED, "embedding": False, "dtype": "float16", "block": 512}],
    }


def build_prism_checkpoint(path, seed: int = 0, layers: int = 4) -> pathlib.Path:
    """Write the checkpoint at ``path`` (2 shards, a synthetic tokenizer)."""
    from mlx_lm.models import prism_hadamard_qwen35 as prism

    from . import _randomize_routers
    from .hf_layout import _save_weights
    from .tokenizer import build_tokenizer

    config = prism_config(layers)
    mx.random.seed(seed)
    model = prism.Model(prism.ModelArgs.from_dict({**config, "quantization": QUANTIZATION}))
    _randomize_routers(model, 128)
    with contextlib.redirect_stdout(io.StringIO()):
        _, config = mlx_utils.quantize_model(
            model, config, 128, 2, mode="affine", quant_predicate=lambda path, module: True
        )
    assert config["quantization"] == QUANTIZATION, config["quantization"]
    weights = dict(tree_flatten(model.parameters()))
    packed = f"language_model.{PACKED}"
    weight = weights[f"{packed}.weight"]
    weights[f"{packed}.weight"] = mx.random.randint(0, 2**31, weight.shape).astype(mx.uint32)
    for part in ("scales", "biases"):
        shape = weights[f"{packed}.{part}"].shape
        weights[f"{packed}.{part}"] = (0.05 * mx.random.normal(shape)).astype(mx.float16)
    signs = weights[f"{packed}.signs"]
    weights[f"{packed}.signs"] = mx.where(mx.random.uniform(shape=signs.shape) < 0.5, -1.0, 1.0)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path, config["text_config"]["vocab_size"])
    _save_weights(path, weights, 2, {"total_parameters": 0})
    mlx_utils.save_config(config, config_path=path / "config.json")
    return path
