"""Shared test helpers: load a checkpoint stock or streaming, run the real commands, run a server."""

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx_lm.utils
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_streaming import plugins
from mlx_lm_streaming.hookspecs import hookimpl
from mlx_lm_streaming.integration.integration import install
from mlx_lm_streaming.runtime.options import ENV

from mlx_lm_streaming.option_table import GB  # noqa: E402


@contextmanager
def registered(plugin, name: str):
    """``plugin`` registered with our plugin manager for the ``with`` block, as a third party's would
    be through its entry point; unregistered after it."""
    pm = plugins.load_plugins()
    pm.register(plugin, name=name)
    try:
        yield plugin
    finally:
        pm.unregister(plugin)


class KernelPlugin:
    """A plugin that registers one kernel through the kernel hook."""

    def __init__(self, kernel):
        self.kernel = kernel

    @hookimpl
    def register_kernels(self, register):
        register(self.kernel)


@contextmanager
def held_out_env():
    """No MLX_LM_STREAMING_* variable from the caller's shell leaks into a test."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k in ENV.values()}
    try:
        yield
    finally:
        os.environ.update(saved)


def load_stock(path):
    install()
    with held_out_env():
        model, config = mlx_lm.utils.load_model(path)
    assert not hasattr(model, "expert_streaming")
    return model, config


def load_streaming(path, **options):
    install()
    with held_out_env():
        return mlx_lm.utils.load_model(path, model_config={"streaming_experts": options})


def decode(model, tokens, steps=6):
    """Prompt logits, then ``steps`` decode steps with varied (not greedy) inputs."""
    cache = make_prompt_cache(model)
    logits = model(tokens, cache=cache)
    out = [logits]
    for i in range(steps):
        # varied inputs (not greedy: a random model soon repeats one token)
        nxt = mx.array([[(37 * i + 11) % 512] * tokens.shape[0]]).T
        logits = model(nxt, cache=cache)
        out.append(logits)
    mx.eval(out)
    return out


def generate_steps(model, prompt, steps, between=None, **kwargs):
    """Tokens and log-probabilities (numpy) of greedy decoding through mlx-lm's own
    ``generate_step`` (``kwargs``: its other arguments), which builds step t+1's graph before
    step t is evaluated; ``between(i)`` runs after token i is taken, while step i+1 is already
    built."""
    from mlx_lm.generate import generate_step

    out = []
    stepping = generate_step(prompt, model, max_tokens=steps, **kwargs)
    for (token, logprobs), i in zip(stepping, range(steps)):
        out.append((int(token), np.array(logprobs)))
        if between is not None:
            between(i)
    return out


def assert_same_steps(expected, got):
    """``generate_steps``' outputs equal: the tokens, and the log-probabilities bit for bit."""
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, a), (_, b) in zip(expected, got):
        assert np.array_equal(a, b)


def same(a, b):
    return all(mx.array_equal(x, y).item() for x, y in zip(a, b))


def per_slot(model):
    return sum(b.layer.expert_nbytes for b in model.expert_streaming.cache.banks)


def with_slots(path, slots, **options):
    """A streaming model of ``path`` whose budget holds ``slots`` experts of every MoE layer."""
    probe, _ = load_streaming(path)
    budget = (slots * per_slot(probe) + 0.5) / GB
    return load_streaming(path, expert_cache_gb=budget, **options)[0]


# -- subprocess runs of the real commands (need the package installed non-editable: tests/run.sh) --

BIN = Path(sys.executable).parent
PROMPT = "Tell me a story about a dragon"
STATS = re.compile(
    r"^\[streaming\] (?:[^:\n]+: )?hit rate [\d.]+%, experts read (\d+), [\d.]+ GB read"
    r"(?: \([^)]*\))?, "
    r"[\d.]+ s in I/O",
    re.M,
)

def hook_installed() -> bool:
    purelib = Path(__import__("sysconfig").get_paths()["purelib"])
    return (purelib / "mlx_lm_streaming.pth").is_file()


def clean_env(**extra) -> dict:
    """The caller's environment without our variables or PYTHONPATH, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MLX_LM_STREAMING_") and k != "PYTHONPATH"
    }
    env.update(extra)
    return env


def default_sigint():
    """``preexec_fn`` of every command a test starts: SIGINT's default action, as from a terminal.
    A shell that runs the suite as a background job (``nohup bash tests/run.sh &``) starts it with
    SIGINT ignored, and children inherit that: the Ctrl-C a test sends would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run(cmd, cwd, env=None, input=None, timeout=120) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env or clean_env(),
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=default_sigint,
    )
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout}\n{out.stderr}"
    return out


def gpu_pipeline_quick(tmp_path: Path, *args, timeout=240):
    """``bench/gpu_pipeline.py --quick ARGS``, its report written to ``tmp_path/out`` as
    ``quick.json`` and ``quick.md``, in a clean environment: ``(the finished process, the JSON
    report, the markdown)``."""
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "out"
    cmd = [sys.executable, root / "bench" / "gpu_pipeline.py", "--quick", *args]
    proc = run(cmd + ["--out", out, "--tag", "quick"], cwd=root, env=clean_env(), timeout=timeout)
    return proc, json.loads((out / "quick.json").read_text()), (out / "quick.md").read_text()


