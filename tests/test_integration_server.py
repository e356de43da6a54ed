"""``mlx_lm.server --streaming-experts`` answers like the stock server, concurrent requests included.

Needs the package installed non-editable (``bash tests/run.sh``), like tests/test_integration.py.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from test_integration import budget_below_one_layer

BIN = Path(sys.executable).parent
STATS = re.compile(r"^\[streaming\] hit rate [\d.]+%, experts read \d+", re.M)
START_TIMEOUT = 60
REQUEST_TIMEOUT = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(model, *flags, cwd, stop=signal.SIGINT):
    """A running ``mlx_lm.server`` on a free port, stopped with ``stop`` (Ctrl-C) afterwards."""
    port = free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MLX_LM_STREAMING_") and k != "PYTHONPATH"
    }
    cmd = [BIN / "mlx_lm.server", "--model", model, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--log-level", "WARNING", *flags]
    log = open(cwd / f"server-{port}.log", "w+")
    proc = subprocess.Popen(
        [str(c) for c in cmd], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    result = {"log": ""}
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert proc.poll() is None, f"server exited:\n{log_text(log)}"
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError):
                assert (
                    time.monotonic() < deadline
                ), f"server did not start:\n{log_text(log)}"
                time.sleep(0.1)
        yield url, result
    finally:
        if proc.poll() is None:
            proc.send_signal(stop)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        result["log"] = log_text(log)
        log.close()


def log_text(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()


def post(url, path, body):
    req = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
        if not body.get("stream"):
            return json.load(r)
        # server-sent events: concatenate the deltas
        text = []
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            choice = json.loads(line[5:])["choices"]
            if choice:
                text.append(
                    choice[0].get("delta", {}).get("content")
                    or choice[0].get("text")
                    or ""
                )
        return "".join(text)


def chat(i, stream=False, **extra):
    return {
        "messages": [
            {"role": "user", "content": f"Request number {i}: tell me a story"}
        ],
        "max_tokens": 24,
        "temperature": 0,
        "stream": stream,
        **extra,
    }


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
