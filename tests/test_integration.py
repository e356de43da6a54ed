"""Stock mlx-lm commands and scripts, driven as subprocesses, stream when asked and print stock text.

These tests need the package installed the way users get it (``pip install .``, not editable), so
that the startup hook is in site-packages: ``bash tests/run.sh`` does that. Each architecture is
checked with an expert cache budget below one layer's experts, so experts are evicted and re-read.
"""

import json
import subprocess
import sys

import pytest
from support import (
    BIN,
    PROMPT,
    STATS,
    budget_below_one_layer,
    chat_reply,
    clean_env,
    generate_cmd,
    generated_text,
    run,
)

# the startup hook must be installed (tests/run.sh installs the package non-editable)
pytestmark = pytest.mark.usefixtures("require_hook")

# the architectures CI runs; the rest run with `-m slow`
ARCHS = ["qwen3_moe", "mixtral", "deepseek_v3"]
SLOW_ARCHS = ["qwen2_moe", "deepseek_v2", "deepseek_v41", "kimi_k2"]
ALL_ARCHS = ARCHS + [pytest.param(a, marks=pytest.mark.slow) for a in SLOW_ARCHS]

SCRIPT = """
import json, sys
from mlx.utils import tree_flatten
from mlx_lm import generate, load

model, tokenizer = load(sys.argv[1])
text = generate(model, tokenizer, sys.argv[2], max_tokens=32)
names = [k for k, _ in tree_flatten(model.parameters())]
print(json.dumps({
    "text": text,
    "streaming": hasattr(model, "expert_streaming"),
    "expert_params": [k for k in names if "switch_mlp" in k or ".experts." in k],
    "params": len(names),
}))
"""


@pytest.mark.core
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_generate_cli_streams_and_prints_stock_text(
    arch, checkpoint, stock_text, tmp_path
):
    ckpt = checkpoint(arch)
    budget = budget_below_one_layer(ckpt)
    out = run(
        generate_cmd(
            ckpt,
            "--streaming-experts",
            "--expert-cache-gb",
            budget,
            "--streaming-stats",
        ),
        tmp_path,
    )
    assert generated_text(out.stdout) == stock_text(arch)
    stats = STATS.findall(out.stderr)
    assert len(stats) == 1, out.stderr
    # with fewer slots than experts, experts were read more than once
    assert int(stats[0]) > 0


@pytest.mark.core
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_plain_script_streams_with_env_var(arch, checkpoint, tmp_path):
    ckpt = checkpoint(arch)
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, script, ckpt, PROMPT]
    stock = json.loads(run(cmd, tmp_path).stdout)
    streamed = json.loads(
        run(
            cmd,
            tmp_path,
            env=clean_env(
                MLX_LM_STREAMING_EXPERTS="1",
                MLX_LM_STREAMING_CACHE_GB=budget_below_one_layer(ckpt),
            ),
        ).stdout
    )
    assert not stock["streaming"] and stock["expert_params"]
    assert streamed["streaming"]
    assert streamed["expert_params"] == []
    assert streamed["text"] == stock["text"]


def test_python_m_mlx_lm_takes_the_flags(checkpoint, stock_text, tmp_path):
    ckpt = checkpoint("qwen3_moe")
    cmd = [sys.executable, "-m", "mlx_lm", "generate"] + generate_cmd(ckpt)[1:]
    out = run(cmd + ["--streaming-experts", "--streaming-stats"], tmp_path)
    assert generated_text(out.stdout) == stock_text("qwen3_moe")
    assert len(STATS.findall(out.stderr)) == 1


def test_flags_are_listed_in_help(tmp_path):
    for cmd in ("mlx_lm.generate", "mlx_lm.chat", "mlx_lm.server"):
        out = run([BIN / cmd, "--help"], tmp_path)
        for flag in (
            "--streaming-experts",
            "--expert-cache-gb",
            "--expert-store",
            "--expert-kernel",
            "--streaming-stats",
        ):
            assert flag in out.stdout, f"{cmd} --help lacks {flag}"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--expert-cache-gb", "1"], "--expert-cache-gb needs --streaming-experts"),
        (
            ["--streaming-experts", "--expert-cache-gb", "0"],
            "argument --expert-cache-gb",
        ),
        (["--streaming-experts", "--expert-store", "nope"], "argument --expert-store"),
        (
            ["--streaming-experts", "--expert-kernel", "nope"],
            "argument --expert-kernel",
        ),
    ],
)

def test_bad_flags_are_rejected_naming_the_flag(flags, message, checkpoint, tmp_path):
    out = subprocess.run(
        [str(c) for c in generate_cmd(checkpoint("qwen3_moe"), *flags)],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert message in out.stderr


def test_draft_model_streams_too(checkpoint, tmp_path):
    ckpt = checkpoint("qwen3_moe")
    draft = checkpoint("qwen3_moe", seed=1)
    cmd = generate_cmd(ckpt, "--draft-model", draft)
    stock = run(cmd, tmp_path)
    out = run(cmd + ["--streaming-experts", "--streaming-stats"], tmp_path)
    assert generated_text(out.stdout) == generated_text(stock.stdout)
    # one line per streamed model: the main model and the draft model, each named
    assert len(STATS.findall(out.stderr)) == 2, out.stderr
    for model in (ckpt, draft):
        assert f"[streaming] {model.name}: hit rate" in out.stderr, out.stderr


def test_chat_repl_streams(checkpoint, tmp_path):
    ckpt = checkpoint("mixtral")
    cmd = [BIN / "mlx_lm.chat", "--model", ckpt, "--max-tokens", "16", "--temp", "0"]
    env = clean_env(NO_COLOR="1", TERM="dumb")
    stock = run(cmd, tmp_path, env=env, input="hello there\nq\n")
    out = run(
        cmd
        + ["--streaming-experts", "--expert-cache-gb", budget_below_one_layer(ckpt)]
        + ["--streaming-stats"],
        tmp_path,
        env=env,
        input="hello there\nq\n",
    )
    assert chat_reply(out.stdout) == chat_reply(stock.stdout)
    assert len(STATS.findall(out.stderr)) == 1


def test_saved_prompt_cache_round_trip(checkpoint, tmp_path):
    ckpt = checkpoint("deepseek_v3")
    flags = ["--streaming-experts", "--expert-cache-gb", budget_below_one_layer(ckpt)]
    texts = []
    for extra in ([], flags):
        cache_file = tmp_path / f"cache{len(texts)}.safetensors"
        run(
            [BIN / "mlx_lm.cache_prompt", "--model", ckpt, "--prompt", PROMPT]
            + ["--prompt-cache-file", cache_file]
            + extra,
            tmp_path,
        )
        out = run(
            [BIN / "mlx_lm.generate", "--prompt-cache-file", cache_file]
            + ["--prompt", " and a knight", "--max-tokens", "16", "--temp", "0"]
            + extra,
            tmp_path,
        )
        texts.append(generated_text(out.stdout))
    assert texts[0] == texts[1]
