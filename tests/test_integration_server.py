"""``mlx_lm.server --streaming-experts`` answers like the stock server, concurrent requests included.

Needs the package installed non-editable (``bash tests/run.sh``), like tests/test_integration.py.
"""

import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from support import BIN, STATS, budget_below_one_layer, chat, post, server

# the startup hook must be installed (tests/run.sh installs the package non-editable)
pytestmark = pytest.mark.usefixtures("require_hook")


def answers(url, other_model=None):
    """Everything we compare between the stock and the streaming server."""
    got = {}
    got["chat"] = post(url, "/v1/chat/completions", chat(0))["choices"][0]["message"]
    with ThreadPoolExecutor(4) as pool:
        got["chat x4"] = list(
            pool.map(
                lambda i: post(url, "/v1/chat/completions", chat(i))["choices"][0][
                    "message"
                ],
                range(4),
            )
        )
        got["chat streamed x4"] = list(
            pool.map(
                lambda i: post(url, "/v1/chat/completions", chat(i, True)), range(4)
            )
        )
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    got["completion"] = post(url, "/v1/completions", body)["choices"][0]["text"]
    got["completion streamed"] = post(url, "/v1/completions", {**body, "stream": True})
    if other_model is not None:
        # a model named in the request is loaded (and streamed) by the server
        reply = post(url, "/v1/chat/completions", chat(9, model=str(other_model)))
        got["other model"] = reply["choices"][0]["message"]
    return got


def test_server_streams_and_answers_like_stock(checkpoint, tmp_path):
    ckpt = checkpoint("qwen3_moe")
    other = checkpoint("mixtral")
    with server(ckpt, cwd=tmp_path) as (url, stock_run):
        stock = answers(url, other)
    with server(
        ckpt,
        "--streaming-experts",
        "--expert-cache-gb",
        budget_below_one_layer(ckpt),
        "--streaming-stats",
        cwd=tmp_path,
        stop=signal.SIGTERM,  # `kill`: with --streaming-stats, a clean exit that prints the stats
    ) as (url, streaming_run):
        streamed = answers(url, other)
    assert streamed == stock
    assert all(m["content"] for m in stock["chat x4"]), stock
    assert len({m["content"] for m in stock["chat x4"]}) > 1, "prompts should differ"
    assert not STATS.findall(stock_run["log"])
    # one stats line per streamed model: the default one and the one named in a request
    assert len(STATS.findall(streaming_run["log"])) == 2, streaming_run["log"]


def test_server_rejects_bad_flags(tmp_path):
    out = subprocess.run(
        [str(BIN / "mlx_lm.server"), "--expert-kernel", "gather"],
        cwd=tmp_path,
        env={
            k: v for k, v in os.environ.items() if not k.startswith("MLX_LM_STREAMING_")
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--expert-kernel needs --streaming-experts" in out.stderr


def test_server_layer_major_prefill(checkpoint, tmp_path):
    # --layer-major-prefill on, chunks of 4 tokens: a request with a seed is served alone
    # (stream_generate: layer-major), and the one after it continues its conversation from the
    # server's prompt cache (layer-major over a cache already holding the prefix); batched
    # requests (mlx-lm's BatchGenerator) prefill as stock, said once. Answers as the stock server's
    ckpt = checkpoint("qwen3_moe")
    first = chat(0, seed=1)
    flags = ("--prefill-step-size", "4")

    def answers(url):
        got = [post(url, "/v1/chat/completions", first)["choices"][0]["message"]]
        more = {
            **first,
            "messages": first["messages"]
            + [got[0], {"role": "user", "content": "And then what happened to them all?"}],
        }
        got.append(post(url, "/v1/chat/completions", more)["choices"][0]["message"])
        with ThreadPoolExecutor(2) as pool:
            got += pool.map(
                lambda i: post(url, "/v1/chat/completions", chat(i))["choices"][0]["message"],
                (1, 2),
            )
        return got

    with server(ckpt, *flags, cwd=tmp_path) as (url, _):
        stock = answers(url)
    with server(
        ckpt,
        *flags,
        "--streaming-experts",
        "--expert-cache-gb",
        budget_below_one_layer(ckpt),
        "--layer-major-prefill",
        "on",
        "--streaming-stats",
        cwd=tmp_path,
        stop=signal.SIGTERM,
    ) as (url, run):
        streamed = answers(url)
    assert streamed == stock
    log = run["log"]
    assert "layer-major prefill of 2 prompts" in log, log
    said = [l for l in log.splitlines() if "layer-major prefill does not apply" in l]
    assert len(said) == 1 and "BatchGenerator" in said[0], log
