"""The synthetic checkpoints' configs: one small config per architecture, layer counts and the
override aliases (``make_config``), quantization variants and dtypes."""

import copy
import re
from typing import Optional

import mlx.core as mx

from .families import family_configs

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


# Hybrids: recurrent or linear-attention layers (``ArraysCache``) beside attention and MoE layers.
_QWEN3_NEXT = {
    **_BASE,
    "intermediate_size": 128,
    "head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 64,
    "mlp_only_layers": [],
    "moe_intermediate_size": 64,
    "partial_rotary_factor": 0.25,
    "norm_topk_prob": True,
    # layer 1 is full attention (mlx-lm reads the mask from cache entry interval - 1)
    "full_attention_interval": 2,
}
ARCHITECTURES.update(
    {
        "qwen3_next": {**_QWEN3_NEXT, "model_type": "qwen3_next"},
        # the Qwen3.5 / 3.6 MoE wrapper on qwen3_next's sparse block, text_config as HF ships it
        "qwen3_5_moe": {
            "model_type": "qwen3_5_moe",
            "text_config": {
                **_QWEN3_NEXT,
                "model_type": "qwen3_5_moe_text",
                "rope_parameters": {
                    "type": "default",
                    "mrope_section": [2, 1, 1],
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.25,
                },
            },
        },
        # the Qwen3.5 text wrapper with routed experts (qwen3_5 builds the sparse block when
        # num_experts > 0); its sanitize stacks no experts: converted checkpoints only
        "qwen3_5": {
            "model_type": "qwen3_5",
            "text_config": {
                **_QWEN3_NEXT,
                "model_type": "qwen3_5_text",
                "rope_parameters": {
                    "type": "default",
                    "mrope_section": [2, 1, 1],
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.25,
                },
            },
        },
        # SwitchMLP experts (fc1 / fc2, relu^2); Mamba-2, attention and MoE layers by layer_types
        "nemotron_h": {
            **_BASE,
            "model_type": "nemotron_h",
            "num_hidden_layers": 4,
            "layer_types": ["mamba", "moe", "attention", "moe"],
            "intermediate_size": 128,
            "attention_bias": False,
            "head_dim": 16,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "mamba_proj_bias": False,
            "ssm_state_size": 16,
            "conv_kernel": 4,
            "n_groups": 2,
            "mlp_bias": False,
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
            "moe_intermediate_size": 64,
            "moe_shared_expert_intermediate_size": 64,
            "n_group": 1,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "topk_group": 1,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.0,
        },
    }
)

_BAILING = {
    **_BASE,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0,
    # layers 1 and 3 are global attention, 0 and 2 linear
    "layer_group_size": 2,
    "group_norm_size": 1,
    "head_dim": 16,
    "norm_topk_prob": True,
}
_MLA_SMALL = {
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
}
ARCHITECTURES.update(
    {
        # Mamba layers 0 and 2, attention 1 and 3, experts in every layer
        "jamba": {
            **_BASE,
            "model_type": "jamba",
            "num_hidden_layers": 4,
            "intermediate_size": 64,
            "attn_layer_offset": 1,
            "attn_layer_period": 2,
            "expert_layer_offset": 0,
            "expert_layer_period": 1,
            "mamba_d_conv": 4,
            "mamba_d_state": 16,
            "mamba_expand": 2,
            "mamba_dt_rank": 64,
            "num_experts": 8,
            "num_experts_per_tok": 2,
        },
        # short convolutions and attention; layer 0 dense
        "lfm2_moe": {
            **_BASE,
            "model_type": "lfm2_moe",
            "num_hidden_layers": 4,
            "intermediate_size": 128,
            "moe_intermediate_size": 64,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "use_expert_bias": True,
            "num_dense_layers": 1,
            "norm_eps": 1e-5,
            "conv_bias": False,
            "conv_L_cache": 3,
            "layer_types": ["conv", "full_attention"],
        },
        # Mamba-2 and attention layers, every one MoE (HF fuses the experts: input_linear)
        "granitemoehybrid": {
            **_BASE,
            "model_type": "granitemoehybrid",
            "intermediate_size": 64,
            "attention_bias": False,
            "embedding_multiplier": 4.0,
            "attention_multiplier": 0.0625,
            "logits_scaling": 2.0,
            "residual_multiplier": 0.5,
            "layer_types": ["mamba", "attention"],
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 64,
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_proj_bias": False,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_n_groups": 1,
            "mamba_conv_bias": True,
            "tie_word_embeddings": True,
        },
        # gated linear attention and softmax attention
        "bailing_moe_linear": {
            **_BAILING,
            "model_type": "bailing_moe_linear",
            "score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
        },
        # gated linear attention and MLA
        "bailing_hybrid": {
            **_BAILING,
            **_MLA_SMALL,
            "model_type": "bailing_hybrid",
            "num_key_value_heads": 4,
            "q_lora_rank": None,
        },
        # mlx-lm maps bailing_hybrid with this architecture to bailing_moe_v3 (KDA and MLA)
        "bailing_moe_v3": {
            **_BAILING,
            **_MLA_SMALL,
            "model_type": "bailing_hybrid",
            "architectures": ["BailingMoeV3ForCausalLM"],
            "q_lora_rank": 32,
            "short_conv_kernel_size": 4,
        },
        # Kimi delta attention in layers 0 and 2 (kda_layers count from 1), MLA in 1 and 3
        "kimi_linear": {
            **_BASE,
            **_MLA_SMALL,
            "model_type": "kimi_linear",
            "num_hidden_layers": 4,
            "num_key_value_heads": 4,
            "intermediate_size": 128,
            "head_dim": 16,
            "linear_attn_config": {
                "kda_layers": [1, 3],
                "num_heads": 4,
                "head_dim": 16,
                "short_conv_kernel_size": 4,
            },
            "model_max_length": 4096,
            "num_experts": 8,
            "moe_intermediate_size": 64,
            "num_experts_per_token": 2,
            "num_shared_experts": 1,
            "first_k_dense_replace": 1,
        },
    }
)

