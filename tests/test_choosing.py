"""Choosing a budget: what a load says it chose, what ``--streaming-stats`` reports, and the table of
budgets that ``mlx_lm_streaming plan --routing-trace`` prints (docs/usage.md, "Choosing a budget").

The commands run as subprocesses of the installed package, as users run them.
"""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support import (
    GB,
    clean_env,
    generate_cmd,
    load_streaming,
    one_error_line,
    per_slot,
    run,
    run_cli,
)

from mlx_lm_streaming.runtime.sizes import gb_as_given
from mlx_lm_streaming.runtime.policy import DEFAULT_POLICY
from mlx_lm_streaming.tools.replay import replay
from mlx_lm_streaming.files.routing_trace import TraceWriter, read_trace

pytestmark = pytest.mark.usefixtures("require_hook")

CHOICE = re.compile(
    r"^\[streaming\] (\S+): expert cache ([\d.e+-]+) GB \((.*)\), (\d+) of (\d+) experts per "
    r"layer.* in (\d+) MoE layers, resident weights ([\d.e+-]+) GB(?:; long prompts [^\n]*)?$",
    re.M,
)
SPLIT = re.compile(
    r"; ([\d.]+) s from first to last expert request: ([\d.]+) s waiting for reads, ([\d.]+) s "
    r"copying into the cache, ([\d.]+) s everything else$",
    re.M,
)
PLAN = [sys.executable, "-m", "mlx_lm_streaming", "plan"]


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("qwen3_moe")  # 2 MoE layers x 8 experts


def test_generate_says_the_budget_it_chose_and_reports_per_layer(ckpt, tmp_path):
    probe, _ = load_streaming(ckpt)
    one = per_slot(probe)
    budget = 3 * one / GB + 1e-12  # 3 slots per layer (the flag counts decimal GB)
    cmd = generate_cmd(ckpt, "--streaming-experts", "--expert-cache-gb", repr(budget))
    out = run(cmd + ["--streaming-stats", "layers"], tmp_path)
    (choice,) = CHOICE.findall(out.stderr)
    name, gb, how, slots, experts, layers, _ = choice
    assert (name, slots, experts, layers) == (ckpt.name, "3", "8", "2")
    assert how == f"given {gb_as_given(budget)} GB"
    assert float(gb) == pytest.approx(budget * GB / 1e9, rel=1e-2)  # decimal GB
    # the choice comes before the text, the stats after it
    assert out.stderr.index("expert cache") < out.stderr.index("hit rate")
    stats = [line for line in out.stderr.splitlines() if "experts read" in line]
    assert len(stats) == 1 and "nan" not in stats[0]
    read = int(re.search(r"experts read (\d+)", stats[0]).group(1))
    span, wait, install, other = map(float, SPLIT.search(stats[0]).groups())
    assert span > 0 and wait + install + other == pytest.approx(span, abs=0.02)
    # one table row per MoE layer; their misses add up to the experts read
    rows = re.findall(
        r"^\[streaming\]\s+(\S*switch_mlp)\s+(\d+)\s+\S+\s+(\d+)\s+[\d.]+$", out.stderr, re.M
    )
    assert [r[1] for r in rows] == ["3", "3"], out.stderr
    assert sum(int(r[2]) for r in rows) == read > 0


def test_the_default_budget_names_the_free_memory_it_came_from(ckpt, tmp_path):
    env = clean_env(MLX_LM_STREAMING_EXPERTS="1", MLX_LM_STREAMING_STATS="layers")
    out = run(generate_cmd(ckpt), tmp_path, env=env)
    (choice,) = CHOICE.findall(out.stderr)
    assert re.fullmatch(
        r"default: 50% of the [\d.]+ GB of memory that the resident weights leave free, capped at "
        r"every "
        r"expert",
        choice[2],
    ), choice
    assert choice[3] == "8"  # a tiny model: every expert fits
    assert "model.layers.1.mlp.switch_mlp" in out.stderr  # the table, asked for by the variable


