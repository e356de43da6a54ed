"""Tiny synthetic MoE checkpoints built with stock mlx-lm model classes.

No hub is needed: weights are random (seeded), the tokenizer is a small
byte-level BPE trained on a built-in corpus, and everything is written the way
``mlx_lm.convert`` writes it (``quantize_model``, ``save_config``, sharded
``model-0000X-of-0000N.safetensors`` plus ``model.safetensors.index.json``).

Usage::

    from mlx_lm_streaming.synthetic import build_checkpoint
    path = build_checkpoint(tmp / "q3", "qwen3_moe", "affine4")
    model, tokenizer = mlx_lm.load(str(path))

    python -m mlx_lm_streaming.synthetic OUT_DIR --arch qwen3_moe \\
        --variant affine4 --layers 2 [--hidden N --moe-intermediate N \\
        --experts N --top-k N --vocab N --shards N --seed N --dtype bfloat16]

``build_model`` returns the unquantized (lazy) model a checkpoint starts from;
the same arguments give the same weights, so it serves as a reference.

Variants (``VARIANTS``):

- ``affine4`` / ``affine8``: group 64, 4 / 8 bits, with the model's own
  ``quant_predicate`` (e.g. qwen3_moe routers at 8 bits), like ``convert -q``.
- ``mixed``: affine, per-module bits from a predicate returning dicts: routed
  experts gate/up 4 bits, down 6 bits (layer 0 down 3 bits), attention and
  routers 8 bits, embeddings / lm_head 6 bits, the rest 4 bits. Every module
  gets its own entry in ``config["quantization"]``.
- ``mxfp4``: mode "mxfp4" (group 32, 4 bits). Model predicates still apply
  (e.g. affine 8-bit routers), as with ``convert --q-mode mxfp4``.
- ``nvfp4``: mode "nvfp4" (group 16, 4 bits), no tensor scale.
- ``float32_hf``: no quantization, in the raw Hugging Face per-expert layout
  that the architecture's ``sanitize()`` re-stacks (qwen2/3, olmoe, ernie,
  glm4_moe, deepseek v2/v3, kimi_k2: ``mlp.experts.{e}.{gate,up,down}_proj``;
  mixtral, phimoe, minimax: ``block_sparse_moe.experts.{e}.{w1,w3,w2}``;
  deepseek_v3 / kimi_k2 also get the fused ``kv_b_proj`` back; deepseek_v41
  gets DeepSeek's own names: ``layers.{l}.ffn.experts.{e}.w{1,2,3}``,
  ``attn.wq_a``, ``hc_attn_fn`` ...). Its dtype is ``dtype`` (float32 by
  default). granitemoe, gpt_oss and llama4 keep fused expert tensors in HF, so
  they raise ValueError.

``EXTRA_VARIANTS``: ``nvfp4_global`` is nvfp4 with ``global_scale=True``
(one tensor scale per expert on switch layers, recorded per path in the
config). Stock ``mlx_lm.load`` loads it, but ``gather_qmm`` with a global
scale runs only on the GPU: on the CPU backend a forward pass raises
ValueError, so it is kept out of ``VARIANTS``.

Architectures (``ARCHITECTURES``; every MoE layer uses SwitchGLU): qwen2_moe,
qwen3_moe, mixtral, deepseek_v2 (group_limited_greedy), deepseek_v3
(noaux_tc), kimi_k2 (mlx-lm maps the model_type to deepseek_v3), deepseek_v41
(clamped SwiGLU, compressed / indexed attention, hyper-connections), olmoe,
glm4_moe, phimoe, granitemoe, ernie4_5_moe, minimax, gpt_oss, llama4. Each
builds, loads with stock ``mlx_lm.load`` and runs ``mlx_lm.generate`` on the
CPU backend for every variant in ``VARIANTS`` (float32_hf where supported).
No candidate failed outright; notes:

- deepseek_v2 always builds a YaRN RoPE, so its config carries rope_scaling.
- llama4 reads the cache of layer 3, so it is built with at least 4 layers.
- Unquantized MoE layers in bfloat16 / float16 (``float32_hf`` with such a
  dtype) load but cannot run on the CPU backend: ``GatherMM`` is float32 only
  there. Quantized variants run in every dtype.

Build details:

- ``num_layers`` is the total decoder layer count. Archs with leading dense
  layers (deepseek_v3, kimi_k2, glm4_moe: ``first_k_dense_replace=1``) keep
  at least 2 MoE layers: the dense count is clamped to ``num_layers - 2`` (so
  2 layers are all MoE; 3 layers give one dense layer). Per-layer lists
  (deepseek_v41 ``compress_ratios`` and source ids, gpt_oss ``layer_types``)
  repeat their 2-layer pattern.
- Router weights are redrawn from N(0, (2 / sqrt(hidden))^2) so routing varies
  across tokens; ``e_score_correction_bias`` gets U(-0.1, 0.1).
- Parameters are cast to ``dtype`` with the model's ``cast_predicate``.
- The build stays lazy and is evaluated one tensor at a time while saving, so
  a big quantized build holds the quantized model plus about one float tensor
  (``float32_hf``: about one shard). Tensors are split in name order into
  ``shards`` files of about equal bytes, so a layer's experts (and even one
  module's weight / scales) can straddle files.

Override keys (``overrides`` dict): any raw config key (for llama4 it goes
into ``text_config``), plus these aliases resolved per architecture:

- ``hidden``: hidden_size
- ``moe_intermediate``: moe_intermediate_size, or intermediate_size where the
  experts use it (mixtral, olmoe, phimoe, granitemoe, minimax, gpt_oss,
  llama4)
- ``experts``: num_experts / num_local_experts / n_routed_experts /
  moe_num_experts
- ``top_k``: num_experts_per_tok / moe_k
- ``heads``, ``kv_heads``, ``head_dim``, ``vocab``: num_attention_heads,
  num_key_value_heads, head_dim, vocab_size

E.g. Qwen3-30B-A3B-like: ``{"hidden": 2048, "moe_intermediate": 768,
"experts": 128, "top_k": 8, "heads": 32, "kv_heads": 4, "head_dim": 128}``
(4 layers, affine4: ~50 s on 2 CPU cores, 1.6 GB peak RSS, 1.5 GB on disk).
Expert input dims must be multiples of the variant's group size (64 affine,
32 mxfp4, 16 nvfp4), else ValueError.
"""