def generated_text(stdout: str) -> str:
    """The text ``mlx_lm.generate`` prints between its two ``==========`` lines."""
    parts = stdout.split("==========\n")
    assert len(parts) >= 3, stdout
    return parts[1]


def expert_bytes_of_one_layer(ckpt: Path) -> int:
    """Bytes of the routed experts of the first MoE layer, from the safetensors headers."""
    sizes = {}
    for f in ckpt.glob("model*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            m = re.search(r"layers\.(\d+)\..*switch_mlp\.", name)
            if m and name != "__metadata__":
                start, end = meta["data_offsets"]
                layer = int(m.group(1))
                sizes[layer] = sizes.get(layer, 0) + end - start
    assert sizes, f"{ckpt}: no switch_mlp tensors"
    return sizes[min(sizes)]


def budget_below_one_layer(ckpt: Path) -> str:
    return f"{0.75 * expert_bytes_of_one_layer(ckpt) / 1e9:.9f}"


def generate_cmd(ckpt, *extra, prompt=PROMPT):
    return [
        BIN / "mlx_lm.generate",
        "--model",
        ckpt,
        "--prompt",
        prompt,
        "--max-tokens",
        "32",
        "--temp",
        "0",
        *extra,
    ]


def chat_reply(stdout: str) -> str:
    """The reply line of an ``mlx_lm.chat`` turn: the line before its ``N tokens ·`` footer."""
    lines = [
        re.sub(r"\x1b\[[0-9;]*[A-Za-z]|[\x01\x02]", "", l) for l in stdout.splitlines()
    ]
    footer = next(i for i, l in enumerate(lines) if re.match(r"\s*\d+ tokens", l))
    return lines[footer - 1]



# -- mlx_lm.server ----------------------------------------------------------------------------------

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
    env = clean_env()
    cmd = [BIN / "mlx_lm.server", "--model", model, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--log-level", "WARNING", *flags]
    log = open(cwd / f"server-{port}.log", "w+")
    proc = subprocess.Popen(
        [str(c) for c in cmd], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
        preexec_fn=default_sigint,
    )
    url = f"http://127.0.0.1:{port}"
    result = {"log": "", "proc": proc}
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




# -- failures as users see them (tests/test_reliability_errors.py) -------------------------------


def run_cli(cmd, cwd, env=None, timeout=120) -> subprocess.CompletedProcess:
    """Run an installed command without requiring success (``run`` requires exit 0)."""
    return subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env if env is not None else clean_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=default_sigint,
    )


def one_error_line(out: subprocess.CompletedProcess, *names) -> str:
    """Assert a failure reported the way users must see it: non-zero exit, no traceback, exactly one
    line on stderr, naming each of ``names``. Returns that line."""
    report = f"exit {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert out.returncode != 0, report
    assert "Traceback" not in out.stderr, report
    lines = out.stderr.splitlines()
    assert len(lines) == 1, report
    for name in names:
        assert str(name) in lines[0], f"{name!r} not named:\n{report}"
    return lines[0]


def build_dense_checkpoint(path: Path, tokenizer_from: Optional[Path] = None) -> Path:
    """A tiny dense llama checkpoint (nothing to stream), with the tokenizer of ``tokenizer_from``
    (none if not given)."""
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 512,
        "tie_word_embeddings": True,
    }
    return build_stock_checkpoint(path, config, tokenizer_from)


def build_dbrx_checkpoint(path: Path, tokenizer_from: Optional[Path] = None) -> Path:
    """A tiny dbrx checkpoint: a Mixture-of-Experts model whose experts are a list of MLP modules,
    not a ``switch_layers`` module (it cannot stream), with the tokenizer of ``tokenizer_from``."""
    config = {
        "model_type": "dbrx",
        "vocab_size": 512,
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    }
    return build_stock_checkpoint(path, config, tokenizer_from)


def build_stock_checkpoint(path: Path, config: dict, tokenizer_from: Optional[Path]) -> Path:
    """A checkpoint of ``config``'s model, built with mlx-lm's own class (random weights, float32),
    saved as mlx-lm saves one, with the tokenizer of ``tokenizer_from`` (none if not given)."""
    import importlib
    import shutil

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    mlx_lm.utils.save_model(path, model)
    mlx_lm.utils.save_config(config, path / "config.json")
    for f in tokenizer_from.glob("*token*") if tokenizer_from else ():
        shutil.copy(f, path / f.name)
    return path


class PlacementRecorder:
    """A placer that keeps ``(address, nbytes, on_device)`` of every range it was asked to place,
    and every ``(address, nbytes)`` whose placement it was asked to take back."""

    def __init__(self):
        self.placed = []
        self.unplaced = []

    def place(self, ranges, on_device):
        self.placed += [(a, n, on_device) for a, n in ranges]

    def unplace(self, ranges):
        self.unplaced += list(ranges)
