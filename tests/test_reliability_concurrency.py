"""Concurrency at the model level: several threads run forward passes of one streaming model at once.

With a budget of 3 experts per layer (of 8) every call evicts, so threads keep replacing the slots the
others use. No deadlock (every thread finishes within a timeout), logits exactly the serial/stock ones,
and after the store is closed (explicitly or by dropping the model) no reader thread or file descriptor
is left behind.

At the file level (issue 27): two processes given one routing trace or timeline, or one pack, never
write it at once; the second is refused in one line, and what the first wrote is kept whole.
"""

import errno
import fcntl
import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from support import BIN, generate_cmd, load_stock, load_streaming, one_error_line, run_cli

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


def open_fds() -> dict:
    """fd -> what it names, for each descriptor this process holds open."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed since
            pass
    return found


def opened_since(before: dict, settle: float = 0.0) -> dict:
    """Descriptors open now that were not, or named something else, in ``before``. Descriptors
    that other tests' models close meanwhile do not count: only what this test left open. With
    ``settle``: looked at again for up to that many seconds while any is open, so that a file
    another live model's thread holds for a moment (its free-memory reading of ``/proc``) is not
    taken for one this test left open; one left open stays open."""
    deadline = time.monotonic() + settle
    while True:
        opened = {fd: name for fd, name in open_fds().items() if before.get(fd) != name}
        if not opened or time.monotonic() >= deadline:
            return opened
        time.sleep(0.02)


def reader_threads():
    return [t for t in threading.enumerate() if t.name.startswith("mlx-lm-streaming")]


def started_since(before, timeout=10.0):
    """Our threads started since ``before`` that are still alive once they had ``timeout`` seconds
    to end (a garbage-collected model's finalizer joins no thread: they end on their own,
    promptly). Threads of other models that end meanwhile (an idle background reader ends after
    prefetch.IDLE_EXIT_S) do not count."""
    gc.collect()
    deadline = time.monotonic() + timeout
    while True:
        left = [t for t in reader_threads() if t not in before]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


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
    threads = reader_threads()
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
        assert [t for t in reader_threads() if t not in threads]
    state.close()
    assert started_since(threads, timeout=0) == []  # close joins them
    assert opened_since(fds, settle=2.0) == {}
    with pytest.raises(ExpertIOError, match="closed"):
        # experts not resident must be read: a closed store says so
        for i in range(8):
            run(model, prompt(100 + i))


def test_dropping_the_model_closes_the_store(setup):
    path, expected, budget = setup
    threads = reader_threads()
    fds = open_fds()
    model, _ = load_streaming(path, expert_cache_gb=budget, store_options={"threads": 4})
    run_concurrently(model, expected)
    assert opened_since(fds) and started_since(threads, timeout=0)
    del model
    # the finalizer joins no thread (it can run inside another thread's start-up): the readers end
    # on their own, promptly
    assert started_since(threads) == []
    assert opened_since(fds, settle=2.0) == {}


@pytest.mark.parametrize("dropped", [False, True])
def test_closing_asks_for_no_background_fill(checkpoint, dropped):
    # a model closed (or dropped: its finalizer closes it) with its first verified step's host work
    # still to do: that work, done by the close, asked for its identity banks' background fill,
    # whose thread then outlived the model (a finalizer joins no thread; seen as a stray
    # "mlx-lm-streaming-fill" thread in test_concurrent_forward_passes_match_serial)
    from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning

    path = checkpoint("qwen3_moe", "affine4")
    model, _ = load_streaming(path, tuning=CacheTuning(verify_choice="always"))
    state = model.expert_streaming
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=cache))
    banks = state.cache.banks
    assert state.steps.pending is not None and any(b.identity for b in banks)
    assert not any(b.fill_requested for b in banks)
    if dropped:
        del model, cache
        gc.collect()
    else:
        state.close()
    assert state.closed and state.steps.pending is None  # (its host work done by the close)
    assert not any(b.fill_requested for b in banks) and state.cache._fills.started == []


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


# -- two processes, one output file (issue 27, item 1) ---------------------------------------------

# a streaming run that has written its routing trace and timeline and goes on until told to end
WRITER = textwrap.dedent(
    """
    import sys
    import mlx.core as mx
    import mlx_lm.utils
    from mlx_lm_streaming.integration.integration import install
    install()
    options = {"record_routing": sys.argv[2], "trace": sys.argv[3]}
    from pathlib import Path
    config = {"streaming_experts": options}
    model, _ = mlx_lm.utils.load_model(Path(sys.argv[1]), model_config=config)
    model(mx.array([[1, 2, 3, 4]]))
    model.expert_streaming.timeline.flush()  # the timeline is open too
    print("writing", flush=True)
    sys.stdin.readline()
    model(mx.array([[5]]))
    model.expert_streaming.close()
    """
)


def test_a_second_process_is_refused_the_trace_and_timeline_the_first_writes(checkpoint, tmp_path):
    """Two runs given one --streaming-trace left invalid JSON (both runs' events interleaved), and
    one --record-routing lost a run's record. The second run is refused while the first writes."""
    from mlx_lm_streaming.errors import ConfigurationError
    from mlx_lm_streaming.files.routing_trace import read_trace

    path = checkpoint("qwen3_moe", "affine4")
    trace, timeline = tmp_path / "r.jsonl", tmp_path / "t.json"
    first = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(trace), str(timeline)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout.readline().strip() == "writing"
        for kind, file, what in (
            ("record_routing", trace, "routing trace"),
            ("trace", timeline, "timeline"),
        ):
            with pytest.raises(ConfigurationError) as info:
                load_streaming(path, **{kind: str(file)})
            assert str(info.value) == (
                f"{file}: another process is writing this {what} now; give this run another "
                "path, or wait for that one to finish"
            )
        cmd = generate_cmd(path, "--streaming-experts", "--record-routing", trace)
        out = run_cli(cmd, tmp_path)
        one_error_line(out, "argument --record-routing", trace, "another process is writing")
        first.stdin.write("\n")
        first.stdin.flush()
        assert first.wait(timeout=120) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert [r.phase for r in read_trace(trace).rows] == ["prefill"] * 4 + ["decode"]
    assert json.loads(timeline.read_text())[0]["name"] == "process_name"


@pytest.mark.parametrize("kind", ["record_routing", "trace"])
def test_a_run_that_meets_another_writer_at_its_first_write_leaves_the_file(
    checkpoint, tmp_path, capfd, kind
):
    """Both runs passed their checks before either wrote: the one that comes second to the file
    gives it up in one line, whether the other still writes it (its lock) or has finished it."""
    import mlx.core as mx

    path = checkpoint("qwen3_moe", "affine4")
    what = "routing trace" if kind == "record_routing" else "timeline"
    for case, reason in (
        ("writing", "another process is writing it; give each run its own file"),
        ("finished", "another process wrote it since this run began; left as it is, give each "
         "run its own file"),
    ):
        out = tmp_path / case  # a file's failure is said once per process
        model, _ = load_streaming(path, **{kind: str(out)})  # checked: no file yet
        other = os.open(out, os.O_WRONLY | os.O_CREAT)  # the other run, as open_for_run does it
        fcntl.flock(other, fcntl.LOCK_EX)
        os.write(other, b"the other run's record\n")
        if case == "finished":
            os.close(other)
        capfd.readouterr()
        model(mx.array([[1, 2, 3]]))
        model.expert_streaming.close()
        err = capfd.readouterr().err
        assert [line for line in err.splitlines() if "writing the" in line] == [
            f"mlx-lm-streaming: {out}: writing the {what} failed ({reason}); stopped writing it, "
            "the generation goes on"
        ], case
        assert out.read_bytes() == b"the other run's record\n", case
        if case == "writing":
            os.close(other)


# the first pack run: stops inside its first expert until told to go on
SLOW_PACK = textwrap.dedent(
    """
    import sys, zlib
    import mlx_lm_streaming.files.packfile as pack_mod
    from mlx_lm_streaming.tools.pack import pack_checkpoint
    real = zlib.crc32
    def held(*a):
        if not held.said:
            held.said = True
            print("writing", flush=True)
            sys.stdin.readline()
        return real(*a)
    held.said = False
    pack_mod.zlib.crc32 = held
    pack_checkpoint(sys.argv[1], progress=False)
    """
)


def test_a_second_pack_into_one_directory_is_refused(checkpoint, tmp_path):
    """Two `pack` runs into one directory: the second removed the first's temporary file, and the
    first failed with `[Errno 2] ... experts.pack.tmp-NNN -> experts.pack`. Now the second is
    refused in one line and the first finishes a pack that streams exactly."""
    from mlx_lm_streaming.files.packfile import PACK_NAME

    src = checkpoint("qwen3_moe", "affine4")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith(PACK_NAME):
            os.link(f, ckpt / f.name)
    first = subprocess.Popen(
        [sys.executable, "-c", SLOW_PACK, str(ckpt)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout.readline().strip() == "writing"
        out = run_cli([BIN / "mlx_lm_streaming", "pack", ckpt, "--quiet"], tmp_path)
        line = one_error_line(out, ckpt / PACK_NAME, f"process {first.pid} is writing this")
        assert out.returncode == 2, line
        first.stdin.write("\n")
        first.stdin.flush()
        assert first.wait(timeout=120) == 0, first.stderr.read()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert sorted(f.name for f in ckpt.glob(PACK_NAME + "*")) == [PACK_NAME]
    stock, _ = load_stock(ckpt)
    model, _ = load_streaming(ckpt, store="packed")
    a, b = stock(mx.array([[3, 1, 4, 1, 5]])), model(mx.array([[3, 1, 4, 1, 5]]))
    assert mx.array_equal(a, b).item()
    model.expert_streaming.close()


def test_a_queue_workers_join_waits_for_a_thread_still_ending():
    # a worker thread that found no item cleared its slot and is still returning when a put
    # starts the next: join (close's) waits for both, not the last one alone (a fill thread
    # outlived close() in background suite runs)
    from mlx_lm_streaming.runtime.memory.queue_worker import QueueWorker

    ending, handled = threading.Event(), []

    class Slow(QueueWorker):
        def _run(self):
            super()._run()
            if threading.current_thread() is first[0]:
                ending.wait(5)  # (the first thread, after it decided to end)

    worker, first = Slow("mlx-lm-streaming-test", handled.append), []
    worker.put(1)
    first.append(worker.thread)
    deadline = time.monotonic() + 5
    while worker.thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.put(2)  # the first thread is still alive: a second one starts
    assert first[0].is_alive() and worker.thread is not first[0]
    joined = threading.Thread(target=worker.join)
    joined.start()
    joined.join(0.3)
    assert joined.is_alive()  # waiting for the first thread
    ending.set()
    joined.join(5)
    assert not joined.is_alive() and not first[0].is_alive() and handled == [1, 2]
