"""--streaming-trace: a Chrome trace-event timeline of reads, installs, syncs and compute."""

import json
import re
import subprocess
import time
from collections import Counter

import mlx.core as mx
import pytest
from support import (
    GB,
    clean_env,
    decode,
    expert_bytes_of_one_layer,
    generate_cmd,
    generated_text,
    load_stock,
    load_streaming,
    run,
    same,
    with_slots,
)

from mlx_lm_streaming.errors import ConfigurationError
from mlx_lm_streaming.files import timeline
from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning

KEYS = {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}
TOKENS = mx.array([[(5 * i + 3) % 512 for i in range(12)]])


@pytest.fixture(scope="module")
def q3(q3_path):
    """``q3_path`` and stock's logits for ``TOKENS``."""
    return q3_path, decode(load_stock(q3_path)[0], TOKENS)


def run_traced(path, out, slots=4, lookahead=True, **options):
    # the per-layer schedule, whose calls each sync once (verified steps: test_verified_step.py)
    tuning = CacheTuning(lookahead=lookahead, verified_steps=False)
    model = with_slots(path, slots, trace=str(out), tuning=tuning, **options)
    logits = decode(model, TOKENS)
    return model, logits


def complete_events(events):
    return [e for e in events if e["ph"] == "X"]


@pytest.mark.parametrize("direct_reads", [True, False])
def test_one_read_per_miss_and_logits_unchanged(q3, tmp_path, direct_reads):
    path, want = q3
    out = tmp_path / "t.json"
    model, got = run_traced(path, out, lookahead=False, direct_reads=direct_reads)
    assert same(want, got)
    state = model.expert_streaming
    misses = state.cache.stats.misses
    state.close()
    events = json.load(open(out))  # a closed timeline is plain JSON
    done = complete_events(events)
    for e in done:
        assert KEYS <= set(e), e
        assert e["dur"] >= 0 and e["ts"] >= 0
    reads = [e for e in done if e["name"] == "read"]
    assert misses > 0 and len(reads) == misses
    # no lookahead: read on demand, or (prefill through staging) the next wave while one computes
    assert {e["args"]["kind"] for e in reads} <= {"demand", "wave"}
    # per layer: its reads are the misses its calls counted
    layers = [e for e in done if e["name"] == "layer"]
    per_layer = Counter()
    for e in layers:
        per_layer[e["args"]["layer"]] += e["args"]["misses"]
    assert per_layer == Counter(e["args"]["layer"] for e in reads)
    assert all(e["args"]["bytes"] == state.cache.banks[0].layer.expert_nbytes for e in reads)
    # one host sync per layer call, one step per forward pass (the prompt, then 6 tokens)
    names = Counter(e["name"] for e in done)
    assert names["host sync"] == names["layer"] == 3 * 7
    steps = [e["args"]["phase"] for e in done if e["cat"] == "step"]
    assert steps == ["prefill"] + ["decode"] * 6
    if not direct_reads:
        assert names["install"] > 0
    else:
        assert names["submit"] > 0
    # every thread that recorded something is named
    named = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {e["tid"] for e in done} <= named


def test_background_reads_are_on_the_timeline(q3, tmp_path):
    """Every expert fits: the fill thread reads the rest of each layer in the background. Once every
    layer is complete, each expert of each layer was read exactly once, on whichever thread."""
    path, want = q3
    out = tmp_path / "t.json"
    model, got = run_traced(path, out, slots=16)
    assert same(want, got)
    state = model.expert_streaming
    deadline = time.monotonic() + 60
    while not all(b.complete for b in state.cache.banks):
        assert time.monotonic() < deadline, "the fill did not complete the banks"
        mx.eval(model(TOKENS[:, :1]))  # installs what the fill read
        time.sleep(0.01)
    misses = state.cache.stats.misses
    state.close()
    reads = [e for e in json.load(open(out)) if e["name"] == "read"]
    read = Counter((e["args"]["layer"], e["args"]["expert"]) for e in reads)
    twice = [k for k, n in read.items() if n > 1]
    assert set(read.values()) == {1}, [
        e for e in reads if (e["args"]["layer"], e["args"]["expert"]) in twice
    ]
    assert set(read) == {(b.path, e) for b in state.cache.banks for e in range(16)}
    kinds = Counter(e["args"]["kind"] for e in reads)
    assert kinds["fill"] > 0 and kinds["demand"] <= misses
    assert set(kinds) <= {"demand", "fill", "lookahead"}