import argparse
import contextlib
import copy
import io
import json
import math
import pathlib
import re
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm import utils as mlx_utils
from mlx_lm.models.switch_layers import SwitchLinear

from .index import natural_key

VARIANTS = ("affine4", "mixed", "affine8", "mxfp4", "nvfp4", "float32_hf")
# Builds and loads, but gather_qmm with a global scale runs only on the GPU.
EXTRA_VARIANTS = ("nvfp4_global",)

_BASE = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

_DEEPSEEK_MLA = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_layer_freq": 1,
    "rope_scaling": None,
    "attention_bias": False,
}

ARCHITECTURES: dict[str, dict] = {
    "qwen2_moe": {
        **_BASE,
        "model_type": "qwen2_moe",
        "intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
    },
    "qwen3_moe": {
        **_BASE,
        "model_type": "qwen3_moe",
        "intermediate_size": 128,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "mixtral": {
        **_BASE,
        "model_type": "mixtral",
        "intermediate_size": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "deepseek_v2": {
        **_BASE,
        **_DEEPSEEK_MLA,
        "model_type": "deepseek_v2",
        "q_lora_rank": None,
        # deepseek_v2 always builds a YaRN RoPE, so it needs rope_scaling.
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        "topk_method": "group_limited_greedy",
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 0,
    },
    "deepseek_v3": {
        **_BASE,
        **_DEEPSEEK_MLA,
        "model_type": "deepseek_v3",
        "q_lora_rank": 64,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
    },
    "kimi_k2": {
        **_BASE,
        **_DEEPSEEK_MLA,
        "model_type": "kimi_k2",
        "q_lora_rank": 64,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.827,
        "first_k_dense_replace": 1,
    },
    "deepseek_v41": {
        "model_type": "deepseek_v41",
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": 64,
        "q_lora_rank": 64,
        "qk_rope_head_dim": 16,
        "o_groups": 2,
        "o_lora_rank": 32,
        "moe_intermediate_size": 64,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-6,
        # A small window and ratio so short prompts evict rows and compress.
        "sliding_window": 8,
        "compress_ratios": [0, 4],
        "kv_source_layer_ids": [1],
        "index_source_layer_ids": [1],
        "compress_rope_theta": 160000.0,
        "candidate_source_layer_id": -1,
        "index_n_heads": 2,
        "index_head_dim": 32,
        "index_topk": 4,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
    },
    "olmoe": {
        **_BASE,
        "model_type": "olmoe",
        "intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
    },
    "glm4_moe": {
        **_BASE,
        "model_type": "glm4_moe",
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "head_dim": 16,
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "routed_scaling_factor": 2.5,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "rope_scaling": None,
        "use_qk_norm": True,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
    },
    "phimoe": {
        **_BASE,
        "model_type": "phimoe",
        "intermediate_size": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rope_scaling": None,
    },
    "granitemoe": {
        **_BASE,
        "model_type": "granitemoe",
        "intermediate_size": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "logits_scaling": 2.0,
        "attention_multiplier": 0.0625,
        "embedding_multiplier": 4.0,
        "residual_multiplier": 0.5,
        "attention_bias": False,
        "tie_word_embeddings": True,
    },
    "ernie4_5_moe": {
        **_BASE,
        "model_type": "ernie4_5_moe",
        "intermediate_size": 128,
        "head_dim": 16,
        "use_bias": False,
        "moe_num_experts": 8,
        "moe_k": 2,
        "moe_intermediate_size": 64,
        "moe_num_shared_experts": 1,
        "moe_layer_start_index": 0,
        "moe_layer_interval": 1,
        "tie_word_embeddings": True,
    },
    "minimax": {
        **_BASE,
        "model_type": "minimax",
        "intermediate_size": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 0,
        "head_dim": 16,
        "rotary_dim": 8,
        "use_qk_norm": True,
        "scoring_func": "sigmoid",
    },
    "gpt_oss": {
        **_BASE,
        "model_type": "gpt_oss",
        "intermediate_size": 64,
        "head_dim": 16,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "rope_scaling": None,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "llama4": {
        "model_type": "llama4",
        "text_config": {
            **_BASE,
            "model_type": "llama4_text",
            "num_hidden_layers": 4,
            "attention_bias": False,
            "attention_chunk_size": 8,
            "head_dim": 16,
            "interleave_moe_layer_step": 1,
            "intermediate_size": 64,
            "intermediate_size_mlp": 128,
            "num_local_experts": 8,
            "num_experts_per_tok": 1,
            "rope_scaling": None,
            "use_qk_norm": True,
        },
    },
}

# llama4 reads the cache of layer 3, its first global-attention layer.
_MIN_LAYERS = {"llama4": 4}

# Archs whose HF checkpoints keep fused expert tensors (no per-expert names).
_NO_HF_LAYOUT = ("granitemoe", "gpt_oss", "llama4")

_ALIASES = {
    "hidden": ("hidden_size",),
    "moe_intermediate": ("moe_intermediate_size", "intermediate_size"),
    "experts": (
        "num_experts",
        "num_local_experts",
        "n_routed_experts",
        "moe_num_experts",
    ),
    "top_k": ("num_experts_per_tok", "moe_k"),
    "heads": ("num_attention_heads",),
    "kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "vocab": ("vocab_size",),
}

# Quantization per variant: (group_size, bits, mode).
_QUANT = {
    "affine4": (64, 4, "affine"),
    "affine8": (64, 8, "affine"),
    "mixed": (64, 4, "affine"),
    "mxfp4": (32, 4, "mxfp4"),
    "nvfp4": (16, 4, "nvfp4"),
    "nvfp4_global": (16, 4, "nvfp4"),
}

_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}

_ROUTER_RE = re.compile(r"\.(gate|router)(\.layer)?\.weight$")
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


def _text(config: dict) -> dict:
    """The dict holding the language model fields."""
    return config.get("text_config", config)


def _resolve_key(config: dict, key: str) -> str:
    text = _text(config)
    for name in _ALIASES.get(key, ()):
        if name in text:
            return name
    if key in _ALIASES:
        return _ALIASES[key][0]
    return key


def _fit_layers(config: dict, num_layers: int) -> None:
    """Set the layer count and stretch the per-layer fields to it."""
    text = _text(config)
    base = text["num_hidden_layers"]
    text["num_hidden_layers"] = num_layers
    if "first_k_dense_replace" in text:
        text["first_k_dense_replace"] = min(
            text["first_k_dense_replace"], max(0, num_layers - 2)
        )
    for key in ("layer_types", "compress_ratios"):
        if text.get(key):
            pattern = text[key]
            text[key] = [pattern[i % len(pattern)] for i in range(num_layers)]
    for key in ("kv_source_layer_ids", "index_source_layer_ids"):
        if key in text:
            ids = set(text[key])
            text[key] = [i for i in range(num_layers) if i % base in ids]


def make_config(
    arch: str, num_layers: int = 2, overrides: Optional[dict] = None
) -> dict:
    """The config.json dict for ``arch`` with ``num_layers`` and overrides."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"Unknown arch {arch!r}; known: {sorted(ARCHITECTURES)}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    config = copy.deepcopy(ARCHITECTURES[arch])
    _fit_layers(config, max(num_layers, _MIN_LAYERS.get(arch, 1)))
    for key, value in (overrides or {}).items():
        name = _resolve_key(config, key)
        if "text_config" in config and name != "model_type":
            config["text_config"][name] = value
        else:
            config[name] = value
    return config


def _randomize_routers(model: nn.Module, hidden: int) -> None:
    """Redraw router weights so routing varies across tokens."""
    std = 2.0 / math.sqrt(hidden)

    def fn(path, v):
        if _ROUTER_RE.search(path):
            return (std * mx.random.normal(v.shape)).astype(v.dtype)
        if path.endswith("e_score_correction_bias"):
            return mx.random.uniform(-0.1, 0.1, v.shape).astype(v.dtype)
        return v

    model.update(tree_map_with_path(fn, model.parameters()))


def _cast(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast floating parameters like mlx_lm.convert does."""
    keep = getattr(model, "cast_predicate", lambda _: True)

    def fn(path, v):
        if keep(path) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(dtype)
        return v

    model.update(tree_map_with_path(fn, model.parameters()))


def _mixed_predicate(path: str, module: nn.Module):
    """Per-module bits, like the mixed_* recipes of mlx_lm.convert."""
    m = _LAYER_RE.search(path)
    layer = int(m.group(1)) if m else -1
    attention = "self_attn" in path or ".attention" in path
    if isinstance(module, SwitchLinear) and not attention:
        if path.endswith("down_proj"):
            bits = 3 if layer == 0 else 6
        else:
            bits = 4
    elif attention or path.endswith("gate") or "router" in path:
        bits = 8
    elif "embed" in path or "lm_head" in path:
        bits = 6
    else:
        bits = 4
    return {"group_size": 64, "bits": bits, "mode": "affine"}


def _quantize(model: nn.Module, config: dict, variant: str) -> dict:
    group_size, bits, mode = _QUANT[variant]
    for path, module in model.named_modules():
        if isinstance(module, SwitchLinear) and module.weight.shape[-1] % group_size:
            raise ValueError(
                f"{path} has input dim {module.weight.shape[-1]}, not a multiple "
                f"of the {variant} group size {group_size}"
            )
    # quantize_model prints the bits per weight; keep builds quiet.
    with contextlib.redirect_stdout(io.StringIO()):
        # global_scale only where asked: mlx-lm before 0.32 does not take the argument
        extra = {"global_scale": True} if variant == "nvfp4_global" else {}
        _, config = mlx_utils.quantize_model(
            model,
            config,
            group_size,
            bits,
            mode=mode,
            quant_predicate=_mixed_predicate if variant == "mixed" else None,
            **extra,
        )
    return config


# HF names of stacked experts: (mlx infix, hf infix, {mlx proj: hf proj}).
_GLU = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
_W123 = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_MLP = (".mlp.switch_mlp.", ".mlp.experts.", _GLU)
_BSM = (".block_sparse_moe.switch_mlp.", ".block_sparse_moe.experts.", _W123)
_HF_EXPERTS = {
    "qwen2_moe": _MLP,
    "qwen3_moe": _MLP,
    "olmoe": _MLP,
    "ernie4_5_moe": _MLP,
    "glm4_moe": _MLP,
    "deepseek_v2": _MLP,
    "deepseek_v3": _MLP,
    "mixtral": _BSM,
    "phimoe": _BSM,
    "minimax": _BSM,
}

# deepseek_v41: MLX name pieces back to DeepSeek's, applied in this order.
_V41_INVERSE = (
    (".shared_experts.gate_proj.", ".shared_experts.w1."),
    (".shared_experts.down_proj.", ".shared_experts.w2."),
    (".shared_experts.up_proj.", ".shared_experts.w3."),
    (".gate.e_score_correction_bias", ".gate.bias"),
    (".indexer.k_proj.", ".indexer.wk."),
    (".compressor.kv_norm.", ".compressor.norm."),
    (".q_a_norm.", ".q_norm."),
    (".o_b_proj.", ".wo_b."),
    (".o_a_proj.", ".wo_a."),
    (".gate_proj.", ".wgate."),
    (".kv_proj.", ".wkv."),
    (".q_b_proj.", ".wq_b."),
    (".q_a_proj.", ".wq_a."),
    (".sinks", ".attn_sink"),
    (".ffn_hc.", ".hc_ffn_"),
    (".attn_hc.", ".hc_attn_"),
    (".post_attention_layernorm.", ".ffn_norm."),
    (".input_layernorm.", ".attn_norm."),
    (".mlp.", ".ffn."),
    (".self_attn.", ".attn."),
)


def _family(config: dict) -> str:
    model_type = config["model_type"]
    return mlx_utils.MODEL_REMAPPING.get(model_type, model_type)


def _hf_layout(weights: dict, config: dict) -> dict:
    """Un-stack experts (and undo other sanitize renames) into the HF layout."""
    family = _family(config)
    if family == "deepseek_v41":
        return _hf_layout_v41(weights, config)
    if family not in _HF_EXPERTS:
        raise ValueError(
            f"float32_hf is not supported for {config['model_type']!r}: its HF "
            "checkpoint keeps fused expert tensors"
        )
    mlx_infix, hf_infix, projs = _HF_EXPERTS[family]
    out = {}
    for key, value in weights.items():
        if mlx_infix not in key:
            out[key] = value
            continue
        prefix, rest = key.split(mlx_infix)
        proj, kind = rest.split(".")
        if kind != "weight":
            raise ValueError(f"{family} sanitize cannot re-stack {key}")
        for e in range(value.shape[0]):
            out[f"{prefix}{hf_infix}{e}.{projs[proj]}.weight"] = value[e]
    if family == "deepseek_v3":
        _fuse_kv_b(out, config)
    return out


def _fuse_kv_b(weights: dict, config: dict) -> None:
    """Rebuild kv_b_proj from embed_q / unembed_out (deepseek_v3 sanitize)."""
    heads = config["num_attention_heads"]
    for key in [k for k in weights if k.endswith(".embed_q.weight")]:
        prefix = key[: -len(".embed_q.weight")]
        wk = weights.pop(key).swapaxes(-1, -2)
        wv = weights.pop(f"{prefix}.unembed_out.weight")
        kv_b = mx.concatenate([wk, wv], axis=1)
        weights[f"{prefix}.kv_b_proj.weight"] = kv_b.reshape(heads * kv_b.shape[1], -1)


def _hf_layout_v41(weights: dict, config: dict) -> dict:
    """DeepSeek's own names, checked against deepseek_v41's _rename."""
    from mlx_lm.models.deepseek_v41 import _EXPERT_PROJ, _rename

    projs = {v: k for k, v in _EXPERT_PROJ.items()}
    expert_re = re.compile(
        r"model\.layers\.(\d+)\.mlp\.experts\.switch_mlp\.(\w+)\.weight"
    )
    out = {}
    for key, value in weights.items():
        m = expert_re.fullmatch(key)
        if m is not None:
            layer, proj = m.groups()
            for e in range(value.shape[0]):
                out[f"layers.{layer}.ffn.experts.{e}.{projs[proj]}.weight"] = value[e]
            continue
        if key == "lm_head.weight":
            name = "head.weight"
        elif key == "model.embed_tokens.weight":
            name = "embed.weight"
        else:
            name = key.removeprefix("model.")
            for mlx_part, hf_part in _V41_INVERSE:
                name = name.replace(mlx_part, hf_part)
        if _rename(name) != key:
            raise RuntimeError(f"no DeepSeek name for {key} (got {name})")
        if key.endswith(".o_a_proj.weight"):
            # sanitize splits wo_a back into its groups.
            value = value.reshape(-1, value.shape[-1])
        out[name] = value
    return out


def _split_shards(weights: dict, shards: int) -> list:
    """Split the tensors, in name order, into shards of about equal bytes."""
    names = sorted(weights, key=natural_key)
    n = len(names)
    if not 1 <= shards <= n:
        raise ValueError(f"shards must be in [1, {n}], got {shards}")
    total = max(sum(weights[k].nbytes for k in names), 1)
    parts = [[] for _ in range(shards)]
    cum = 0
    idx = 0
    for i, name in enumerate(names):
        nbytes = weights[name].nbytes
        if i > 0:
            want = min(shards - 1, int((cum + nbytes / 2) * shards / total))
            idx = max(idx, min(want, idx + 1))
            # Leave at least one tensor for each later shard.
            if n - i - 1 < shards - 1 - idx:
                idx += 1
        parts[idx].append(name)
        cum += nbytes
    return parts


def _save_weights(path: pathlib.Path, weights: dict, shards: int, meta: dict):
    parts = _split_shards(weights, shards)
    fmt = "model-{:05d}-of-{:05d}.safetensors" if shards > 1 else "model.safetensors"
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in weights.values()), **meta},
        "weight_map": {},
    }
    for i, names in enumerate(parts):
        file_name = fmt.format(i + 1, shards)
        shard = {}
        for name in names:
            # One tensor at a time keeps the lazy build's peak memory low.
            arr = weights.pop(name)
            mx.eval(arr)
            shard[name] = arr
            index["weight_map"][name] = file_name
        mx.save_safetensors(str(path / file_name), shard, metadata={"format": "mlx"})
        del shard
    index["weight_map"] = dict(
        sorted(index["weight_map"].items(), key=lambda kv: natural_key(kv[0]))
    )
    with open(path / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=4)


