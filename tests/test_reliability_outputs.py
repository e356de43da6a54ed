"""The files we write never cost a user a file, and never fail a generation (issue 21, items 1-2).

Outputs: the routing trace (``--record-routing``), the timeline (``--streaming-trace``), the expert
pack (``pack --out``), the plot (``plan --plot``). Each refusal must leave the file byte for byte as
it was; a trace that cannot be written must leave the generation exactly stock's. Most cases run in
this process; the commands of the issue run as the real commands once each.
"""

import errno
import hashlib
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from support import (
    BIN,
    clean_env,
    decode,
    generate_cmd,
    generated_text,
    load_streaming,
    one_error_line,
    run_cli,
    same,
)

from mlx_lm_streaming.errors import ConfigurationError, StreamingError

KINDS = ["record_routing", "trace", "pack", "plot"]
CASES = ["text file", "model shard", "config.json", "directory", "device", "empty path"]
TEXT = "my notes: nothing here may be lost\n" * 20


@pytest.fixture(scope="module")
def own_ckpt(checkpoint, tmp_path_factory):
    """A private copy (not hard links) of the checkpoint: a failing test may write over its files
    without touching the session's."""
    return Path(shutil.copytree(checkpoint("qwen3_moe"), tmp_path_factory.mktemp("own") / "ck"))


def fingerprint(path: Path):
    if not os.path.lexists(path):
        return None
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        return ("dir", sorted(os.listdir(path)))
    if not stat.S_ISREG(st.st_mode):
        return ("special", stat.S_IFMT(st.st_mode), st.st_rdev)
    return ("file", hashlib.sha256(path.read_bytes()).hexdigest())


def target(case, ckpt: Path, tmp_path: Path, kind: str) -> str:
    if case == "text file":
        path = tmp_path / ("notes.png" if kind == "plot" else "notes.txt")
        path.write_text(TEXT)
        return str(path)
    if case == "model shard":
        return str(sorted(ckpt.glob("model-*.safetensors"))[-1])
    if case == "config.json":
        return str(ckpt / "config.json")
    if case == "directory":
        path = tmp_path / "a-dir"
        # for pack, --out DIR names DIR/experts.pack: here a directory
        (path / ("experts.pack" if kind == "pack" else "x")).mkdir(parents=True)
        return str(path)
    if case == "device":
        return os.devnull
    return ""


def write_output(kind: str, path: str, ckpt: Path):
    """Ask for ``kind`` at ``path`` the way the Python API does."""
    if kind in ("record_routing", "trace"):
        model, _ = load_streaming(ckpt, **{kind: path})
        model.expert_streaming.close()
    elif kind == "pack":
        from mlx_lm_streaming.tools.pack import pack_checkpoint

        pack_checkpoint(ckpt, path, progress=False)
    else:
        from mlx_lm_streaming.tools.budget_table import plot_path

        plot_path(path)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_path_that_is_not_an_output_of_the_kind_is_refused_untouched(
    own_ckpt, tmp_path, kind, case
):
    if kind == "plot" and case == "device":
        pytest.skip("--plot /dev/null writes /dev/null.png: a plot always has an extension")
    path = target(case, own_ckpt, tmp_path, kind)
    shown = Path(path) if path else None
    before = fingerprint(shown) if shown else None
    model_before = {p.name: fingerprint(p) for p in own_ckpt.iterdir()}
    with pytest.raises(StreamingError) as info:
        write_output(kind, path, own_ckpt)
    assert isinstance(info.value, ConfigurationError), info.value
    message = str(info.value)
    assert "\n" not in message
    if path:
        assert path in message, message
        assert fingerprint(shown) == before
    else:
        assert "empty path" in message
    assert {p.name: fingerprint(p) for p in own_ckpt.iterdir()} == model_before


def test_the_models_own_file_is_named_as_such(own_ckpt):
    shard = sorted(own_ckpt.glob("model-*.safetensors"))[-1]
    with pytest.raises(ConfigurationError, match="one of the model's files, not a routing trace"):
        load_streaming(own_ckpt, record_routing=str(shard))


def valid_trace(path: Path, ckpt: Path) -> bytes:
    """A routing trace (and a timeline) of a real run, written at ``path``."""
    import mlx.core as mx

    model, _ = load_streaming(ckpt, record_routing=str(path), trace=str(path) + ".json")
    model(mx.array([[1, 2, 3, 4]]))
    model.expert_streaming.close()
    return path.read_bytes()