def test_an_unclosed_timeline_is_readable_once_flushed(q3, tmp_path, monkeypatch):
    """A run that never closes its timeline (killed) leaves the events written so far: the JSON Array
    form without its closing bracket, which the viewers accept."""
    monkeypatch.setattr(timeline, "FLUSH_SECONDS", 0.0)
    path, _ = q3
    out = tmp_path / "t.json"
    model, _ = run_traced(path, out, lookahead=False)
    misses = model.expert_streaming.cache.stats.misses
    text = out.read_text()
    assert not text.rstrip().endswith("]")
    events = json.loads(text + "]")
    assert sum(e["name"] == "read" for e in events) == misses
    model.expert_streaming.close()


def test_nothing_is_recorded_without_the_option(q3, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path, want = q3
    model = with_slots(path, 4)
    assert not model.expert_streaming.cache.timeline  # (the null one: records nothing)
    assert same(want, decode(model, TOKENS))
    model.expert_streaming.close()
    assert list(tmp_path.iterdir()) == []


def test_the_option_must_be_a_path(q3, tmp_path):
    path, _ = q3
    with pytest.raises(ConfigurationError, match="trace must be a file path"):
        load_streaming(path, trace=5)
    bad = tmp_path / "missing-dir" / "t.json"
    with pytest.raises(ConfigurationError, match=f"{bad}: cannot write the timeline"):
        load_streaming(path, trace=str(bad))


def test_the_flag_and_env_var(checkpoint, stock_text, tmp_path, require_hook):
    ckpt = checkpoint("qwen3_moe")
    flag, var = tmp_path / "flag.json", tmp_path / "env.json"
    # half of the experts of its two MoE layers: misses, so host syncs, on every token
    gb = f"{expert_bytes_of_one_layer(ckpt) / GB:.9f}"
    stream = ["--streaming-experts", "--expert-cache-gb", gb]
    runs = [
        (generate_cmd(ckpt, *stream, "--streaming-trace", flag), {}),
        (
            generate_cmd(ckpt),
            {
                "MLX_LM_STREAMING_EXPERTS": "1",
                "MLX_LM_STREAMING_CACHE_GB": gb,
                "MLX_LM_STREAMING_TRACE": str(var),
            },
        ),
    ]
    for cmd, extra in runs:
        out = run(cmd, tmp_path, env=clean_env(**extra))
        assert generated_text(out.stdout) == stock_text("qwen3_moe")
    for file in (flag, var):
        events = json.load(open(file))
        names = Counter(e["name"] for e in events)
        assert names["read"] > 0 and names["host sync"] > 0 and names["decode"] > 0
    # no file without the flag
    quiet = tmp_path / "quiet"
    quiet.mkdir()
    run(generate_cmd(ckpt, *stream), quiet, env=clean_env())
    assert list(quiet.iterdir()) == []


def test_an_unwritable_file_is_refused_naming_the_flag(checkpoint, tmp_path):
    bad = tmp_path / "missing-dir" / "t.json"
    cmd = generate_cmd(checkpoint("qwen3_moe"), "--streaming-experts", "--streaming-trace", bad)
    done = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, env=clean_env(), timeout=120
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"argument --streaming-trace: {bad}: cannot write" in done.stderr.splitlines()[-1]


def test_every_event_a_run_writes_is_in_the_usage_table(q3, tmp_path):
    """docs/usage.md's event table lacked the ``verify`` events a file holds (issue 45, item 13):
    a run with verified steps that miss, and one with per-layer calls, name only events the
    table lists."""
    from pathlib import Path

    usage = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    table = usage.split("| event | category | what |", 1)[1].split("\n\n", 1)[0]
    rows = table.splitlines()[2:]
    listed = {n for row in rows for n in re.findall(r"`([^`]+)`", row.split("|")[1])}
    path, want = q3
    names, categories = set(), {}
    for verified in (True, False):
        out = tmp_path / f"t{verified}.json"
        tuning = CacheTuning(verified_steps=verified)
        model = with_slots(path, 3, trace=str(out), tuning=tuning)
        assert same(want, decode(model, TOKENS))
        model.expert_streaming.close()
        for e in complete_events(json.load(open(out))):
            names.add(e["name"])
            categories.setdefault(e["name"], set()).add(e["cat"])
    assert {"verify", "verify load", "host sync"} <= names, names
    assert names <= listed, f"events not in docs/usage.md's table: {sorted(names - listed)}"
    for name in names:  # each row names its category
        row = next(r for r in rows if f"`{name}`" in r.split("|")[1])
        assert all(f"`{c}`" in row.split("|")[2] for c in categories[name]), (name, row)
