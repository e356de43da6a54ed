"""The streaming server under 8 concurrent requests: no deadlock, the serial answers, no leaks, clean exit.

``mlx_lm.server --streaming-experts`` with a budget below one layer's experts (every request evicts).
Each of 8 requests (half of them streamed) is first sent alone, then all 8 at once, twice. The concurrent
answers must be the serial ones; afterwards the server holds no more threads or file descriptors than
before the concurrent rounds, and Ctrl-C stops it promptly without a traceback.

Needs the package installed non-editable (``bash tests/run.sh``), like tests/test_integration.py.
"""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from support import budget_below_one_layer, chat, post, server

# the startup hook must be installed (tests/run.sh installs the package non-editable)
pytestmark = pytest.mark.usefixtures("require_hook")


REQUESTS = 8
ROUNDS = 2


def resources(pid):
    """(open file descriptors, threads) of a process."""
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def ask(url, i):
    body = chat(i, stream=bool(i % 2))
    reply = post(url, "/v1/chat/completions", body)
    return reply if body["stream"] else reply["choices"][0]["message"]["content"]


def test_eight_concurrent_streaming_requests(checkpoint, tmp_path):
    ckpt = checkpoint("qwen3_moe")
    flags = ["--streaming-experts", "--expert-cache-gb", budget_below_one_layer(ckpt)]
    with server(ckpt, *flags, cwd=tmp_path) as (url, result):
        proc = result["proc"]
        serial = [ask(url, i) for i in range(REQUESTS)]
        assert all(serial) and len(set(serial)) > 1, serial
        before = None
        for round_ in range(ROUNDS + 1):
            with ThreadPoolExecutor(REQUESTS) as pool:
                concurrent = list(pool.map(lambda i: ask(url, i), range(REQUESTS)))
            assert concurrent == serial, f"round {round_}"
            if before is None:
                # counted after a first concurrent round: reader pools grow to their size on
                # demand (a pool reaching its cap is not a leak)
                time.sleep(1)
                before = resources(proc.pid)
        # request threads and their sockets go away once the replies are sent
        deadline = time.monotonic() + 10
        while resources(proc.pid) > before and time.monotonic() < deadline:
            time.sleep(0.2)
        after = resources(proc.pid)
        # no socket or file is left open; threads: the reader pools (bounded, started on demand,
        # the prefetch ones ending when idle) may differ by a few, a thread left per request would
        # show as REQUESTS x ROUNDS more
        assert after[0] <= before[0] and after[1] < before[1] + REQUESTS, (before, after)
    # left the block: stopped with Ctrl-C, its log read
    assert "Traceback" not in result["log"], result["log"]
