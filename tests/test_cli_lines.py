"""What the commands print around a run (issue 37, items 10-12): an error raised mid-generation
starts on its own line, not glued to the text (``!mlx_lm.generate: error: ...``)."""

import subprocess
import sys

import pytest
from support import clean_env, load_streaming

from mlx_lm_streaming.runtime.options import gb_at_least

pytestmark = pytest.mark.usefixtures("require_hook")

# mlx_lm.generate, with the store failing after LIMIT reads (a disk that goes away mid-run)
FAILING_GENERATE = """
import importlib, sys
from mlx_lm_streaming.errors import ExpertIOError
from mlx_lm_streaming.stores.safetensors import SafetensorsStore
calls = [0]
LIMIT = int(sys.argv.pop(1))
for name in ("read_many", "read_on_this_thread", "read_into"):
    stock = getattr(SafetensorsStore, name)
    def failing(self, *a, _stock=stock, **k):
        calls[0] += 1
        if calls[0] > LIMIT:
            raise ExpertIOError("the disk went away")
        return _stock(self, *a, **k)
    setattr(SafetensorsStore, name, failing)
sys.argv[0] = "mlx_lm.generate"
sys.exit(importlib.import_module("mlx_lm.generate").main())
"""


def one_slot(ckpt) -> str:
    """The budget of one expert per MoE layer."""
    model, _ = load_streaming(ckpt)
    state = model.expert_streaming
    per_slot = sum(b.layer.expert_nbytes for b in state.cache.banks)
    state.close()
    return gb_at_least(per_slot)


def test_an_error_mid_generation_starts_on_its_own_line(checkpoint, tmp_path):
    ckpt = checkpoint("qwen3_moe")
    cmd = [sys.executable, "-c", FAILING_GENERATE, "40", "--model", ckpt, "--prompt", "hi"]
    # the smallest budget: one slot per layer, so decode keeps reading
    cmd += ["--max-tokens", "30", "--streaming-experts", "--expert-cache-gb", one_slot(ckpt)]
    # stdout and stderr on one stream, as on a terminal
    out = subprocess.run(
        [str(c) for c in cmd], cwd=tmp_path, env=clean_env(), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
    )
    assert out.returncode == 1, out.stdout
    assert "Traceback" not in out.stdout, out.stdout
    error = [line for line in out.stdout.splitlines() if "error:" in line]
    assert error == ["mlx_lm.generate: error: the disk went away"], out.stdout
    # some text was generated before it
    text = out.stdout.split("==========\n", 1)[1].split("mlx_lm.generate: error:")[0]
    assert text.strip(), out.stdout