# Kimi K3: text_config; delta attention in layers 0 and 2, MLA in 1 and 3; layer 0 dense
ARCHITECTURES["kimi_k3"] = {
    "model_type": "kimi_k3",
    "text_config": {
        **_BASE,
        **_MLA_SMALL,
        "model_type": "kimi_linear",
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "linear_attn_config": {
            "kda_layers": [1, 3],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        "num_experts": 8,
        "moe_intermediate_size": 64,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
    },
}

# phixtral (SwitchMLP experts with biases; its own config names: model_dim, num_layers, num_vocab;
# hidden_size, vocab_size and num_hidden_layers are for the builder, which reads those)
ARCHITECTURES["phixtral"] = {
    "model_type": "phixtral",
    "num_vocab": 512,
    "model_dim": 64,
    "num_heads": 4,
    "num_layers": 2,
    "rotary_dim": 8,
    "num_experts_per_tok": 2,
    "num_local_experts": 8,
    "hidden_size": 64,
    "vocab_size": 512,
    "num_hidden_layers": 2,
}

# llama4 reads the cache of layer 3, its first global-attention layer.
_MIN_LAYERS = {"llama4": 4}
_MIN_LAYERS.update(
    {
        "nemotron_h": 4,
        "jamba": 4,
        "lfm2_moe": 4,
        "bailing_moe_linear": 4,
        "bailing_hybrid": 4,
        "bailing_moe_v3": 4,
        "kimi_linear": 4,
        "kimi_k3": 4,
    }
)

# Archs whose HF checkpoints keep fused expert tensors (no per-expert names).
_NO_HF_LAYOUT = ("granitemoe", "gpt_oss", "llama4")
# hybrids whose HF checkpoints fuse their experts (experts.gate_up_proj)
_NO_HF_LAYOUT += ("qwen3_5", "qwen3_5_moe", "granitemoehybrid")

# the families of issue 38 (synthetic/families.py)
FAMILIES = tuple(family_configs(_BASE, _DEEPSEEK_MLA, ARCHITECTURES["qwen3_moe"]))
ARCHITECTURES.update(family_configs(_BASE, _DEEPSEEK_MLA, ARCHITECTURES["qwen3_moe"]))

# families whose first layer is dense: a third layer keeps two MoE layers
_MIN_LAYERS.update(
    dict.fromkeys(
        ("afmoe", "exaone_moe", "laguna", "mimo_v2_flash", "minimax_m3_vl", "gemma4_text",
         "gemma4"),
        3,
    )
)

# Archs whose HF checkpoints keep fused expert tensors (no per-expert names).
_NO_HF_LAYOUT += (
    # issue 38: fused gate_up (gemma4, qwen3_vl_moe) or stacked under other names (step3p5)
    "gemma4_text",
    "gemma4",
    "qwen3_vl_moe",
    "step3p5",
    "kimi_vl",
)

_ALIASES = {
    "hidden": ("hidden_size",),
    "moe_intermediate": ("moe_intermediate_size", "intermediate_size"),
    "experts": (
        "num_experts",
        "num_local_experts",
        "n_routed_experts",
        "moe_num_experts",
    ),
    "top_k": ("num_experts_per_tok", "moe_k", "num_experts_per_token", "top_k_experts"),
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


# per-layer lists, repeated to the layer count
PER_LAYER_LISTS = (
    "layer_types",
    "compress_ratios",
    "is_moe_layer",
    "moe_layer_freq",
    "hybrid_layer_pattern",
    "mlp_layer_types",
    "layer_rope_theta",
)


def _fit_layers(config: dict, num_layers: int) -> None:
    """Set the layer count and stretch the per-layer fields to it."""
    text = _text(config)
    count = "num_layers" if "num_layers" in text else "num_hidden_layers"  # longcat_flash
    base = text[count]
    text[count] = num_layers
    if "first_k_dense_replace" in text:
        text["first_k_dense_replace"] = min(text["first_k_dense_replace"], max(0, num_layers - 2))
    if "moe_layers_enum" in text:  # step3p5
        text["moe_layers_enum"] = ",".join(str(i) for i in range(num_layers))
    for key in PER_LAYER_LISTS:
        if isinstance(text.get(key), list) and text[key]:
            pattern = text[key]
            text[key] = [pattern[i % len(pattern)] for i in range(num_layers)]
    for key in ("kv_source_layer_ids", "index_source_layer_ids"):
        if key in text:
            ids = set(text[key])
            text[key] = [i for i in range(num_layers) if i % base in ids]


def make_config(arch: str, num_layers: int = 2, overrides: Optional[dict] = None) -> dict:
    """The config.json dict for ``arch`` with ``num_layers`` and overrides."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"Unknown arch {arch!r}; known: {sorted(ARCHITECTURES)}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    config = copy.deepcopy(ARCHITECTURES[arch])
    layers = max(num_layers, _MIN_LAYERS.get(arch, 1))
    _fit_layers(config, layers)
    for key, value in (overrides or {}).items():
        name = _resolve_key(config, key)
        if "text_config" in config and name != "model_type":
            config["text_config"][name] = value
        else:
            config[name] = value
    if any(key in PER_LAYER_LISTS for key in overrides or {}):  # a pattern given: stretched too
        _fit_layers(config, layers)
    return config
