"""Built-in architectures. Loaded through the ``mlx_lm_streaming`` entry-point group."""

from ..hookspecs import hookimpl
from .adapter import ArchitectureAdapter

ADAPTERS = [
    # mlp.experts.{e}.{gate,up,down}_proj
    ArchitectureAdapter(("qwen2_moe", "qwen3_moe")),
    # block_sparse_moe.experts.{e}.w1/w3/w2
    ArchitectureAdapter(
        ("mixtral",),
        raw_projections={"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
    ),
    # group-limited routing (v2), noaux_tc with n_group > 1 (v3; kimi_k2 maps to deepseek_v3)
    ArchitectureAdapter(("deepseek_v2", "deepseek_v3")),
    # clipped SwiGLU lives in the SwitchGLU's own activation; raw v4.1 checkpoints are fp8/fp4 that
    # sanitize repacks, so only converted checkpoints stream
    ArchitectureAdapter(("deepseek_v41",), raw_key=None),
]


@hookimpl(tryfirst=True)
def register_architectures(register):
    for adapter in ADAPTERS:
        register(adapter)
