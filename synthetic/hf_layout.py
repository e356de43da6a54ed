"""The raw Hugging Face per-expert layout (``float32_hf``) and the sharded safetensors writer."""

import json
import pathlib
import re

import mlx.core as mx
from mlx_lm import utils as mlx_utils

from mlx_lm_streaming.runtime.reads.index import natural_key

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
    # issue 38's families (synthetic/families.py)
    **dict.fromkeys(
        (
            "bailing_moe",
            "deepseek",
            "deepseek_v32",
            "exaone_moe",
            "glm4_moe_lite",
            "hunyuan",
            "laguna",
            "longcat_flash",
            "mellum",
            "mimo_v2_flash",
            "mistral4",
            "mistral3",
            "kimi_k25",
            "glm_moe_dsa",
            "solar_open",
            "longcat_flash_ngram",
        ),
        _MLP,
    ),
    # the SwitchGLU itself sits under ``experts``
    **dict.fromkeys(("Klear", "afmoe", "dots1"), (".mlp.experts.", ".mlp.experts.", _GLU)),
    "minimax_m3_vl": _BSM,
}
# hybrids (SwitchMLP: nemotron_h's sanitize stacks experts.{e}.up_proj / down_proj into fc1 / fc2)
_HF_EXPERTS.update(
    {
        "qwen3_next": _MLP,
        "jamba": (".feed_forward.switch_mlp.", ".feed_forward.experts.", _GLU),
        "lfm2_moe": (".feed_forward.switch_mlp.", ".feed_forward.experts.", _W123),
        "bailing_moe_linear": _MLP,
        "bailing_hybrid": _MLP,
        "bailing_moe_v3": _MLP,
        # the rest of the layer keeps mlx-lm's names, which sanitize leaves as they are
        "kimi_linear": (".mlp.switch_mlp.", ".block_sparse_moe.experts.", _W123),
        "kimi_k3": (".mlp.switch_mlp.", ".block_sparse_moe.experts.", _W123),
        "phixtral": (".moe.switch_mlp.", ".moe.mlp.", {"fc1": "fc1", "fc2": "fc2"}),
        "nemotron_h": (
            ".mixer.switch_mlp.",
            ".mixer.experts.",
            {"fc1": "up_proj", "fc2": "down_proj"},
        ),
    }
)
# the expert tensors a family's sanitize stacks besides ``weight``
_HF_PARTS = {"phixtral": ("weight", "bias")}
# qwen3_next's sanitize adds 1 to these norms of a raw checkpoint (HF stores them zero-centred)
_PLUS_ONE_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
# families whose sanitize absorbs kv_b_proj into embed_q / unembed_out (MLA), as deepseek_v3's
_KV_B = (
    "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "mistral4", "mistral3", "kimi_k25",
    "glm_moe_dsa",
)  # fmt: skip

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
        if kind not in _HF_PARTS.get(family, ("weight",)):
            raise ValueError(f"{family} sanitize cannot re-stack {key}")
        for e in range(value.shape[0]):
            out[f"{prefix}{hf_infix}{e}.{projs[proj]}.{kind}"] = value[e]
    if family in _KV_B:
        _fuse_kv_b(out, config.get("text_config", config))
    if family == "qwen3_next":
        for key in [k for k in out if k.endswith(_PLUS_ONE_NORMS) and out[k].ndim == 1]:
            out[key] = out[key] - 1.0
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
    """DeepSeek's own names (stock ``sanitize`` maps them back: tests/test_synthetic.py loads every
    ``float32_hf`` checkpoint with stock mlx-lm and compares each weight)."""
    expert_re = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.switch_mlp\.(\w+)\.weight")
    out = {}
    for key, value in weights.items():
        m = expert_re.fullmatch(key)
        if m is not None:
            layer, proj = m.groups()
            for e in range(value.shape[0]):
                out[f"layers.{layer}.ffn.experts.{e}.{_W123[proj]}.weight"] = value[e]
            continue
        if key == "lm_head.weight":
            name = "head.weight"
        elif key == "model.embed_tokens.weight":
            name = "embed.weight"
        else:
            name = key.removeprefix("model.")
            for mlx_part, hf_part in _V41_INVERSE:
                name = name.replace(mlx_part, hf_part)
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