def test_outputs_are_opened_only_after_every_check_passed(own_ckpt, tmp_path):
    """``--expert-cache-gb 1e-9 --record-routing notes.txt`` emptied the file and then failed on the
    budget: an existing trace and timeline stay as they were when the load fails."""
    trace = tmp_path / "old.jsonl"
    old = valid_trace(trace, own_ckpt)
    old_timeline = Path(str(trace) + ".json").read_bytes()
    with pytest.raises(ConfigurationError, match="below the minimum"):
        load_streaming(
            own_ckpt, expert_cache_gb=1e-9, record_routing=str(trace), trace=str(trace) + ".json"
        )
    assert trace.read_bytes() == old
    assert Path(str(trace) + ".json").read_bytes() == old_timeline
    # a load that passes but never runs a token leaves the trace too
    model, _ = load_streaming(own_ckpt, record_routing=str(trace))
    model.expert_streaming.close()
    assert trace.read_bytes() == old
    # a run replaces an output of the same kind, and takes an empty file (nothing to lose)
    import json

    import mlx.core as mx

    from mlx_lm_streaming.files.routing_trace import read_trace

    empty = tmp_path / "empty.json"
    empty.touch()
    model, _ = load_streaming(own_ckpt, record_routing=str(trace), trace=str(empty))
    model(mx.array([[5, 6]]))
    model(mx.array([[7]]))
    model.expert_streaming.close()
    assert [r.phase for r in read_trace(trace).rows] == ["prefill", "prefill", "decode"]
    assert json.loads(empty.read_text())[0]["name"] == "process_name"


# -- a failing output never fails the generation ---------------------------------------------------


class FullDisk:
    """A file on a disk that fills up after ``room`` bytes: writes beyond raise ENOSPC."""

    def __init__(self, file, room):
        self.file, self.room = file, room

    def write(self, text):
        if len(text) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(text)
        return self.file.write(text)

    def __getattr__(self, name):
        return getattr(self.file, name)


@pytest.mark.parametrize("room", [0, 600])
@pytest.mark.parametrize("kind", ["record_routing", "trace"])
def test_a_full_disk_stops_the_output_not_the_generation(
    q3, tmp_path, monkeypatch, capfd, kind, room
):
    import builtins

    from mlx_lm_streaming.files import timeline

    path, tokens, stock = q3
    out = tmp_path / "out"
    real_open = builtins.open

    def open_on_a_full_disk(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return FullDisk(f, room) if str(file) == str(out) and "w" in mode else f

    monkeypatch.setattr(builtins, "open", open_on_a_full_disk)
    monkeypatch.setattr(timeline, "FLUSH_EVENTS", 8)  # timeline writes during the run too
    thread_errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: thread_errors.append(args))
    capfd.readouterr()
    model, _ = load_streaming(path, **{kind: str(out)})
    got = decode(model, tokens)
    model.expert_streaming.close()
    assert same(got, stock)
    assert not thread_errors
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "writing the" in line]
    assert len(lines) == 1, err
    assert str(out) in lines[0] and "No space left on device" in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("kind", ["record_routing", "trace"])
def test_a_revoked_permission_stops_the_output_not_the_generation(
    q3, tmp_path, monkeypatch, capfd, kind
):
    import builtins

    path, tokens, stock = q3
    out = tmp_path / "out"
    real_open = builtins.open

    def refused(file, mode="r", *args, **kwargs):
        if str(file) == str(out) and "w" in mode:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return real_open(file, mode, *args, **kwargs)

    model, _ = load_streaming(path, **{kind: str(out)})
    # revoked after the load's checks passed, before the file is opened
    monkeypatch.setattr(builtins, "open", refused)
    capfd.readouterr()
    got = decode(model, tokens)
    model.expert_streaming.close()
    assert same(got, stock)
    err = capfd.readouterr().err
    assert [line for line in err.splitlines() if "writing the" in line] == [
        f"mlx-lm-streaming: {out}: writing the "
        f"{'routing trace' if kind == 'record_routing' else 'timeline'} failed (Permission "
        "denied); stopped writing it, the generation goes on"
    ]


# -- the commands of the issue, as a user runs them --------------------------------------------------


