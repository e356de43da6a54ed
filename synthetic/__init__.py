"""Tiny synthetic MoE checkpoints built with stock mlx-lm model classes.

Development only, not in the wheel: the test suite's and benchmarks' checkpoints, and, from a checkout
(the repository root on ``sys.path``), a model of any supported architecture to try a store or kernel
plugin on (docs/plugins.md).

No hub is needed: weights are random (seeded), the tokenizer is a small
byte-level BPE trained on a built-in corpus, and everything is written the way
``mlx_lm.convert`` writes it (``quantize_model``, ``save_config``, sharded
``model-0000X-of-0000N.safetensors`` plus ``model.safetensors.index.json``).

Usage::

    from synthetic import build_checkpoint
    path = build_checkpoint(tmp / "q3", "qwen3_moe", "affine4")
    model, tokenizer = mlx_lm.load(str(path))

    python -m synthetic OUT_DIR --arch qwen3_moe \\
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
import io
import math
import pathlib
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm import utils as mlx_utils
from mlx_lm.models.switch_layers import SwitchLinear

from mlx_lm_streaming.runtime import mlx_compat

from .configs import (
    _DTYPES,
    _LAYER_RE,
    _NO_HF_LAYOUT,
    _QUANT,
    _ROUTER_RE,
    ARCHITECTURES,
    EXTRA_VARIANTS,
    FAMILIES,
    VARIANTS,
    _text,
    make_config,
)
from .hf_layout import _hf_layout, _save_weights
from .tokenizer import _SPECIALS, build_tokenizer


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
    model_cls, args_cls = mlx_compat.model_classes()(config=config)
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
        raise ValueError(f"Unknown variant {variant!r}; known: {VARIANTS + EXTRA_VARIANTS}")
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
        prog="python -m synthetic",
        description="Build a tiny random MoE checkpoint with stock mlx-lm classes.",
    )
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="qwen3_moe", choices=sorted(ARCHITECTURES))
    parser.add_argument("--variant", default="affine4", choices=VARIANTS + EXTRA_VARIANTS)
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
