"""Built-in architectures. Loaded through the ``mlx_lm_streaming`` entry-point group."""

import re

from ..hookspecs import hookimpl
from .adapter import ArchitectureAdapter
from .hybrids import HYBRIDS, SWITCH_MLP

V41_PROJ = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def deepseek_v41_raw_key(path, expert, proj, part):
    """``layers.{l}.ffn.experts.{e}.w1.weight``: only unquantized weights map byte for byte (the
    published fp8/fp4 experts are repacked by sanitize, so those need mlx_lm.convert first)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.switch_mlp", path)
    if m is None or part != "weight":
        return None
    return f"layers.{m.group(1)}.ffn.experts.{expert}.{V41_PROJ[proj]}.weight"


# the config keys of the routed experts per layer and of the experts each token picks
LOCAL = {"num_experts_key": "num_local_experts"}
ROUTED = {"num_experts_key": "n_routed_experts"}

ADAPTERS = [
    # mlp.experts.{e}.{gate,up,down}_proj
    ArchitectureAdapter(("qwen2_moe", "qwen3_moe")),
    # block_sparse_moe.experts.{e}.w1/w3/w2
    ArchitectureAdapter(
        ("mixtral",),
        raw_projections={"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
        **LOCAL,
    ),
    # group-limited routing (v2), noaux_tc with n_group > 1 (v3; kimi_k2 maps to deepseek_v3)
    ArchitectureAdapter(("deepseek_v2", "deepseek_v3"), **ROUTED),
    # clipped SwiGLU lives in the SwitchGLU's own activation
    ArchitectureAdapter(("deepseek_v41",), raw_key=deepseek_v41_raw_key, **ROUTED),
]

# Generic: any mlx-lm model whose routed experts are a SwitchGLU, enabled one by one as each passes
# the parity suite (tests/test_parity.py; docs/architectures.md lists them).
MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
GENERIC = [
    ArchitectureAdapter(("olmoe",)),
    ArchitectureAdapter(("glm4_moe",), **ROUTED),
    ArchitectureAdapter(
        ("ernie4_5_moe",), num_experts_key="moe_num_experts", top_k_key="moe_k"
    ),
    ArchitectureAdapter(("phimoe", "minimax"), raw_projections=MIXTRAL_NAMES, **LOCAL),
    # Hugging Face ships these with fused expert tensors: only converted checkpoints stream
    ArchitectureAdapter(("granitemoe", "gpt_oss"), raw_key=None, **LOCAL),
    ArchitectureAdapter(("llama4",), raw_key=None, config_section="text_config", **LOCAL),
]

# issue 38: the other SwitchGLU families of mlx-lm 0.32 (hybrids with recurrent state aside). The
# raw layout is the default ``{parent}.experts.{e}.{proj}`` where HF stores experts one by one (Klear,
# afmoe and dots1 keep the SwitchGLU itself under ``experts``: the same names); raw fp8 experts that
# sanitize dequantizes are refused by the index (convert them first).
TEXT = {"config_section": "text_config"}
FAMILIES = [
    ArchitectureAdapter(
        ("Klear", "afmoe", "bailing_moe", "exaone_moe", "laguna", "mellum")
    ),
    ArchitectureAdapter(
        ("deepseek", "deepseek_v32", "dots1", "glm4_moe_lite", "mimo_v2_flash", "mistral4"),
        **ROUTED,
    ),
    # deepseek_v32's model under GLM-5's args (solar_open is glm4_moe's model itself)
    ArchitectureAdapter(("glm_moe_dsa",), **ROUTED),
    # per-layer top-k lists (moe_topk)
    ArchitectureAdapter(("hunyuan",), top_k_key="moe_topk"),
    # zero (identity) experts beside the routed ones: the router's ids past n_routed_experts
    # never reach the SwitchGLU
    ArchitectureAdapter(("longcat_flash", "longcat_flash_ngram"), top_k_key="moe_topk", **ROUTED),
    # mistral3 wraps mistral4 (or a dense llama / ministral3)
    ArchitectureAdapter(("mistral3",), **ROUTED, **TEXT),
    # kimi_k25 and kimi_vl wrap deepseek_v3's layers under language_model
    ArchitectureAdapter(("kimi_k25", "kimi_vl"), **ROUTED, **TEXT),
    ArchitectureAdapter(("minimax_m3_vl",), raw_projections=MIXTRAL_NAMES, **LOCAL, **TEXT),
    # Hugging Face ships these with fused (gate_up) or differently named stacked expert tensors:
    # only converted checkpoints stream
    ArchitectureAdapter(
        ("step3p5",), raw_key=None, num_experts_key="moe_num_experts", top_k_key="moe_top_k"
    ),
    ArchitectureAdapter(("gemma4_text",), raw_key=None, top_k_key="top_k_experts"),
    ArchitectureAdapter(("gemma4",), raw_key=None, top_k_key="top_k_experts", **TEXT),
    ArchitectureAdapter(("qwen3_vl_moe",), raw_key=None, **TEXT),
]


@hookimpl(tryfirst=True)
def register_architectures(register):
    for adapter in ADAPTERS + GENERIC + FAMILIES + HYBRIDS + SWITCH_MLP:
        register(adapter)