def test_a_bad_stats_value_is_one_line(ckpt, tmp_path):
    cmd = generate_cmd(ckpt, "--streaming-experts", "--streaming-stats", "everything")
    one_error_line(run_cli(cmd, tmp_path), "--streaming-stats", "'everything'", "layers")


def test_the_python_api_is_quiet_unless_asked(ckpt, capfd):
    import mlx_lm_streaming

    mlx_lm_streaming.load(str(ckpt))
    assert "[streaming]" not in capfd.readouterr().err
    mlx_lm_streaming.load(str(ckpt), verbose=True)
    assert len(CHOICE.findall(capfd.readouterr().err)) == 1


def test_stats_keys_and_layers_are_counted(ckpt):
    import mlx.core as mx

    model, _ = load_streaming(ckpt, expert_cache_gb=2 * per_slot(load_streaming(ckpt)[0]) / GB)
    model(mx.array([[1, 2, 3, 4, 5, 6]]))
    s = model.expert_streaming.stats()
    layers = s["per_layer"]
    assert [layer["slots"] for layer in layers] == [2, 2]
    assert sum(layer["misses"] for layer in layers) == s["misses"]
    assert sum(layer["hits"] for layer in layers) == s["hits"]
    nbytes = model.expert_streaming.cache.banks[0].layer.expert_nbytes
    assert layers[0]["gb_read"] == pytest.approx(layers[0]["misses"] * nbytes / 1e9)


def test_every_stats_key_is_documented(ckpt):
    import mlx.core as mx

    model, _ = load_streaming(ckpt, expert_cache_gb=2 * per_slot(load_streaming(ckpt)[0]) / GB)
    model(mx.array([[1, 2, 3]]))
    s = model.expert_streaming.stats()
    docs = (Path(__file__).parents[1] / "docs" / "usage.md").read_text()
    keys = set(s) | set(s["per_layer"][0])
    missing = sorted(k for k in keys if f"`{k}`" not in docs)
    assert not missing, f"stats() keys not in docs/usage.md: {missing}"


# -- plan ----------------------------------------------------------------------------------------