def test_pack_out_over_a_text_file_is_refused_untouched(own_ckpt, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text(TEXT)
    out = run_cli([BIN / "mlx_lm_streaming", "pack", own_ckpt, "--out", notes], tmp_path)
    line = one_error_line(out, str(notes), "is not an expert pack")
    assert out.returncode == 2, line
    assert notes.read_text() == TEXT


def test_record_routing_into_a_shard_is_refused_untouched(own_ckpt, tmp_path):
    shard = sorted(own_ckpt.glob("model-*.safetensors"))[-1]
    before = fingerprint(shard)
    out = run_cli(
        generate_cmd(own_ckpt, "--streaming-experts", "--record-routing", shard), tmp_path
    )
    one_error_line(out, "argument --record-routing", str(shard), "one of the model's files")
    assert fingerprint(shard) == before


def _full_at(limit):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so that writes fail instead (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


def test_the_generate_command_finishes_when_its_traces_fill_the_disk(checkpoint, stock_text, tmp_path):
    """Both outputs at once on a "disk" that holds 1000 bytes per file (RLIMIT_FSIZE): each is given
    up in one line, the text is stock's, the exit status 0. Before: 2-3 tracebacks."""
    ckpt = checkpoint("qwen3_moe")
    trace, timeline = tmp_path / "routing.jsonl", tmp_path / "timeline.json"
    cmd = generate_cmd(
        ckpt, "--streaming-experts", "--record-routing", trace, "--streaming-trace", timeline
    )
    out = subprocess.run(
        [str(c) for c in cmd],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_full_at(1000),
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert generated_text(out.stdout) == stock_text("qwen3_moe")
    failed = [line for line in out.stderr.splitlines() if "writing the" in line]
    assert sorted(failed) == sorted(
        f"mlx-lm-streaming: {path}: writing the {what} failed (File too large); stopped writing "
        "it, the generation goes on"
        for path, what in ((trace, "routing trace"), (timeline, "timeline"))
    ), out.stderr
    assert trace.stat().st_size <= 1000 and timeline.stat().st_size <= 1000


# -- a plot replaces only a plot of ours (issue 27) ------------------------------------------------


def foreign_plot(path: Path) -> bytes:
    """A file of the plot's format that --plot did not write: matplotlib's own, without our mark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(1, 1))
    fig.savefig(path)
    plt.close(fig)
    return path.read_bytes()


@pytest.mark.parametrize("ext", [".png", ".svg", ".pdf"])
def test_a_plot_replaces_only_a_plot_that_plot_wrote(tmp_path, ext):
    """The "same kind" check looked only at the PNG signature: any PNG (a photo) was overwritten.
    Our plots carry ``PLOT_MARK`` in their metadata (for a PDF, near the end)."""
    pytest.importorskip("matplotlib")
    from mlx_lm_streaming.tools.budget_table import BudgetRow, plot, plot_path

    photo = tmp_path / f"photo{ext}"
    before = foreign_plot(photo)
    with pytest.raises(ConfigurationError) as info:
        plot_path(photo)
    message = str(info.value)
    assert message.startswith(f"--plot {photo}: exists and is not a plot that --plot wrote")
    assert photo.read_bytes() == before
    ours = tmp_path / f"budget{ext}"
    rows = [BudgetRow(f"{p}%", p * 10**6, [1], 10**6, p / 100, 0.1, 10.0) for p in (10, 50, 100)]
    plot(rows, ours, "first")
    first = ours.read_bytes()
    assert plot_path(ours) == ours  # ours: may be replaced
    plot(rows, ours, "second, another title")
    assert ours.read_bytes() != first


def test_plan_plot_over_a_photo_is_refused_untouched(own_ckpt, tmp_path):
    """The command of the issue: `plan MODEL --routing-trace r.jsonl --plot photo.png`."""
    pytest.importorskip("matplotlib")
    from mlx_lm_streaming.files.routing_trace import TraceWriter

    photo = tmp_path / "photo.png"
    before = foreign_plot(photo)
    trace = tmp_path / "r.jsonl"
    with TraceWriter(trace, 2, 8, 2, model="synthetic") as writer:
        for i in range(6):
            writer.token(0, "prefill" if i < 2 else "decode", [[i % 8, (i + 1) % 8]] * 2)
    cmd = [BIN / "mlx_lm_streaming", "plan", own_ckpt, "--routing-trace", trace, "--plot", photo]
    out = run_cli(cmd, tmp_path)
    line = one_error_line(out, "mlx_lm_streaming plan: error: --plot", photo)
    assert "is not a plot that --plot wrote" in line and out.returncode == 2, line
    assert photo.read_bytes() == before