_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CORPUS = [
    "hello world, this is a tiny synthetic model for testing streaming.",
    "The quick brown fox jumps over the lazy dog.",
    "Mixture of experts models route each token to a few experts.",
    "for i in range(10):\n    print('hello world', i)\n",
    "user: what is the capital of France?\nassistant: Paris.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols !@#$%^&*()",
]
# Trained vocab cap: a few merges, so prompts stay many tokens long.
_MAX_TOKENIZER_VOCAB = 300


def build_tokenizer(path, vocab_size: int) -> None:
    """Write a small byte-level BPE tokenizer with ids < ``vocab_size``."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    min_vocab = len(alphabet) + len(_SPECIALS)
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size must be >= {min_vocab}, got {vocab_size}")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, _MAX_TOKENIZER_VOCAB),
        special_tokens=_SPECIALS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    special = {
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": _CHAT_TEMPLATE,
    }
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config, f, indent=2)
    with open(path / "special_tokens_map.json", "w") as f:
        json.dump(special, f, indent=2)


def build_model(
    arch: str,
    *,
    num_layers: int = 2,
    seed: int = 0,
    overrides: Optional[dict] = None,
    dtype: str = "float32",
):
    """The unquantized model ``build_checkpoint`` starts from, and its config.

    The same arguments give the same weights, so it is a reference for
    checkpoints built with ``build_checkpoint``. The arrays are lazy.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    config = make_config(arch, num_layers, overrides)
    text = _text(config)
    text["torch_dtype"] = dtype
    text["bos_token_id"] = _SPECIALS.index("<|endoftext|>")
    text["eos_token_id"] = _SPECIALS.index("<|im_end|>")

    mx.random.seed(seed)
    model_cls, args_cls = mlx_utils._get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    _randomize_routers(model, text["hidden_size"])
    _cast(model, _DTYPES[dtype])
    return model, config


