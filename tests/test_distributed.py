"""Streaming under MLX distributed pipeline parallelism: 2 ranks on localhost, ring backend.

Each run goes through ``mlx.launch`` from the test venv (the package installed non-editable, as
``bash tests/run.sh`` does), on ports found free, with a time limit; the launcher's whole process
group is killed afterwards, also when a test fails. ``mlx.launch`` exits 0 even when a rank fails, so
the tests judge each rank by what it wrote.

The reference is single-process stock mlx-lm (``mlx_lm.generate`` / ``mlx_lm.server`` with the startup
hook off). Checkpoints have 4 layers in 4 shards, so that some shards hold only the other rank's
experts, and each rank gets an expert budget below one layer's experts.
"""

import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from support import clean_env, default_sigint, held_out_env

from mlx_lm_streaming.errors import UnsupportedModelError

BIN = Path(sys.executable).parent
LAYERS = 4
SHARDS = 4
PROMPT = "Tell me a story about a dragon"
MAX_TOKENS = 16
TIMEOUT = 60  # seconds for one launch; a run takes about 6 s here
GB = 10**9  # the budget options count decimal GB
ARCHS = ["qwen3_moe", "deepseek_v3"]
STATS_LINE = re.compile(
    r"^\[streaming\] hit rate [\d.]+%, experts read (\d+), .*, "
    r"pipeline rank (\d+)/(\d+) \(layers (\d+)-(\d+)\)(?:, decode calls: [^;]*)?"
    r"(?:; .* everything else)?$",
    re.M,
)


# -- processes -----------------------------------------------------------------------------------


def free_ports(n: int) -> int:
    """A port p such that p, p+1, ... p+n-1 are all free on 127.0.0.1 now."""
    for _ in range(200):
        base = random.randrange(20000, 60000 - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


class Started:
    """A process group started by ``started``: its output goes to files in ``cwd``."""

    def __init__(self, cmd, cwd: Path, environ):
        cwd.mkdir(parents=True, exist_ok=True)
        self.cmd = cmd
        self.out_path, self.err_path = cwd / "stdout.txt", cwd / "stderr.txt"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            # stdin stays an open pipe: at EOF, mlx.launch's input loop spins a core
            self.proc = subprocess.Popen(
                [str(c) for c in cmd],
                cwd=cwd,
                env=environ,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                text=True,
                start_new_session=True,
                preexec_fn=default_sigint,  # the ranks must be interruptible
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout=TIMEOUT):
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.cmd} did not finish in {timeout} s:\n{self.stderr}")
        return self.stdout, self.stderr

    @property
    def stdout(self) -> str:
        return self.out_path.read_text()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc.stdin.close()


@contextmanager
def started(cmd, cwd: Path, environ=None):
    """Start ``cmd`` in a new process group; kill the whole group on the way out."""
    proc = Started(cmd, cwd, environ or clean_env())
    try:
        yield proc
    finally:
        proc.kill()


def launch_cmd(*command, ranks=2):
    return [
        BIN / "mlx.launch",
        "-n",
        str(ranks),
        "--backend",
        "ring",
        "--starting-port",
        str(free_ports(ranks)),
        "--",
        *command,
    ]


def run_ranks(command, cwd: Path, timeout=TIMEOUT, ranks=2):
    """Run ``command`` on ``ranks`` ranks; return (stdout, stderr) of the launcher."""
    with started(launch_cmd(*command, ranks=ranks), cwd) as proc:
        return proc.wait(timeout)


def generated_text(stdout: str) -> str:
    """The text between the two ``==========`` lines that mlx_lm.generate (and rank 0) print."""
    parts = stdout.split("==========\n")
    assert len(parts) >= 3, stdout
    return parts[1][: -len("\n")]


# -- checkpoint facts, read from the files themselves ---------------------------------------------


