"""bench/routing_replay.py: a routing trace replayed through stock and streaming models alike."""

import subprocess
import sys
from pathlib import Path

import pytest
from support import load_stock

from mlx_lm_streaming.routing_trace import TraceError, TraceWriter, read_trace
from mlx_lm_streaming.synthetic import build_checkpoint

ROOT = Path(__file__).resolve().parent.parent
REPLAY = ROOT / "bench" / "routing_replay.py"
TRACES = ROOT / "tests" / "data" / "routing"


def replay(*args):
    return subprocess.run(
        [sys.executable, REPLAY, "--check", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "trace", [None, pytest.param("qwen3-30b-a3b.jsonl", marks=pytest.mark.slow)]
)
def test_stock_and_streaming_replay_the_trace_exactly(trace, tmp_path):
    """Tiny models with the trace's MoE layer and expert counts (48 x 128 for the Qwen3 trace), 3 slots
    per layer: logits equal bit for bit, and the ids the streaming layers were called with (recorded
    by --record-routing) are the trace's, past its end too."""
    args = ["--workdir", tmp_path] + (["--trace", TRACES / trace] if trace else [])
    done = replay(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "logits exact; streaming routing is the trace" in done.stdout


def test_a_trace_of_other_layer_counts_is_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    with TraceWriter(bad, 3, 8, 2) as w:
        w.token(0, "decode", [[0, 1], [2, 3], [4, 5]])
    model, _ = load_stock(build_checkpoint(tmp_path / "c", "qwen3_moe", "affine4"))  # 2 x 8
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import routing_replay
    finally:
        sys.path.remove(str(ROOT / "bench"))
    with pytest.raises(TraceError, match="has 3 MoE layers x 8 experts but the model has 2 x 8"):
        routing_replay.TraceRouting(read_trace(bad)).wrap(model)
