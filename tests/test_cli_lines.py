"""What a run says about itself (issue 37, items 10-12): an error raised mid-generation starts on
its own line, not glued to the text (``!mlx_lm.generate: error: ...``); a routing trace counts a
prompt's tokens as prefill however mlx-lm splits them into calls (a 2-token prompt was "50 decode,
0 prefill tokens"); the stats line says which bytes were read for the experts asked for and which
in the background."""

import json
import re
import subprocess
import sys

import pytest
from support import BIN, STATS, clean_env, load_streaming, run, run_cli

from mlx_lm_streaming.runtime.sizes import gb_at_least

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


# mlx_lm.generate, sent SIGINT (Ctrl-C; or the signal named by $SEND) at its 30th decode step
INTERRUPTED_GENERATE = """
import importlib, os, signal, sys
import mlx.core as mx
stock, steps = mx.async_eval, []
def async_eval(*a):
    steps.append(1)
    if len(steps) == 30:
        os.kill(os.getpid(), getattr(signal, os.environ.get("SEND", "SIGINT")))
    return stock(*a)
mx.async_eval = async_eval
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

    from mlx_lm_streaming.runtime.memory.report import stats_line
    from mlx_lm_streaming.runtime.sizes import decimal_gb

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
        f"{decimal_gb(total)} read ({decimal_gb(total - background)} on demand, "
        f"{decimal_gb(background)} in the background: lookahead, next wave, fill)"
    ) in line, line
    state.close()


def test_the_stats_line_says_how_long_the_disk_was_busy_for_the_misses(checkpoint):
    # the misses' reads held 50 ms each: the disk's busy time is the union of the reads in flight
    # (several experts of a layer read at once count once), not their sum, and at least one
    # read's length; the decode's wait is said beside it
    import time

    import mlx.core as mx

    from mlx_lm_streaming.runtime.memory.report import stats_line

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


def test_the_load_and_stats_lines_say_sizes_one_way_in_a_users_words(checkpoint, tmp_path):
    """On a small model the stats line said ``0.000 GB read`` and ``cache 0.000 GB`` while the
    load line said ``5e-05 GB`` (issue 45, item 7); and its ``decode calls: 1 verified steps, 60
    per layer (by share limits)`` was the runtime's own words, now kept for ``--streaming-stats
    layers`` (item 8)."""
    from mlx_lm_streaming.runtime.sizes import gb_digits

    ckpt = checkpoint("qwen3_moe")
    cmd = [BIN / "mlx_lm.generate", "--model", ckpt, "--prompt", "hi", "--max-tokens", "6"]
    cmd += ["--streaming-experts", "--expert-cache-gb", one_slot(ckpt), "--streaming-stats"]
    out = run(cmd, tmp_path)
    load, stats = [x for x in out.stderr.splitlines() if x.startswith("[streaming]")]
    assert not re.search(r"\b0\.000 GB|\de-\d", load + stats), out.stderr
    sizes = re.findall(r"(\d[\d.]*) GB", load + stats)
    assert len(sizes) >= 4, (load, stats)
    for size in sizes:  # each as the one helper writes it
        assert gb_digits(float(size) * 1e9) == size, (size, load, stats)
    read = re.search(r", (\d[\d.]*) GB read", stats)
    assert read and float(read.group(1)) > 0, stats
    assert "decode calls" not in stats and "verified" not in stats, stats
    layers = run([*cmd, "layers"], tmp_path).stderr
    assert re.search(r"^\[streaming\]   decode calls: \d+ verified steps, \d+ per layer", layers,
                     re.M), layers


def test_ctrl_c_while_streaming_is_one_line_status_130_and_the_stats(checkpoint, tmp_path):
    """Ctrl-C during ``mlx_lm.generate --streaming-experts`` printed a 20-frame traceback (issue 45,
    item 6): now one line, exit 130 (128 + SIGINT), and the stats line where it was asked for.
    Without streaming, stock's behaviour (a traceback) is left as it is."""
    ckpt = checkpoint("qwen3_moe")
    cmd = [sys.executable, "-c", INTERRUPTED_GENERATE, "--model", ckpt, "--prompt", "hi"]
    cmd += ["--max-tokens", "200"]

    def interrupted(*flags, **env):
        return run_cli([*cmd, *flags], tmp_path, env=clean_env(**env))

    for flags in (["--streaming-experts"], ["--streaming-experts", "--streaming-stats"]):
        out = interrupted(*flags)
        report = f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
        assert out.returncode == 130 and "Traceback" not in out.stderr, report
        lines = [x for x in out.stderr.splitlines() if not x.startswith("[streaming] qwen3")]
        assert lines[0] == "mlx_lm.generate: interrupted", report
        stats = lines[1:]
        assert len(stats) == ("--streaming-stats" in flags), report
        assert all(STATS.match(x) for x in stats), report
        assert out.stdout.endswith("\n") and generated_text_began(out.stdout), report
    # `kill` where --streaming-stats is given (the flag makes SIGTERM end the run as Ctrl-C does)
    out = interrupted("--streaming-experts", "--streaming-stats", SEND="SIGTERM")
    lines = [x for x in out.stderr.splitlines() if not x.startswith("[streaming] qwen3")]
    assert out.returncode == 143 and lines[0] == "mlx_lm.generate: terminated", out.stderr
    assert len(lines) == 2 and STATS.match(lines[1]), out.stderr
    # the environment's way of asking: the same
    out = interrupted(MLX_LM_STREAMING_EXPERTS="1")
    assert out.returncode == 130 and out.stderr.splitlines()[-1] == "mlx_lm.generate: interrupted"
    # stock: its own traceback and status, the same with our hook off
    stock = interrupted()
    assert "KeyboardInterrupt" in stock.stderr, stock.stderr
    hook_off = interrupted(MLX_LM_STREAMING_HOOK="0")
    assert stock.returncode == hook_off.returncode != 130, (stock.returncode, hook_off.returncode)
    assert stock.stderr.splitlines()[-1] == hook_off.stderr.splitlines()[-1]


