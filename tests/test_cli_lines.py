"""What a run says about itself (issue 37, items 10-12): an error raised mid-generation starts on
its own line, not glued to the text (``!mlx_lm.generate: error: ...``); a routing trace counts a
prompt's tokens as prefill however mlx-lm splits them into calls (a 2-token prompt was "50 decode,
0 prefill tokens"); the stats line says which bytes were read for the experts asked for and which
in the background."""

import json
import subprocess
import sys

import pytest
from support import BIN, clean_env, load_streaming, run

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


def _phases(trace) -> list:
    return [json.loads(line)["phase"] for line in trace.read_text().splitlines()[1:]]


def test_a_two_token_prompt_records_one_prefill_token(checkpoint, tmp_path):
    """mlx-lm prefills a 2-token prompt's first token in a call of one token, then runs the last
    with the first decode step: that call is prefill, though it has one token."""
    ckpt = checkpoint("qwen3_moe")
    trace = tmp_path / "r.jsonl"
    cmd = [BIN / "mlx_lm.generate", "--model", ckpt, "--prompt", "hi", "--ignore-chat-template"]
    run([*cmd, "--max-tokens", "5", "--streaming-experts", "--record-routing", trace], tmp_path)
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(ckpt).encode("hi")) == 2
    phases = _phases(trace)  # mlx-lm runs one step past the last token it yields
    decode = len(phases) - 1
    assert phases == ["prefill"] + ["decode"] * decode and decode >= 1, phases
    plan = [BIN / "mlx_lm_streaming", "plan", ckpt, "--routing-trace", trace, "--disk-gbps", "1"]
    assert f"({decode} decode, 1 prefill tokens;" in run(plan, tmp_path).stdout


def test_a_one_token_prefill_chunk_is_prefill(checkpoint, tmp_path):
    """A 4-token prompt in chunks of 2: calls of 2 and 1 prompt tokens, then the last prompt token
    with the first decode step; then a second prompt in the same process starts a new sequence."""
    import mlx_lm

    ckpt = checkpoint("qwen3_moe")
    trace = tmp_path / "r.jsonl"
    model, _ = load_streaming(ckpt, record_routing=str(trace))
    tokenizer = mlx_lm.utils.load_tokenizer(ckpt)
    for prompt in ([5, 6, 7, 8], [9, 10]):
        for _ in mlx_lm.stream_generate(
            model, tokenizer, prompt, max_tokens=3, prefill_step_size=2
        ):
            pass
    model.expert_streaming.close()
    rows = [json.loads(line) for line in trace.read_text().splitlines()[1:]]
    got = [(r["seq"], r["phase"]) for r in rows]
    first = [p for seq, p in got if seq == 0]
    second = [p for seq, p in got if seq == 1]
    assert first[:3] == ["prefill"] * 3 and set(first[3:]) == {"decode"}, got
    assert second[:1] == ["prefill"] and set(second[1:]) == {"decode"}, got
    assert len(first) + len(second) == len(got), got


def test_the_stats_line_splits_the_bytes_read_on_demand_and_in_the_background(checkpoint):
    """At a budget above every expert each bank fills in the background: "experts read 108,
    0.252 GB read" where 108 experts were 0.106 GB said nothing of the rest."""
    import time

    import mlx.core as mx

    from mlx_lm_streaming.runtime.options import decimal_gb
    from mlx_lm_streaming.runtime.report import stats_line

    model, _ = load_streaming(checkpoint("qwen3_moe"), expert_cache_gb=1000)
    state = model.expert_streaming
    cache = state.cache
    mx.eval(model(mx.array([[1, 2, 3]])))  # a few misses; every bank then fills itself
    deadline = time.monotonic() + 60  # wait for the fill (not a timing: it always ends)
    while time.monotonic() < deadline and not all(b.complete for b in cache.banks):
        mx.eval(model(mx.array([[4]])))
        time.sleep(0.05)
    assert all(b.complete for b in cache.banks)
    s = state.stats()
    nbytes = cache.banks[0].layer.expert_nbytes
    background = s["background_gb"] * 1e9
    assert background == sum(s["staged_experts"].values()) * nbytes > 0, s
    total = s["gb_read"] * 1e9
    line = stats_line(state)
    assert (
        f"{s['gb_read']:.3f} GB read ({decimal_gb(total - background)} on demand, "
        f"{decimal_gb(background)} in the background: lookahead, next wave, fill)"
    ) in line, line
    state.close()


def test_the_stats_line_says_how_long_the_disk_was_busy_for_the_misses(checkpoint):
    # the misses' reads held 50 ms each: the disk's busy time is the union of the reads in flight
    # (several experts of a layer read at once count once), not their sum, and at least one
    # read's length; the decode's wait is said beside it
    import time

    import mlx.core as mx

    from mlx_lm_streaming.runtime.report import stats_line

    model, _ = load_streaming(checkpoint("qwen3_moe"), expert_cache_gb=4e-5)  # 2 slots a layer
    state = model.expert_streaming
    store = state.cache.store
    spans = []
    for name in ("read_many", "read_on_this_thread"):
        inner = getattr(store, name)

        def held(jobs, inner=inner):
            start = time.perf_counter()
            time.sleep(0.05)
            inner(jobs)
            spans.append((start, time.perf_counter()))

        setattr(store, name, held)
    mx.eval(model(mx.array([[1, 2, 3, 4, 5, 6]])))  # a prompt: several experts a layer at once
    for token in (7, 8, 9):
        mx.eval(model(mx.array([[token]])))
    s = state.stats()
    busy, summed = s["miss_read_busy_seconds"], sum(b - a for a, b in spans)
    assert 0.05 <= busy <= s["span_seconds"], s
    assert busy < summed - 0.05, (busy, summed)  # reads overlapped: counted once
    line = stats_line(state)
    assert f"; misses: the disk busy {busy:.2f} s reading them, " in line, line
    assert f"the decode waiting {s['io_wait_seconds']:.2f} s for reads; " in line, line
    state.close()


def test_no_stats_line_leaks_after_the_suites_summary(tmp_path):
    """tests/run.sh ended with a stray ``[streaming] hit rate 38.5% ...`` after pytest's summary:
    test_parity's fallback test loads a model with ``stats=True`` in the suite's process. Run it
    as the suite does; its own stats line still goes out at exit outside pytest (below)."""
    from pathlib import Path

    tests = Path(__file__).parent
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += [str(tests / "test_parity.py"), "-k", "batched_and_speculative"]
    out = subprocess.run(
        cmd, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout
    assert "[streaming] hit rate" not in out.stdout + out.stderr
    # for a user, the line is printed at exit as before
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import mlx.core as mx; "
        "from support import load_streaming; from synthetic import build_checkpoint; "
        "m, _ = load_streaming(build_checkpoint(sys.argv[2], 'qwen3_moe'), stats=True); "
        "mx.eval(m(mx.array([[1, 2, 3]])))"
    )
    user = subprocess.run(
        [sys.executable, "-c", script, str(tests), str(tmp_path / "ck")],
        cwd=tests.parent, env=clean_env(), capture_output=True, text=True, timeout=300,
    )
    assert user.returncode == 0, user.stderr
    assert user.stderr.count("[streaming] hit rate") == 1, user.stderr
