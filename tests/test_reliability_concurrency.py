"""Concurrency at the model level: several threads run forward passes of one streaming model at once.

With a budget of 3 experts per layer (of 8) every call evicts, so threads keep replacing the slots the
others use. No deadlock (every thread finishes within a timeout), logits exactly the serial/stock ones,
and after the store is closed (explicitly or by dropping the model) no reader thread or file descriptor
is left behind.
"""

import gc
import os
import threading
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from support import load_stock, load_streaming

from mlx_lm_streaming.option_table import GB
from mlx_lm_streaming.errors import ExpertIOError

THREADS = 8
PROMPTS_PER_THREAD = 2
DECODE_STEPS = 4
TIMEOUT_S = 120


def prompt(i: int, vocab: int = 512):
    # different lengths: decode (1 row), short and long prefill (waves at 3 slots)
    length = [1, 3, 9, 24][i % 4]
    return mx.array([[(31 * i + 7 * j + 3) % vocab for j in range(length)]])


def run(model, tokens):
    """Prompt logits, then greedy decode with a KV cache of this call's own."""
    cache = make_prompt_cache(model)
    logits = model(tokens, cache=cache)
    out = [logits]
    for _ in range(DECODE_STEPS):
        logits = model(mx.argmax(logits[:, -1, :], axis=-1)[:, None], cache=cache)
        out.append(logits)
    mx.eval(out)
    return out


def open_fds():
    return sorted(os.listdir("/proc/self/fd"))


def reader_threads():
    return [t for t in threading.enumerate() if t.name.startswith("mlx-lm-streaming")]


def settled_reader_threads(timeout=10.0):
    """Our threads once those of models dropped earlier ended (a garbage-collected model's
    finalizer joins no thread: they end on their own, promptly)."""
    gc.collect()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = reader_threads()
        time.sleep(0.1)
        if reader_threads() == before and all(t.is_alive() for t in before):
            return before
    return reader_threads()


@pytest.fixture(scope="module")
def setup(checkpoint):
    path = checkpoint("qwen3_moe", "affine4")
    stock, _ = load_stock(path)
    expected = {i: run(stock, prompt(i)) for i in range(THREADS * PROMPTS_PER_THREAD)}
    probe, _ = load_streaming(path)
    per_slot = sum(b.layer.expert_nbytes for b in probe.expert_streaming.cache.banks)
    probe.expert_streaming.close()
    return path, expected, (3 * per_slot + 0.5) / GB


def run_concurrently(model, expected):
    barrier = threading.Barrier(THREADS)
    results, errors = {}, []

    def worker(t):
        try:
            barrier.wait()
            for k in range(PROMPTS_PER_THREAD):
                i = t * PROMPTS_PER_THREAD + k
                results[i] = run(model, prompt(i))
        except BaseException as e:  # reported by the main thread
            errors.append((t, repr(e)))

    threads = [threading.Thread(target=worker, args=(t,), name=f"test-worker-{t}")
               for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(TIMEOUT_S)
    assert not [th.name for th in threads if th.is_alive()], "deadlock: threads still running"
    assert not errors, errors
    for i, want in expected.items():
        for step, (a, b) in enumerate(zip(want, results[i])):
            assert mx.array_equal(a, b).item(), f"prompt {i} step {step}: logits differ"


@pytest.mark.parametrize("store,store_options", [
    ("safetensors", {"threads": 4}),
    ("safetensors", {"threads": 1}),
    ("memory", {}),
])
def test_concurrent_forward_passes_match_serial(setup, store, store_options):
    path, expected, budget = setup
    threads = settled_reader_threads()
    fds = open_fds()
    model, _ = load_streaming(path, expert_cache_gb=budget, store=store, store_options=store_options)
    state = model.expert_streaming
    # serial first, then all threads at once, twice (the second run starts from a warm cache)
    for i, want in list(expected.items())[:4]:
        assert all(mx.array_equal(a, b).item() for a, b in zip(want, run(model, prompt(i))))
    run_concurrently(model, expected)
    run_concurrently(model, expected)
    assert state.cache.stats.evictions > 100
    assert state.cache.resident_bytes <= state.cache.budget_bytes
    if store == "safetensors" and store_options["threads"] > 1:
        assert reader_threads()
    state.close()
    assert reader_threads() == threads
    assert open_fds() == fds
    with pytest.raises(ExpertIOError, match="closed"):
        # experts not resident must be read: a closed store says so
        for i in range(8):
            run(model, prompt(100 + i))


def test_dropping_the_model_closes_the_store(setup):
    path, expected, budget = setup
    threads = settled_reader_threads()
    fds = open_fds()
    model, _ = load_streaming(path, expert_cache_gb=budget, store_options={"threads": 4})
    run_concurrently(model, expected)
    assert len(open_fds()) > len(fds) and reader_threads()
    del model
    # the finalizer joins no thread (it can run inside another thread's start-up): the readers end
    # on their own, promptly
    assert settled_reader_threads() == threads
    assert open_fds() == fds


def test_model_loaded_in_one_thread_runs_in_another(setup):
    """The usual server shape: load on the main thread, generate on a worker thread. Slot banks left
    lazy by the loading thread used to fail there ("There is no Stream(cpu, N) in current thread")."""
    path, expected, budget = setup
    model, _ = load_streaming(path, expert_cache_gb=budget)
    model.expert_streaming.cache.ensure_planned()  # banks allocated on this thread
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("r", run(model, prompt(0))))
    th.start()
    th.join(TIMEOUT_S)
    assert "r" in out
    assert all(mx.array_equal(a, b).item() for a, b in zip(expected[0], out["r"]))
    # and back on this thread after the worker updated the banks
    assert all(mx.array_equal(a, b).item() for a, b in zip(expected[1], run(model, prompt(1))))