def test_a_command_a_test_starts_takes_ctrl_c_though_the_suite_ignores_it(checkpoint, tmp_path):
    """Run as a background job (``nohup bash tests/run.sh &``) the suite starts with SIGINT
    ignored, which children inherit: the pack's Ctrl-C test saw the pack finish, and the server
    tests waited out their timeouts (issue 45, item 12)."""
    import signal

    from support import server

    check = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert run_cli([sys.executable, "-c", check], tmp_path).stdout == "True\n"
        assert run([sys.executable, "-c", check], tmp_path).stdout == "True\n"
        with server(checkpoint("qwen3_moe"), cwd=tmp_path) as (_, result):
            pass  # stopped by SIGINT, else killed after 30 s
        assert result["proc"].returncode != -signal.SIGKILL, result["log"]
    finally:
        signal.signal(signal.SIGINT, ignored)


@pytest.mark.parametrize("activated", [True, False])
def test_the_commands_plan_and_pack_suggest_run_as_printed(checkpoint, tmp_path, activated):
    """After ``bash docs/demo.sh`` (its ``.venv`` not activated), ``plan``'s hint
    ``mlx_lm.generate ... --record-routing`` was not on PATH (issue 45, item 11): a command not on
    PATH is named by its path."""
    import shlex

    ckpt = checkpoint("qwen3_moe")
    path = f"{BIN}:/usr/bin:/bin" if activated else "/usr/bin:/bin"
    env = clean_env(PATH=path)
    plan = run([BIN / "mlx_lm_streaming", "plan", ckpt], tmp_path, env=env).stdout
    hint = plan.splitlines()[-1]
    commands = [shlex.split(c)[0] for c in re.findall(r"`([^`]+)`", hint)]
    out = tmp_path / "p.pack"
    packed = run([BIN / "mlx_lm_streaming", "pack", ckpt, "--out", out, "--quiet"], tmp_path,
                 env=env).stdout
    commands.append(shlex.split(packed.splitlines()[-1].split(": ", 1)[1])[0])
    names = ["mlx_lm.generate", "mlx_lm_streaming", "mlx_lm.generate"]
    assert commands == (names if activated else [str(BIN / n) for n in names]), (hint, packed)


def generated_text_began(stdout: str) -> bool:
    return len(stdout.split("==========\n", 1)[-1]) > 1  # text, then the line's end


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


def test_the_misses_rate_is_written_as_sizes_are():
    """A small model's few slow reads printed ``0.00 GB/s while busy``: a rate of nothing, which
    also failed the sizes test above now and then. The rate is written as sizes are
    (``sizes.gb_digits``: never ``0.00``, never an exponent)."""
    from mlx_lm_streaming.runtime.memory.report import _misses_part

    slow = _misses_part({"miss_read_busy_seconds": 1.0, "io_wait_seconds": 1.0, "gb_read": 0.0012})
    assert "0.0012 GB/s while busy" in slow, slow
    quick = _misses_part({"miss_read_busy_seconds": 0.5, "io_wait_seconds": 1.0, "gb_read": 1.1})
    assert "2.200 GB/s while busy" in quick, quick