def zipf_trace(path, tokens=48, seed=0):
    """2 MoE layers x 8 experts, top 2, Zipf-like favourites: hit rates grow with the budget."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, 9)
    with TraceWriter(path, 2, 8, 2, model="synthetic") as writer:
        for t in range(tokens):
            rows = [rng.choice(8, 2, replace=False, p=weights / weights.sum()) for _ in range(2)]
            writer.token(0, "prefill" if t < 8 else "decode", rows)
    return path


def plan(*args, cwd, env=None):
    return run_cli([*PLAN, *map(str, args)], cwd, env=clean_env(**(env or {})))


def table_rows(stdout):
    """budget label -> (GB, slots, memory GB, hit rate %, GB/token, tok/s)."""
    rows = {}
    for line in stdout.splitlines():
        m = re.match(
            r"^(default|given|\d+%)\s+([\d.e+-]+)\s+(\d+(?:; \d+ layers? gets? \d+)?)\s+([\d.e+-]+)\s+"
            r"([\d.]+)%\s+([\d.e+-]+)\s+(no reads|[\d.e+-]+)$",
            line,
        )
        if m:
            rows[m.group(1)] = m.groups()[1:]
    return rows


def test_plan_without_a_trace_says_the_minimum_and_how_to_record_one(ckpt, tmp_path):
    out = plan(ckpt, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "minimum budget, one expert per MoE layer:" in out.stdout
    assert "default budget:" in out.stdout
    assert "each miss reads one expert:" in out.stdout
    assert "--record-routing" in out.stdout and "--routing-trace" in out.stdout
    assert " MB" not in out.stdout and " KB" not in out.stdout  # decimal GB only


def test_plan_table_replays_the_trace_at_each_budget(ckpt, tmp_path):
    trace_path = zipf_trace(tmp_path / "t.jsonl")
    probe, _ = load_streaming(ckpt)
    banks = probe.expert_streaming.cache.banks
    one = per_slot(probe)
    given = 3 * one / GB + 1e-12
    png = tmp_path / "plot.png"
    args = ["--routing-trace", trace_path, "--expert-cache-gb", repr(given), "--disk-gbps", "2"]
    try:
        import matplotlib  # noqa: F401

        args += ["--plot", png]
    except ImportError:
        pass
    out = plan(ckpt, *args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = table_rows(out.stdout)
    assert {"default", "given", "100%"} <= set(rows), out.stdout
    trace = read_trace(trace_path)
    for label, slots in (("given", 3), ("100%", 8)):
        want = replay(trace, slots, DEFAULT_POLICY)
        read = sum(m * b.layer.expert_nbytes for m, b in zip(want.decode_misses, banks))
        per_token = read / want.decode_tokens / 1e9
        row = rows[label]
        assert row[1] == str(slots)
        assert float(row[3]) == pytest.approx(100 * want.hit_rate("decode"), abs=0.06)
        assert float(row[4]) == pytest.approx(per_token, rel=1e-2)
        if per_token:
            assert float(row[5]) == pytest.approx(2 / per_token, rel=1e-2)
        else:
            assert row[5] == "no reads"
    # more budget never hits less, on this trace
    rates = [float(r[3]) for k, r in rows.items() if k.endswith("%")]
    assert rates == sorted(rates)
    if "--plot" in args:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_measures_the_disk_when_not_told(ckpt, tmp_path):
    out = plan(ckpt, "--routing-trace", zipf_trace(tmp_path / "t.jsonl"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    m = re.search(
        r"^disk: ([\d.e+-]+) GB/s, measured by reading ([\d.e+-]+) GB .* in ([\d.]+) s",
        out.stdout,
        re.M,
    )
    assert m, out.stdout
    gbps = float(m.group(1))
    assert gbps > 0 and float(m.group(2)) > 0
    for row in table_rows(out.stdout).values():
        if row[5] != "no reads":
            assert float(row[5]) == pytest.approx(gbps / float(row[4]), rel=0.02)


def test_plan_with_a_trace_and_a_budget_below_the_minimum_names_the_minimum(ckpt, tmp_path):
    trace_path = zipf_trace(tmp_path / "t.jsonl")
    out = plan(ckpt, "--routing-trace", trace_path, "--expert-cache-gb", "1e-9", cwd=tmp_path)
    line = one_error_line(out, "below the minimum of one expert per MoE layer", "at least")
    assert "Traceback" not in out.stderr, line


def test_plot_without_matplotlib_is_a_one_line_hint(ckpt, tmp_path):
    blocker = tmp_path / "block" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('blocked for this test')\n")
    trace_path = zipf_trace(tmp_path / "t.jsonl")
    env = {"PYTHONPATH": str(blocker.parent)}
    out = plan(
        ckpt, "--routing-trace", trace_path, "--plot", tmp_path / "p.png", cwd=tmp_path, env=env
    )
    line = one_error_line(out, "--plot needs matplotlib", "-m pip install matplotlib")
    # the command it gives works from a checkout as from an index (the package is not published:
    # `pip install 'mlx-lm-streaming[plot]'` failed): here, where matplotlib is installed and only
    # blocked for the command, it finds it there, with no index asked
    command = shlex.split(line.split("needs matplotlib: ", 1)[1].split(" (", 1)[0])
    assert command[0] == sys.executable, line
    done = subprocess.run(command + ["--no-index"], capture_output=True, text=True)
    assert done.returncode == 0 and "already satisfied" in done.stdout, done.stdout + done.stderr
    out = plan(ckpt, "--plot", tmp_path / "p.png", cwd=tmp_path)
    one_error_line(out, "--plot needs --routing-trace")