def expert_tensors(ckpt: Path) -> dict:
    """{layer: [(file name, first byte, end byte) of each routed-expert tensor]}, from the headers."""
    layers = {}
    for f in sorted(ckpt.glob("model*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            m = re.search(r"layers\.(\d+)\..*switch_mlp\.", name)
            if m:
                start, end = meta["data_offsets"]
                tensors = layers.setdefault(int(m.group(1)), [])
                tensors.append((f.name, 8 + n + start, 8 + n + end))
    return layers


def expert_nbytes(tensors: list, experts: int) -> int:
    return sum(end - start for _, start, end in tensors) // experts


# Runs pipeline_generate with os.preadv / os.pread recorded: every byte range the rank read from a
# checkpoint shard (mlx's own loading reads through C++, not these) goes to reads{rank}.json.
RECORD_READS = """
import json, os, sys
import mlx.core as mx
from mlx_lm_streaming import pipeline_generate

reads = []

def recorded(read):
    def wrapper(fd, buffers_or_n, offset, *args):
        n = read(fd, buffers_or_n, offset, *args)
        size = n if isinstance(n, int) else len(n)
        reads.append((os.readlink(f"/proc/self/fd/{fd}"), offset, size))
        return n
    return wrapper

os.preadv = recorded(os.preadv)
os.pread = recorded(os.pread)
pipeline_generate.main(sys.argv[1:])
with open(f"reads{mx.distributed.init().rank()}.json", "w") as f:
    json.dump(reads, f)
"""


def num_experts(ckpt: Path) -> int:
    config = json.loads((ckpt / "config.json").read_text())
    for key in ("num_experts", "n_routed_experts"):
        if key in config:
            return config[key]
    raise KeyError(f"{ckpt}: no expert count in config")


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return lambda arch: checkpoint(arch, num_layers=LAYERS, shards=SHARDS)


@pytest.fixture(scope="module")
def stock_text(ckpt):
    """Single-process stock generation, as ``mlx_lm.generate --temp 0`` does it, per architecture.

    In this process (a subprocess would cost seconds of imports): the stock model, the chat template
    applied the way mlx_lm.generate applies it, greedy decoding."""
    texts = {}

    def get(arch):
        if arch not in texts:
            with held_out_env():
                model, tokenizer = mlx_lm.load(str(ckpt(arch)))
            assert not hasattr(model, "expert_streaming")
            assert tokenizer.has_chat_template
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": PROMPT}],
                tokenize=False,
                add_generation_prompt=True,
            )
            prompt = tokenizer.encode(prompt, add_special_tokens=False)
            texts[arch] = mlx_lm.generate(
                model, tokenizer, prompt, max_tokens=MAX_TOKENS
            )
        return texts[arch]

    return get


# -- pipeline_generate over 2 ranks ---------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_stream_only_their_own_layers(arch, ckpt, stock_text, tmp_path):
    path = ckpt(arch)
    n_experts = num_experts(path)
    experts = expert_tensors(path)
    assert sorted(experts) == (
        [1, 2, 3] if arch == "deepseek_v3" else [0, 1, 2, 3]
    ), "deepseek_v3 keeps layer 0 dense (first_k_dense_replace=1)"
    sizes = {expert_nbytes(tensors, n_experts) for tensors in experts.values()}
    assert len(sizes) == 1
    e = sizes.pop()
    # 6.5 experts: 3 slots a layer on a rank with 2 MoE layers, 6 on a rank with 1 (of 8 experts)
    budget_gb = 6.5 * e / GB
    script = tmp_path / "record_reads.py"
    script.write_text(RECORD_READS)

    stdout, stderr = run_ranks(
        [
            sys.executable,
            script,
            "--model",
            path,
            "--prompt",
            PROMPT,
            "--max-tokens",
            MAX_TOKENS,
            "--streaming-experts",
            "--expert-cache-gb",
            repr(budget_gb),
            "--streaming-stats",
            "--stats-json",
            tmp_path / "rank{rank}.json",
        ],
        tmp_path,
    )
    reports, reads = {}, {}
    for rank in (0, 1):
        f = tmp_path / f"rank{rank}.json"
        assert f.is_file(), f"rank {rank} wrote no report:\n{stdout}\n{stderr}"
        reports[rank] = json.loads(f.read_text())
        reads[rank] = json.loads((tmp_path / f"reads{rank}.json").read_text())

    # the same text as single-process stock mlx-lm, on rank 0's stdout and in both ranks' reports
    expected = stock_text(arch)
    assert generated_text(stdout) == expected
    assert reports[0]["text"] == reports[1]["text"] == expected

    # mlx-lm's split: the first layers go to the last rank
    ranges = {0: (2, 4), 1: (0, 2)}
    all_files = {f.name for f in path.glob("model*.safetensors")}
    for rank, r in reports.items():
        start, end = ranges[rank]
        assert tuple(r["layers"]) == (start, end)
        own = [layer for layer in sorted(experts) if start <= layer < end]
        # the banks are this rank's MoE layers, and no other
        assert r["streamed_layers"] == own
        # the budget is this rank's: slots = budget // (its MoE layers x one expert), below a layer
        slots = int(budget_gb * GB) // (len(own) * e)
        assert slots < n_experts
        assert set(r["slots"].values()) == {slots}
        assert r["budget_bytes"] == int(budget_gb * GB)
        # with fewer slots than experts, experts were evicted and read again
        assert r["misses"] > 0 and r["evictions"] > 0

        # what the rank read, as the OS saw it: every range lies in one expert's slice of one of
        # its own layers' expert tensors, and the ranges add up to the store's count
        own_tensors = [t for layer in own for t in experts[layer]]
        for file, offset, size in reads[rank]:
            tensor = [
                (s, t_end)
                for name, s, t_end in own_tensors
                if name == Path(file).name and s <= offset and offset + size <= t_end
            ]
            assert (
                tensor
            ), f"rank {rank} read {size} bytes at {offset} of {file}: not its expert"
            s, t_end = tensor[0]
            stride = (t_end - s) // n_experts
            assert (offset - s) // stride == (offset + size - 1 - s) // stride
        assert sum(size for _, _, size in reads[rank]) == r["bytes_read"]
        # bytes read = experts read x one expert's bytes; an expert is read on a miss, or ahead of
        # time by the prefetcher (then its later miss uses those bytes, or they are dropped)
        ahead = sum(r.get("staged_experts", {}).values())
        used = sum(r.get("used_experts", {}).values())
        assert r["bytes_read"] == (r["misses"] + ahead - used) * e
        # files opened for expert reads hold its own layers' experts; shards holding only the
        # other rank's experts were never opened for reading
        own_files = {name for name, _, _ in own_tensors}
        opened = {Path(f).name for f in r["files_opened"]}
        assert opened and opened <= own_files
        assert {Path(f).name for f, _, _ in reads[rank]} <= opened
        other_only = all_files - own_files
        assert other_only, "some shards should hold only the other rank's experts"
        assert not opened & other_only

    # one stats line per rank, naming the rank and its layers
    lines = {
        int(m[1]): (m[0], int(m[3]), int(m[4])) for m in STATS_LINE.findall(stderr)
    }
    assert sorted(lines) == [0, 1], stderr
    for rank, (experts_read, start, last) in lines.items():
        assert (start, last + 1) == ranges[rank]
        assert int(experts_read) == reports[rank]["misses"]


def test_budget_below_one_expert_per_own_layer_fails_on_that_rank(ckpt, tmp_path):
    path = ckpt("deepseek_v3")
    e = expert_nbytes(expert_tensors(path)[1], num_experts(path))
    # 1.5 experts: enough for rank 1 (one MoE layer), not for rank 0 (two)
    stdout, stderr = run_ranks(
        [
            sys.executable,
            "-m",
            "mlx_lm_streaming.pipeline_generate",
            "--model",
            path,
            "--max-tokens",
            "2",
            "--streaming-experts",
            "--expert-cache-gb",
            repr(1.5 * e / GB),
        ],
        tmp_path,
    )
    assert (
        "ConfigurationError: pipeline rank 0 of 2 (layers 2-3): expert cache budget"
        in stderr
    ), stderr
    assert "pipeline rank 1 of 2" not in stderr


# -- a rank holds only the shards of its own layers ---------------------------------------------


def rank_shards(ckpt: Path, start: int, end: int) -> set:
    """The shards a rank running layers ``start..end-1`` needs: those of its layers and those of
    the weights outside any layer, by layer number as mlx-lm's ``sharded_load`` downloads them."""
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    need = set()
    for name, shard in weight_map.items():
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if m is None or start <= int(m.group(1)) < end:
            need.add(shard)
    return need


def partial_copy(ckpt: Path, dst: Path, shards: set) -> set:
    """``ckpt`` in ``dst`` (hard links) with only ``shards`` of its safetensors; returns the
    shards left out."""
    dst.mkdir(parents=True)
    left_out = set()
    for f in ckpt.iterdir():
        if f.suffix == ".safetensors" and f.name not in shards:
            left_out.add(f.name)
        else:
            os.link(f, dst / f.name)
    return left_out


class FakeGroup:
    """What ``pipeline(group)`` and loading read of a group: rank and size (no communication)."""

    def __init__(self, rank: int, size: int = 2):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


# with 4 layers in 4 shards, shards 1 and 4 hold weights outside the layers: qwen3_moe's rank 0
# (layers 2-3) does not need shard 2, deepseek_v3's rank 1 (layers 0-1) does not need shard 3
PARTIAL = {"qwen3_moe": (0, (2, 4)), "deepseek_v3": (1, (0, 2))}


@pytest.mark.parametrize("arch", ARCHS)
def test_rank_loads_with_only_its_own_shards(arch, ckpt, tmp_path, monkeypatch):
    """In this process, ``pipeline`` with a group that only says rank and size: the headers of
    absent shards are needed only when a layer of this rank lives there."""
    from mlx_lm.utils import sharded_load

    from mlx_lm_streaming.errors import CheckpointError
    from mlx_lm_streaming.integration.integration import install

    path = ckpt(arch)
    rank, (start, end) = PARTIAL[arch]
    dst = tmp_path / "rank"
    left_out = partial_copy(path, dst, rank_shards(path, start, end))
    assert left_out, "this rank should lack a shard"
    install()
    monkeypatch.setenv("MLX_LM_STREAMING_EXPERTS", "1")
    model, _ = sharded_load(str(dst), pipeline_group=FakeGroup(rank))
    state = model.expert_streaming
    assert state.pipeline == (rank, 2, start, end)
    own = [layer for layer in sorted(expert_tensors(path)) if start <= layer < end]
    assert [b.path for b in state.cache.banks] == [f"model.layers.{i}.mlp.switch_mlp" for i in own]
    # the other rank needs the absent shard: refused, naming the rank and the shard
    other = 1 - rank
    with pytest.raises(CheckpointError, match=rf"pipeline rank {other} of 2 .*missing from"):
        sharded_load(str(dst), pipeline_group=FakeGroup(other))
    # a load that is not a pipeline rank's still needs every shard the index names
    with pytest.raises(CheckpointError, match="missing from .*incomplete download"):
        mlx_lm.load(str(dst))


# Runs pipeline_generate on a model directory of this rank's own: {model}-rank{MLX_RANK}
PER_RANK_MODEL = """
import os, sys
from mlx_lm_streaming import pipeline_generate

argv = sys.argv[1:]
at = argv.index("--model") + 1
argv[at] = f"{argv[at]}-rank{os.environ['MLX_RANK']}"
pipeline_generate.main(argv)
"""


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_generate_with_only_their_own_shards(arch, ckpt, stock_text, tmp_path):
    path = ckpt(arch)
    ranges = {0: (2, 4), 1: (0, 2)}
    left_out = {}
    for rank, (start, end) in ranges.items():
        dst = tmp_path / f"model-rank{rank}"
        left_out[rank] = partial_copy(path, dst, rank_shards(path, start, end))
    assert any(left_out.values())
    e = expert_nbytes(expert_tensors(path)[1], num_experts(path))
    script = tmp_path / "per_rank_model.py"
    script.write_text(PER_RANK_MODEL)
    stdout, stderr = run_ranks(
        [
            sys.executable,
            script,
            "--model",
            tmp_path / "model",
            "--prompt",
            PROMPT,
            "--max-tokens",
            MAX_TOKENS,
            "--streaming-experts",
            "--expert-cache-gb",
            repr(6.5 * e / GB),
            "--stats-json",
            tmp_path / "rank{rank}.json",
        ],
        tmp_path,
    )
    expected = stock_text(arch)
    assert generated_text(stdout) == expected, stderr
    for rank, (start, end) in ranges.items():
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["text"] == expected
        assert tuple(report["layers"]) == (start, end)
        assert not {Path(f).name for f in report["files_opened"]} & left_out[rank]


# -- mlx_lm.server --pipeline over 2 ranks --------------------------------------------------------


def wait_healthy(port: int, proc: Started, timeout=TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.running():
            pytest.fail(f"server exited: {proc.stderr}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"server on port {port} not up in {timeout} s")


def chat(port: int) -> str:
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
        return json.load(r)["choices"][0]["message"]["content"]


def rank_pids(launcher_pid: int) -> dict:
    """{rank: pid} of the processes mlx.launch started (it starts them from threads)."""
    pids = {}
    for children in Path(f"/proc/{launcher_pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = [v for v in environ if v.startswith(b"MLX_RANK=")]
            if rank:
                pids[int(rank[0].split(b"=")[1])] = int(pid)
    return pids


@pytest.mark.skipif(
    not Path("/proc").is_dir(), reason="finds the rank processes in /proc"
)
def test_server_pipeline_answers_like_a_stock_server(ckpt, tmp_path):
    path = ckpt("qwen3_moe")
    e = expert_nbytes(expert_tensors(path)[0], num_experts(path))

    port = free_ports(1)
    stock = [BIN / "mlx_lm.server", "--model", path, "--port", port]
    with started(stock, tmp_path / "stock", clean_env(MLX_LM_STREAMING_HOOK="0")) as proc:
        wait_healthy(port, proc)
        expected = chat(port)

    port = free_ports(1)
    server = [BIN / "mlx_lm.server", "--model", path, "--port", port, "--pipeline"]
    streaming = ["--streaming-experts", "--expert-cache-gb", repr(6.5 * e / GB)]
    cmd = launch_cmd(*server, *streaming, "--streaming-stats")
    with started(cmd, tmp_path / "pipeline") as proc:
        wait_healthy(port, proc)
        assert chat(port) == expected
        # stop rank 0 as Ctrl-C would; rank 1 follows when its peer is gone; both print stats
        pids = rank_pids(proc.pid)
        assert sorted(pids) == [0, 1]
        os.kill(pids[0], signal.SIGTERM)
        _, stderr = proc.wait()
    lines = {int(m[1]): (int(m[3]), int(m[4])) for m in STATS_LINE.findall(stderr)}
    assert lines == {0: (2, 3), 1: (0, 1)}, stderr


# -- tensor parallelism is refused ----------------------------------------------------------------


def test_tensor_parallel_sharded_load_is_refused(ckpt, monkeypatch):
    from mlx_lm.utils import sharded_load

    from mlx_lm_streaming.integration.integration import install

    install()
    monkeypatch.setenv("MLX_LM_STREAMING_EXPERTS", "1")
    with pytest.raises(
        UnsupportedModelError, match="tensor parallelism .* not supported"
    ):
        sharded_load(str(ckpt("qwen3_moe")), tensor_group=mx.distributed.init())


def test_server_without_pipeline_exits_with_a_clear_error(ckpt, tmp_path):
    server = [
        BIN / "mlx_lm.server",
        "--model",
        ckpt("qwen3_moe"),
        "--port",
        free_ports(1),
    ]
    _, stderr = run_ranks([*server, "--streaming-experts"], tmp_path)
    assert (
        stderr.count("--streaming-experts over several ranks needs --pipeline") == 2
    ), stderr
