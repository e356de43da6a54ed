"""Bit-exact parity for the hybrid families (recurrent or linear-attention state in ``ArraysCache``
entries beside attention and MoE layers) and for ``SwitchMLP`` experts (nemotron_h): the runner of
test_parity.py (prompt and decode log-probs equal to stock; batch 1 and 2; a budget of three
experts per layer and one holding every expert), from converted checkpoints and, where Hugging Face
stores experts one by one, from the raw layout."""

import pytest
from test_parity import check_parity

# converted checkpoints
HYBRIDS = ["qwen3_next", "qwen3_5_moe", "nemotron_h"]
# raw Hugging Face layouts that store experts one by one (qwen3_5_moe fuses them: converted only)
RAW_HF = ["qwen3_next", "nemotron_h"]
TABLE = [(a, "affine4") for a in HYBRIDS] + [(a, "float32_hf") for a in RAW_HF]


@pytest.mark.parametrize("arch,variant", TABLE, ids=[f"{a}-{v}" for a, v in TABLE])
def test_parity_hybrid(checkpoint, arch, variant):
    check_parity(checkpoint(arch, variant))


@pytest.mark.parametrize("variant", ["mixed", "mxfp4"])
def test_parity_switch_mlp_quantized(checkpoint, variant):
    # fc1 / fc2 at other bits and modes (mixed: per-module bits) through the same gather kernel
    check_parity(checkpoint("nemotron_h", variant))