def build_checkpoint(
    path,
    arch: str,
    variant: str = "affine4",
    *,
    num_layers: int = 2,
    seed: int = 0,
    shards: int = 2,
    overrides: Optional[dict] = None,
    dtype: str = "float32",
) -> pathlib.Path:
    """Build a random ``arch`` checkpoint in ``variant`` form at ``path``."""
    if variant not in VARIANTS + EXTRA_VARIANTS:
        raise ValueError(
            f"Unknown variant {variant!r}; known: {VARIANTS + EXTRA_VARIANTS}"
        )
    if variant == "float32_hf" and arch in _NO_HF_LAYOUT:
        raise ValueError(
            f"float32_hf is not supported for {arch!r}: its HF checkpoint keeps "
            "fused expert tensors"
        )
    model, config = build_model(
        arch, num_layers=num_layers, seed=seed, overrides=overrides, dtype=dtype
    )
    if variant == "float32_hf":
        weights = _hf_layout(dict(tree_flatten(model.parameters())), config)
    else:
        config = _quantize(model, config, variant)
        weights = dict(tree_flatten(model.parameters()))
    meta = {"total_parameters": mlx_utils.get_total_parameters(model)}
    del model

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # mlx_lm.load globs model*.safetensors, so drop stale shards.
    for old in path.glob("model*.safetensors"):
        old.unlink()
    build_tokenizer(path, _text(config)["vocab_size"])
    _save_weights(path, weights, shards, meta)
    mlx_utils.save_config(config, config_path=path / "config.json")
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="Build a tiny random MoE checkpoint with stock mlx-lm classes."
    )
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="qwen3_moe", choices=sorted(ARCHITECTURES))
    parser.add_argument(
        "--variant", default="affine4", choices=VARIANTS + EXTRA_VARIANTS
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--moe-intermediate", type=int)
    parser.add_argument("--experts", type=int)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--vocab", type=int)
    args = parser.parse_args(argv)
    overrides = {
        key: getattr(args, key)
        for key in ("hidden", "moe_intermediate", "experts", "top_k", "vocab")
        if getattr(args, key) is not None
    }
    path = build_checkpoint(
        args.out_dir,
        args.arch,
        args.variant,
        num_layers=args.layers,
        seed=args.seed,
        shards=args.shards,
        overrides=overrides or None,
        dtype=args.dtype,
    )
    print(path)


if __name__ == "__main__":
    main()
