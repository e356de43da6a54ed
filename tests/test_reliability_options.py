"""The smaller items of issue 21 (item 5) and its one unit (item 3), each with a test that failed
before: plot naming, a trace without decode tokens, a foreign pack, budget bounds, ``verify --steps``,
empty paths, option variables without streaming, ``MLX_LM_STREAMING_HOOK`` values, the pack progress,
``--version``; and decimal GB on every line. In this process where the behaviour is not the
command line's own.
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import mlx_lm.utils
import pytest
from support import load_streaming

from mlx_lm_streaming.__main__ import main as cli
from mlx_lm_streaming.errors import CheckpointError, ConfigurationError
from mlx_lm_streaming.files.routing_trace import TraceWriter
from mlx_lm_streaming.integration import cli as command_line
from mlx_lm_streaming.runtime.memory import report
from mlx_lm_streaming.runtime.options import StreamingOptions
from mlx_lm_streaming.runtime.sizes import decimal_gb
from synthetic import build_checkpoint

OTHER_UNITS = re.compile(r"\d ?(B|KB|MB|KiB|MiB|GiB)\b|2\*\*30|GiB")


def run_cli(argv, capsys):
    """``mlx_lm_streaming ARGV`` in this process: (exit status, stdout, stderr lines)."""
    try:
        status = cli([str(a) for a in argv])
    except SystemExit as e:
        status = e.code
    out = capsys.readouterr()
    return status, out.out, out.err.splitlines()


def flags(argv, environ=None, capsys=None):
    """What an mlx-lm command does with ``argv``'s streaming flags: (exit status or None,
    stderr lines)."""
    parser = argparse.ArgumentParser(prog="cmd")
    parser.add_argument("--model")
    command_line.add_streaming_arguments(parser)
    namespace = parser.parse_args(argv)
    said, sigterm = report.cli_streaming, signal.getsignal(signal.SIGTERM)
    try:
        command_line.export_streaming_arguments(parser, namespace, environ or {})
        status = None
    except SystemExit as e:
        status = e.code
    finally:
        report.cli_streaming = said
        signal.signal(signal.SIGTERM, sigterm)
    return status, capsys.readouterr().err.splitlines() if capsys else []


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("qwen3_moe")


def trace_for(path: Path, phases, layers=2, experts=8):
    with TraceWriter(path, layers, experts, 2, model="synthetic") as writer:
        for i, phase in enumerate(phases):
            writer.token(0, phase, [[i % experts, (i + 1) % experts]] * layers)
    return path


# -- plan --plot -----------------------------------------------------------------------------------


def fake_matplotlib(monkeypatch):
    """A stand-in matplotlib whose savefig writes a PNG signature to the path it is given."""
    saved = []

    class Axes:
        def __getattr__(self, name):
            return lambda *a, **k: self if name == "twinx" else None

    class Figure:
        def tight_layout(self):
            pass

        def savefig(self, path, **kwargs):
            Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + b"fake")
            saved.append(str(path))

    pyplot = types.ModuleType("matplotlib.pyplot")
    pyplot.subplots = lambda **k: (Figure(), Axes())
    pyplot.close = lambda fig: None
    matplotlib = types.ModuleType("matplotlib")
    matplotlib.use = lambda name: None
    matplotlib.pyplot = pyplot
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    return saved


def plan_with_plot(ckpt, tmp_path, plot, capsys):
    trace = trace_for(tmp_path / "r.jsonl", ["prefill"] * 3 + ["decode"] * 6)
    argv = ["plan", ckpt, "--routing-trace", trace, "--disk-gbps", "1", "--plot", plot]
    return run_cli(argv, capsys)


def test_plot_without_extension_prints_the_path_it_writes(ckpt, tmp_path, monkeypatch, capsys):
    fake_matplotlib(monkeypatch)
    status, out, err = plan_with_plot(ckpt, tmp_path, tmp_path / "q", capsys)
    assert status == 0, err
    assert f"plot: {tmp_path / 'q.png'}" in out.splitlines()
    assert (tmp_path / "q.png").read_bytes().startswith(b"\x89PNG")
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize(
    "name, named", [("q.txt", ".txt is not a plot format"), ("adir", "is a directory")]
)
def test_plot_path_that_cannot_be_a_plot_is_one_line_before_loading(
    ckpt, tmp_path, monkeypatch, capsys, name, named
):
    fake_matplotlib(monkeypatch)
    (tmp_path / "adir").mkdir()
    status, out, err = plan_with_plot(ckpt, tmp_path, tmp_path / name, capsys)
    assert status == 2 and len(err) == 1 and named in err[0], err
    assert "model:" not in out  # refused before the model was loaded
    assert sorted(os.listdir(tmp_path)) == ["adir", "r.jsonl"]


def test_the_plot_marks_the_default_and_the_given_budget(ckpt, tmp_path, capsys):
    """Issue 27, item 7: the budget plot showed only the 10%-100% curve."""
    pytest.importorskip("matplotlib")
    trace = trace_for(tmp_path / "r.jsonl", ["prefill"] * 3 + ["decode"] * 6)
    plot = tmp_path / "budgets.svg"  # matplotlib keeps each text as a comment in an SVG
    argv = ["plan", ckpt, "--routing-trace", trace, "--disk-gbps", "1", "--plot", plot]
    status, out, err = run_cli(argv + ["--expert-cache-gb", "0.004"], capsys)
    assert status == 0, err
    default = re.search(r"^default budget: (\S+) GB", out, re.M).group(1)
    given = re.search(r"^expert cache budget \(given\): (\S+) GB", out, re.M).group(1)
    svg = plot.read_text()
    assert f"default budget, {default} GB" in svg and f"given budget, {given} GB" in svg
    status, out, err = run_cli(argv, capsys)  # no budget given: the default alone
    assert status == 0, err
    svg = plot.read_text()
    assert f"default budget, {default} GB" in svg and "given budget" not in svg


# -- plan takes the generate commands' policy flag (issue 27, item 6) ------------------------------


def test_plan_takes_expert_cache_policy_and_keeps_cache_policy(ckpt, tmp_path, capsys):
    trace = trace_for(tmp_path / "r.jsonl", ["prefill"] * 3 + ["decode"] * 6)
    argv = ["plan", ckpt, "--routing-trace", trace, "--disk-gbps", "1"]
    for flag in ("--expert-cache-policy", "--cache-policy"):
        status, out, err = run_cli(argv + [flag, "lru"], capsys)
        assert status == 0 and "policy lru)" in out, (flag, err)
    status, out, err = run_cli(argv + ["--expert-cache-policy", "fifo"], capsys)
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(
        "mlx_lm_streaming plan: error: argument --expert-cache-policy: cache_policy 'fifo' is "
        "unknown"
    ), err


# -- plan on a trace without decode tokens ---------------------------------------------------------


@pytest.mark.parametrize("phases", [["prefill"] * 5, []], ids=["prefill only", "header only"])
def test_plan_says_a_trace_has_no_decode_tokens(ckpt, tmp_path, capsys, phases):
    trace = trace_for(tmp_path / "r.jsonl", phases)
    status, out, err = run_cli(["plan", ckpt, "--routing-trace", trace, "--disk-gbps", "1"], capsys)
    assert status == 1 and len(err) == 1, (out, err)
    assert str(trace) in err[0] and "has no decode tokens" in err[0]
    assert "no reads" not in out
    # it names what is refused, not a --max-tokens: one token decodes (issue 45, item 13)
    assert "--max-tokens" not in err[0], err[0]


def test_plan_takes_the_trace_of_a_one_token_generation(ckpt, tmp_path, capsys):
    """docs/usage.md said a trace recorded with ``--max-tokens 1`` is refused: mlx-lm decodes
    a step past the token it yields, so that trace has decode tokens, and ``plan`` takes it."""
    from support import BIN, run

    trace = tmp_path / "r.jsonl"
    cmd = [BIN / "mlx_lm.generate", "--model", ckpt, "--prompt", "hi", "--max-tokens", "1"]
    run([*cmd, "--streaming-experts", "--record-routing", trace], tmp_path)
    status, out, err = run_cli(["plan", ckpt, "--routing-trace", trace, "--disk-gbps", "1"], capsys)
    assert status == 0 and re.search(r"\(\d+ decode, \d+ prefill tokens;", out), (out, err)


# -- a pack made from another model ----------------------------------------------------------------


def test_a_pack_of_another_model_is_named_as_such(ckpt, tmp_path):
    from mlx_lm_streaming.tools.pack import pack_checkpoint

    other = build_checkpoint(tmp_path / "other", "qwen3_moe", num_layers=3)
    pack = pack_checkpoint(other, tmp_path / "other.pack", progress=False)
    with pytest.raises(CheckpointError, match="the expert pack of another model") as info:
        load_streaming(ckpt, pack=str(pack))
    assert "has other tensors" in str(info.value) and "changed since" not in str(info.value)
    # same shapes, other weights: told apart by where the pack was made
    twin = build_checkpoint(tmp_path / "twin", "qwen3_moe", seed=1)
    pack = pack_checkpoint(twin, tmp_path / "twin.pack", progress=False)
    with pytest.raises(CheckpointError, match=f"made from the checkpoint at {twin.resolve()}"):
        load_streaming(ckpt, pack=str(pack))
    # the model's own shard rewritten in place is still "changed"
    own = Path(shutil.copytree(ckpt, tmp_path / "own"))
    pack = pack_checkpoint(own, progress=False)
    shard = sorted(own.glob("model-*.safetensors"))[0]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    with pytest.raises(CheckpointError, match="changed since the pack was made"):
        load_streaming(own, store="packed")


# -- budget bounds ---------------------------------------------------------------------------------


def test_a_budget_above_every_expert_means_every_expert(ckpt, capsys):
    # refused before as "more than this machine's memory plus swap" (issue 27, item 4), though the
    # model's experts take 0.000123 GB: a budget is a cap
    status, err = flags(["--streaming-experts", "--expert-cache-gb", "100000"], capsys=capsys)
    assert status is None and err == [], err
    status, err = flags(["--streaming-experts", "--expert-cache-gb", "1e30"], capsys=capsys)
    assert status is None and err == [], err
    model, _ = load_streaming(ckpt, expert_cache_gb="100000")
    state = model.expert_streaming
    total = state.cache.total_expert_bytes
    assert state.cache.plan_slots() == [b.num_experts for b in state.cache.banks]
    line = report.choice_line(state)
    assert f"expert cache {decimal_gb(total)} (given 100000 GB, capped at every expert)" in line
    state.close()
    status, out, err = run_cli(["plan", ckpt, "--expert-cache-gb", "100000"], capsys)
    assert status == 0, err
    assert (
        f"expert cache budget (given): {decimal_gb(total)} (given 100000 GB, capped at every "
        "expert)" in out
    ), out


def test_a_budget_that_cannot_fit_is_refused_at_load_with_both_figures(ckpt, monkeypatch, capsys):
    from mlx_lm_streaming.runtime.memory import machine as memory

    model, _ = load_streaming(ckpt)
    state = model.expert_streaming
    every, resident = state.cache.total_expert_bytes, state.resident_bytes
    state.close()
    # every expert and the resident weights need one byte more than this machine has
    monkeypatch.setattr(memory, "memory_and_swap", lambda: (every + resident - 1001, 1000))
    needed = (
        rf"the cache would take {decimal_gb(every)} \(every expert\) and the resident weights "
        rf"{decimal_gb(resident)}, {decimal_gb(every + resident)} in all, more than this "
        rf"machine's memory plus swap, {decimal_gb(every + resident - 1)} "
    )
    with pytest.raises(ConfigurationError, match="^expert cache budget of 100000 GB: " + needed):
        load_streaming(ckpt, expert_cache_gb="100000")
    status, out, err = run_cli(["plan", ckpt, "--expert-cache-gb", "100000"], capsys)
    assert status == 2 and len(err) == 1 and re.search(needed, err[0]), err
    # what the cache really takes counts, not the budget: one slot a layer fits
    least = sum(b.layer.expert_nbytes for b in state.cache.banks)
    monkeypatch.setattr(memory, "memory_and_swap", lambda: (least + resident, 0))
    model, _ = load_streaming(ckpt, expert_cache_gb=(least + 1) / 10**9)
    model.expert_streaming.close()
    # the default budget is never refused for the machine: it is a share of what is free
    model, _ = load_streaming(ckpt)
    model.expert_streaming.close()


def test_nan_is_not_a_number(capsys):
    status, err = flags(["--streaming-experts", "--expert-cache-gb", "nan"], capsys=capsys)
    assert status == 2 and "'nan' is not a number" in err[0], err
    with pytest.raises(ConfigurationError, match="not a number"):
        StreamingOptions(expert_cache_gb=float("nan"))


def test_plan_and_the_load_line_word_a_capped_default_alike(ckpt, capsys):
    # plan said "between the minimum and every expert" whatever the budget, the load line
    # "capped at every expert" (issue 27, item 6): one phrase, report.budget_how, now
    status, out, err = run_cli(["plan", ckpt], capsys)
    assert status == 0, err
    (default,) = [line for line in out.splitlines() if line.startswith("default budget: ")]
    assert default.endswith(", capped at every expert)"), default
    how = default.split(" (", 1)[1][:-1]
    model, _ = load_streaming(ckpt)
    line = report.choice_line(model.expert_streaming)
    model.expert_streaming.close()
    assert f"(default: {how})" in line, (line, how)


# -- verify --steps --------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", ["-3", "0"])
def test_verify_steps_must_be_positive(ckpt, capsys, steps):
    status, out, err = run_cli(["verify", ckpt, "--steps", steps], capsys)
    assert status == 2 and len(err) == 1 and "argument --steps" in err[0], (out, err)
    assert "exact" not in out


# -- empty paths -----------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--record-routing", "--streaming-trace", "--expert-pack"])
def test_an_empty_path_flag_is_refused(capsys, flag):
    status, err = flags(["--streaming-experts", flag, ""], capsys=capsys)
    assert status == 2 and len(err) == 1 and f"argument {flag}: an empty value" in err[0], err


def test_pack_out_empty_is_refused(ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    status, out, err = run_cli(["pack", ckpt, "--out", "", "--quiet"], capsys)
    assert status == 2 and len(err) == 1 and "--out: an empty path" in err[0], err
    assert os.listdir(tmp_path) == []


# -- option variables without streaming ------------------------------------------------------------


def test_an_option_variable_without_streaming_is_an_error_like_the_flag(ckpt, environ, capsys):
    environ["MLX_LM_STREAMING_STATS"] = "1"
    status, err = flags(["--model", "m"], environ=dict(environ), capsys=capsys)
    assert status == 2 and len(err) == 1, err
    assert "MLX_LM_STREAMING_STATS needs MLX_LM_STREAMING_EXPERTS=1" in err[0]
    from mlx_lm_streaming.integration.integration import install

    install()
    with pytest.raises(ConfigurationError, match="MLX_LM_STREAMING_STATS needs"):
        mlx_lm.utils.load_model(ckpt)
    # the flag says the same of itself
    status, err = flags(["--streaming-stats"], capsys=capsys)
    assert status == 2 and "--streaming-stats needs --streaming-experts" in err[0]
    # streaming asked for: the variable is an option as it should be
    environ["MLX_LM_STREAMING_EXPERTS"] = "1"
    assert StreamingOptions.from_env(environ).stats is True


# -- MLX_LM_STREAMING_HOOK values ------------------------------------------------------------------


def test_hook_values_are_validated_at_start(tmp_path):
    from support import clean_env

    def start(value):
        out = subprocess.run(
            [sys.executable, "-c", "pass"],
            cwd=tmp_path,
            env=clean_env(MLX_LM_STREAMING_HOOK=value),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0
        return out.stderr.splitlines()

    assert start("banana") == [
        "mlx-lm-streaming: MLX_LM_STREAMING_HOOK='banana' is neither on (1, true, yes, on) "
        "nor off (0, false, no, off); the startup hook stays on"
    ]
    for fine in ("on", "0", "FALSE", ""):
        assert start(fine) == [], fine


# -- pack progress ---------------------------------------------------------------------------------


def test_pack_progress_reaches_100_percent(ckpt, tmp_path, monkeypatch, capsys):
    from mlx_lm_streaming.tools.pack import pack_checkpoint

    capsys.readouterr()
    pack_checkpoint(ckpt, tmp_path / "p.pack", progress=True, force=True)
    err = capsys.readouterr().err.replace("\r", "\n")
    if "tqdm" in sys.modules:  # the bar in decimal GB, ending at 100%
        last = [line for line in err.splitlines() if line.startswith("packing experts")][-1]
        assert "100%|" in last and last.count(" GB") == 1, last
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the bar without tqdm: its own percentages
    pack_checkpoint(ckpt, tmp_path / "p.pack", progress=True, force=True)
    shown = re.findall(r"packing experts: +([\d.]+)% of ([\d.]+) GB", capsys.readouterr().err)
    assert shown and shown[-1][0] == "100.0", shown


# -- --version -------------------------------------------------------------------------------------


def test_version(capsys):
    from mlx_lm_streaming import __version__

    status, out, err = run_cli(["--version"], capsys)
    assert (status, out, err) == (0, f"mlx-lm-streaming {__version__}\n", [])


# -- one unit --------------------------------------------------------------------------------------


def test_the_budget_counts_decimal_gb_everywhere(ckpt, capsys):
    model, _ = load_streaming(ckpt, expert_cache_gb=0.001)
    state = model.expert_streaming
    assert state.cache.given_bytes == 10**6  # (planned at load: capped at every expert)
    assert state.cache.budget_bytes == state.cache.total_expert_bytes
    line = report.choice_line(state)
    # 0.001 GB is more than every expert of this model: the line says what the cache holds
    total = decimal_gb(state.cache.total_expert_bytes)
    assert f"expert cache {total} (given 0.001 GB, capped at every expert)" in line, line
    assert not OTHER_UNITS.search(line), line
    state.close()
    # the too-small error: one unit, and the minimum it names is enough
    with pytest.raises(ConfigurationError) as info:
        load_streaming(ckpt, expert_cache_gb=1e-7)
    message = str(info.value)
    assert not OTHER_UNITS.search(message), message
    least = float(message.rsplit("at least ", 1)[1].split()[0])
    model, _ = load_streaming(ckpt, expert_cache_gb=least)
    assert model.expert_streaming.cache.slots_for_budget() == 1
    model.expert_streaming.close()


def test_plan_and_help_say_decimal_gb_only(ckpt, capsys):
    status, out, err = run_cli(["plan", ckpt, "--expert-cache-gb", "0.0001"], capsys)
    assert status == 0, err
    assert not OTHER_UNITS.search(out), out
    parser = argparse.ArgumentParser()
    command_line.add_streaming_arguments(parser)
    help_text = " ".join(parser.format_help().split())
    assert "Expert cache budget in decimal GB (10**9 bytes)" in help_text
    assert not OTHER_UNITS.search(help_text)


# -- store option values (issue 27, item 3) ----------------------------------------------------


@pytest.mark.parametrize("value", ["abc", "0", "-3", "1.5", "100000"])
def test_a_bad_threads_value_is_one_line_naming_it(ckpt, capsys, value):
    # the flag: at parse time, before anything loads
    status, err = flags(
        ["--streaming-experts", "--expert-store-options", f"threads={value}"], capsys=capsys
    )
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(
        "cmd: error: argument --expert-store-options: store option threads="
    ), err
    assert "give a whole number of reader threads, 1 to 256 (safetensors store)" in err[0]
    # the variable: the line names it
    environ = {"MLX_LM_STREAMING_EXPERTS": "1", "MLX_LM_STREAMING_STORE_OPTIONS": f"threads={value}"}
    status, err = flags([], environ=environ, capsys=capsys)
    assert status == 2 and len(err) == 1, err
    assert f"MLX_LM_STREAMING_STORE_OPTIONS='threads={value}': store option threads=" in err[0]
    # the Python API: our type, the same message
    with pytest.raises(ConfigurationError, match=r"^store option threads=.*whole number"):
        load_streaming(ckpt, store_options=f"threads={value}")


@pytest.mark.parametrize(
    "store, given, named",
    [
        ("safetensors", {"threads": 2.5}, "threads=2.5"),
        ("packed", {"direct": "maybe"}, "direct='maybe'"),
        ("packed", {"verify": "sometimes"}, "verify='sometimes'"),
        ("packed", {"threads": 0}, "threads=0"),
        ("packed", {"path": 12}, "path=12"),
    ],
)
def test_every_store_option_value_is_checked_before_the_store_is_made(ckpt, store, given, named):
    from mlx_lm_streaming import plugins

    with pytest.raises(ConfigurationError, match=f"^store option {re.escape(named)}: "):
        plugins.check_store_options(store, given)
    with pytest.raises(ConfigurationError, match=f"^store option {re.escape(named)}: "):
        load_streaming(ckpt, store=store, store_options=given)


def test_good_store_option_values_pass():
    from mlx_lm_streaming import plugins

    plugins.check_store_options("safetensors", {"threads": 1})
    plugins.check_store_options("safetensors", {"threads": 256})
    plugins.check_store_options(
        "packed", {"threads": 8, "direct": "on", "verify": "off", "path": "/p"}
    )


# -- unknown MLX_LM_STREAMING_* variables (issue 27, item 2) -----------------------------------


def test_an_unknown_variable_is_named_once_when_mlx_lm_loads_without_streaming(
    ckpt, environ, capsys, monkeypatch
):
    from mlx_lm_streaming.integration.integration import install
    from mlx_lm_streaming.runtime import options
    from mlx_lm_streaming.runtime.options import requested

    install()
    monkeypatch.setattr(options, "_unknown_warned", False)
    environ["MLX_LM_STREAMING_EXPERT"] = "1"  # the S missing
    capsys.readouterr()
    model, _ = mlx_lm.utils.load_model(Path(ckpt))
    assert not hasattr(model, "expert_streaming")  # stock, as before
    assert capsys.readouterr().err.splitlines() == [
        "mlx-lm-streaming: warning: unknown variable MLX_LM_STREAMING_EXPERT (did you mean "
        "MLX_LM_STREAMING_EXPERTS?): ignored, this model loads without streaming experts"
    ]
    # once per process; streaming turned off in model_config is a load without streaming too
    mlx_lm.utils.load_model(Path(ckpt), model_config={"streaming_experts": False})
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(options, "_unknown_warned", False)
    environ["MLX_LM_STREAMING_FOO"] = "x"
    mlx_lm.utils.load_model(Path(ckpt), model_config={"streaming_experts": False})
    (line,) = capsys.readouterr().err.splitlines()
    assert "unknown variables MLX_LM_STREAMING_EXPERT (did you mean MLX_LM_STREAMING_EXPERTS?), " in line
    assert "MLX_LM_STREAMING_FOO (misspelt?)" in line, line
    # with streaming on, it stays an error, which now says the closest name too
    with pytest.raises(ConfigurationError, match=r"MLX_LM_STREAMING_EXPERT \(did you mean"):
        requested({"streaming_experts": True})
