"""Pack under failure: a full disk (ENOSPC) or a pack killed mid-way never leaves a pack that is
accepted, never touches the checkpoint, and a re-run restarts cleanly. Another model's pack is never
replaced without ``--force`` (issue 27)."""

import errno
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import mlx.core as mx
import pytest
from support import BIN, load_stock, load_streaming, one_error_line, run_cli

import mlx_lm_streaming.files.packfile as pack_mod
from mlx_lm_streaming.errors import CheckpointError, ConfigurationError, ExpertIOError
from mlx_lm_streaming.tools.pack import pack_checkpoint
from mlx_lm_streaming.files.packfile import PACK_NAME


def digest(path):
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.iterdir())
        if f.is_file()
    }


def logits(model):
    out = model(mx.array([[3, 1, 4, 1, 5, 9, 2, 6]]))
    mx.eval(out)
    return out


@pytest.fixture
def ckpt(checkpoint, tmp_path):
    """A private copy (hard links) of a small checkpoint, so packs written here stay here."""
    src = checkpoint("qwen3_moe", "affine4")
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith(PACK_NAME):
            os.link(f, dst / f.name)
    return dst


def test_enospc_while_packing_names_the_file_and_leaves_nothing(ckpt, monkeypatch):
    before = digest(ckpt)
    real_fsync = os.fsync

    def full_disk(fd):
        # data is only known to be on disk at fsync: that is where a full disk shows up
        if os.fstat(fd).st_size > 0 and not os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(pack_mod.os, "fsync", full_disk)
    with pytest.raises(ExpertIOError, match=PACK_NAME) as info:
        pack_checkpoint(ckpt, progress=False)
    assert "No space left" in str(info.value)
    monkeypatch.undo()
    assert digest(ckpt) == before
    assert not list(ckpt.glob(PACK_NAME + "*"))
    with pytest.raises(CheckpointError, match="mlx_lm_streaming pack"):
        load_streaming(ckpt, store="packed")


KILLED_PACK = textwrap.dedent(
    """
    import sys, time, zlib
    import mlx_lm_streaming.files.packfile as pack_mod
    from mlx_lm_streaming.tools.pack import pack_checkpoint
    real = zlib.crc32
    def slow(*a):
        print("writing", flush=True)
        time.sleep(0.5)
        return real(*a)
    pack_mod.zlib.crc32 = slow
    pack_checkpoint(sys.argv[1], progress=False)
    """
)


def test_pack_killed_midway_is_never_accepted_and_rerun_restarts(ckpt):
    before = digest(ckpt)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_PACK, str(ckpt)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
        time.sleep(0.2)
        assert list(ckpt.glob(PACK_NAME + ".tmp-*")), "the pack is written to a temporary file"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert not (ckpt / PACK_NAME).exists()
    with pytest.raises(CheckpointError, match="mlx_lm_streaming pack"):
        load_streaming(ckpt, store="packed")
    assert {k: v for k, v in digest(ckpt).items() if not k.startswith(PACK_NAME)} == before

    # a re-run removes the dead run's temporary file and writes a pack that streams exactly
    pack_checkpoint(ckpt, progress=False)
    assert not list(ckpt.glob(PACK_NAME + ".tmp-*"))
    stock, _ = load_stock(ckpt)
    model, _ = load_streaming(ckpt, store="packed")
    assert mx.array_equal(logits(stock), logits(model)).item()


def test_another_models_pack_is_not_replaced_without_force(ckpt, tmp_path):
    """`pack MODEL_B --out DIR` over MODEL_A's pack replaced it, exit 0, with only "made from
    model-00001-of-00002.safetensors, missing now; writing a new pack". Now refused in one line
    naming both models; --force replaces it. Using it with the wrong model names both too."""
    from synthetic import build_checkpoint

    other = build_checkpoint(tmp_path / "b", "qwen3_moe", shards=1)  # other shard names
    where = tmp_path / "packs"
    where.mkdir()
    pack = pack_checkpoint(ckpt, where, progress=False)
    before = pack.read_bytes()
    out = run_cli([BIN / "mlx_lm_streaming", "pack", other, "--out", where, "--quiet"], tmp_path)
    line = one_error_line(out, pack, f"another model ({ckpt.resolve()}), not of {other}", "--force")
    assert out.returncode == 2, line
    assert pack.read_bytes() == before
    with pytest.raises(CheckpointError) as info:
        load_streaming(other, pack=str(pack))
    assert str(info.value).startswith(
        f"{pack}: the expert pack of another model: made from the checkpoint at "
        f"{ckpt.resolve()}, not {other} ({other} has no model-00001-of-00002.safetensors)"
    ), info.value
    with pytest.raises(ConfigurationError, match="another model"):
        pack_checkpoint(other, where, progress=False)  # the Python API: the same refusal
    pack_checkpoint(other, where, progress=False, force=True)
    stock, _ = load_stock(other)
    model, _ = load_streaming(other, pack=str(pack))
    assert mx.array_equal(logits(stock), logits(model)).item()
    model.expert_streaming.close()
