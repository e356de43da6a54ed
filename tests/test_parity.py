"""Bit-exact parity: one runner, a table of architectures x variants.

Each checkpoint is built with stock mlx-lm classes (random weights, quantized as mlx-lm quantizes, saved
in 2 shards with an index) and loaded both stock and streaming. Logits must be exactly equal for a prompt
and 8 greedy decode steps with a KV cache, at batch 1 and batch 2, with a cache budget below one layer's
experts (evictions mid-forward, waves) and with a budget that holds every expert.
"""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_streaming.expert_cache import GB

from support import load_stock, load_streaming

ARCHS = ["qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "kimi_k2"]
VARIANTS = ["affine4", "mixed", "affine8", "mxfp4", "float32_hf"]
TABLE = [(a, v) for a in ARCHS for v in VARIANTS] + [
    ("deepseek_v41", "affine4"),
    ("deepseek_v41", "mixed"),
    ("deepseek_v41", "mxfp4"),
    ("qwen3_moe", "nvfp4"),
    ("deepseek_v3", "nvfp4"),
    ("deepseek_v41", "float32_hf"),
]
# generic SwitchGLU adapters: each architecture enabled only once it passes here
GENERIC = ["olmoe", "glm4_moe", "ernie4_5_moe", "phimoe", "minimax", "granitemoe", "gpt_oss", "llama4"]
RAW_HF = ["olmoe", "glm4_moe", "ernie4_5_moe", "phimoe", "minimax"]
TABLE += [(a, "affine4") for a in GENERIC] + [(a, "float32_hf") for a in RAW_HF]
DECODE_STEPS = 8


def small_budget_gb(model) -> float:
    """Three experts per layer: below one layer's experts, so calls evict and run in waves."""
    banks = model.expert_streaming.cache.banks
    assert all(b.num_experts > 3 for b in banks)
    return (3 * sum(b.layer.expert_nbytes for b in banks) + 0.5) / GB


def prompts(batch: int, vocab: int):
    # 24 tokens x top-k >= 64 indices at batch 2: the sorted gather path; decode is unsorted
    rows = [[(7 * i + 13 * b + 1) % vocab for i in range(24)] for b in range(batch)]
    return mx.array(rows)


def run(model, tokens, steps, by_token=False):
    """Prompt logits, then greedy decode with a KV cache; returns every step's logits. ``by_token``:
    the prompt fed one token at a time (same logits' shape; bench/cuda_parity.py)."""
    cache = make_prompt_cache(model)
    if by_token:
        logits = mx.concatenate(
            [model(tokens[:, i : i + 1], cache=cache) for i in range(tokens.shape[1])], axis=1
        )
    else:
        logits = model(tokens, cache=cache)
    out = [logits]
    for _ in range(steps):
        nxt = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
        logits = model(nxt, cache=cache)
        out.append(logits)
    mx.eval(out)
    return out


def assert_exact(stock_out, stream_out, what):
    for step, (a, b) in enumerate(zip(stock_out, stream_out)):
        assert a.dtype == b.dtype and a.shape == b.shape
        # NaNs (a random model in half precision can make them) compare equal when both have them
        assert mx.array_equal(a, b, equal_nan=True).item(), (
            f"{what}: logits differ at step {step} "
            f"(max abs diff {mx.abs(a - b).max().item()}, NaNs in stock "
            f"{mx.isnan(a).sum().item()}, in streaming {mx.isnan(b).sum().item()})"
        )


def check_parity(path, **options):
    stock, config = load_stock(path)
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    expected = {b: run(stock, prompts(b, vocab), DECODE_STEPS) for b in (1, 2)}

    full, _ = load_streaming(path, **options)
    assert not [k for k, _ in tree_flatten(full.parameters()) if "switch_mlp" in k]
    every = (full.expert_streaming.cache.total_expert_bytes + 0.5) / GB
    budgets = {"all": every, "small": small_budget_gb(full)}
    del full
    for name, budget in budgets.items():
        model, _ = load_streaming(path, expert_cache_gb=budget, **options)
        for b in (1, 2):
            got = run(model, prompts(b, vocab), DECODE_STEPS)
            assert_exact(expected[b], got, f"{path.name} {options} budget={name} batch={b}")
        cache = model.expert_streaming.cache
        banks = cache.banks
        chosen = model.expert_streaming.selector.select(banks[0], 2)
        assert chosen.name == options.get("kernel", "gather")
        if name == "small":
            assert all(bk.slots == 3 for bk in banks)
            assert cache.stats.evictions > 0
            assert cache.resident_bytes <= budget * GB
        else:
            assert all(bk.slots == bk.num_experts for bk in banks)
        assert cache.stats.misses > 0


# one architecture per family, run under every supported mlx-lm release (`-m core`, .ci/run)
CORE = {"qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "olmoe"}


def _param(arch, variant):
    marks = [pytest.mark.core] if arch in CORE and variant != "nvfp4" else []
    return pytest.param(arch, variant, marks=marks, id=f"{arch}-{variant}")


@pytest.mark.parametrize("arch,variant", [_param(a, v) for a, v in TABLE])
def test_parity(checkpoint, arch, variant):
    check_parity(checkpoint(arch, variant))


# half-precision activations and scales (quantized; CPU gather_mm is float32 only)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_parity_half_precision(checkpoint, dtype):
    check_parity(checkpoint("qwen3_moe", "affine4", dtype=dtype))


# the per-expert kernel is exact on CPU; chosen by name it must match stock too
@pytest.mark.parametrize("variant", ["affine4", "mixed", "mxfp4", "float32_hf"])
def test_parity_per_expert_kernel(checkpoint, variant):
    check_parity(checkpoint("mixtral", variant), kernel="per_expert")
