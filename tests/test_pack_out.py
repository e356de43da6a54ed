"""Where ``mlx_lm_streaming pack --out`` writes, and how it stops (issue 37, items 1, 5 and 9): a
path ending in ``/`` is a directory, made if missing; a new name without extension is refused
rather than written as a file where a directory was meant; a path that cannot be written is a bad
option (exit status 2) whether its directory is missing or not writable; Ctrl-C leaves nothing
half written and exits 130 with one line."""

import os
import sys
from pathlib import Path

import pytest
from support import BIN, build_dense_checkpoint, one_error_line, run_cli

from mlx_lm_streaming.files.packfile import PACK_NAME, PackFile

pytestmark = pytest.mark.usefixtures("require_hook")


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("qwen3_moe")


def pack(ckpt, out, cwd, *extra):
    return run_cli([BIN / "mlx_lm_streaming", "pack", ckpt, "--out", out, "--quiet", *extra], cwd)


def test_a_new_directory_named_with_a_slash_is_made(ckpt, tmp_path):
    done = pack(ckpt, "newdir/", tmp_path)
    assert done.returncode == 0, done.stderr
    made = tmp_path / "newdir"
    assert made.is_dir() and [p.name for p in made.iterdir()] == [PACK_NAME]
    PackFile(made / PACK_NAME, ckpt).close()  # a valid pack of this model
    assert f"--expert-pack {made / PACK_NAME}" in done.stdout


def test_a_new_name_without_extension_is_refused_not_written_as_a_file(ckpt, tmp_path):
    out = pack(ckpt, "disk2", tmp_path)
    line = one_error_line(out, "--out disk2", "no such directory", "disk2/", "disk2.pack")
    assert out.returncode == 2, line
    assert not (tmp_path / "disk2").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_new_directory_is_made_only_inside_an_existing_one(ckpt, tmp_path):
    out = pack(ckpt, "missing/newdir/", tmp_path)
    line = one_error_line(out, "missing/newdir", "no directory missing")
    assert out.returncode == 2, line
    assert not (tmp_path / "missing").exists()


def test_a_directory_made_for_a_pack_that_fails_is_taken_away(ckpt, tmp_path):
    dense = build_dense_checkpoint(tmp_path / "dense", ckpt)
    out = pack(dense, "newdir/", tmp_path)
    one_error_line(out, "is not a Mixture-of-Experts model")
    assert not (tmp_path / "newdir").exists()


def _unwritable(tmp_path) -> Path:
    if os.geteuid() == 0:
        return Path("/sys")  # sysfs: not writable, even for root
    where = tmp_path / "read-only"
    where.mkdir()
    where.chmod(0o555)
    return where


@pytest.mark.parametrize("case", ["missing directory", "read-only directory", "read-only new"])
def test_a_path_that_cannot_be_written_is_a_bad_option_status_2(case, ckpt, tmp_path):
    """One exit status for one kind of failure: the path given cannot be written (2, as every
    output path refused before writing, docs/usage.md); a disk failing mid-write is 1."""
    if case == "missing directory":
        out = tmp_path / "missing" / PACK_NAME
    elif case == "read-only directory":
        out = _unwritable(tmp_path) / PACK_NAME
    else:
        out = f"{_unwritable(tmp_path) / 'new'}/"
    done = pack(ckpt, out, tmp_path)
    line = one_error_line(done, str(out).rstrip("/"))
    assert done.returncode == 2, line


def test_a_disk_failing_mid_write_is_status_1(ckpt, tmp_path):
    script = (
        "import errno, os, sys; from mlx_lm_streaming.__main__ import main; "
        "os.fsync = lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, 'Input/output error')); "
        "sys.exit(main(sys.argv[1:]))"
    )
    out = tmp_path / "p.pack"
    done = run_cli([sys.executable, "-c", script, "pack", ckpt, "--out", out, "--quiet"], tmp_path)
    line = one_error_line(done, out, "Input/output error", "no partial pack")
    assert done.returncode == 1, line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_shard_that_cannot_be_read_while_packing_is_not_the_out_paths_fault(ckpt, tmp_path):
    """Permission denied on a shard (not on ``--out``) is the checkpoint's failure: status 1, and
    the line does not send the user to another --out."""
    script = (
        "import errno, os, sys; from mlx_lm_streaming.__main__ import main; stock = os.open\n"
        "def deny(path, flags, *a, **k):\n"
        "    if str(path).endswith('.safetensors'):\n"
        "        raise PermissionError(errno.EACCES, 'Permission denied', str(path))\n"
        "    return stock(path, flags, *a, **k)\n"
        "os.open = deny; sys.exit(main(sys.argv[1:]))"
    )
    cmd = [sys.executable, "-c", script, "pack", ckpt, "--out", tmp_path / "p.pack", "--quiet"]
    done = run_cli(cmd, tmp_path)
    line = one_error_line(done, "Permission denied", ".safetensors")
    assert done.returncode == 1 and "give --out" not in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_ctrl_c_while_packing_is_one_line_status_130_and_nothing_half_written(ckpt, tmp_path):
    """SIGINT arrives after a few experts are copied (os.preadv made to send it)."""
    script = (
        "import os, signal, sys; from mlx_lm_streaming.__main__ import main; "
        "stock = os.preadv; calls = []\n"
        "def preadv(*a):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 5: os.kill(os.getpid(), signal.SIGINT)\n"
        "    return stock(*a)\n"
        "os.preadv = preadv; sys.exit(main(sys.argv[1:]))"
    )
    out = tmp_path / "disk2"
    out.mkdir()
    cmd = [sys.executable, "-c", script, "pack", ckpt, "--out", out, "--quiet"]
    done = run_cli(cmd, tmp_path)
    line = one_error_line(done, "interrupted")
    assert done.returncode == 130, line
    assert list(out.iterdir()) == [], "no pack, no temporary file, no lock file"
    # and a pack that was there stays as it was
    assert pack(ckpt, out, tmp_path).returncode == 0
    before = (out / PACK_NAME).read_bytes()
    again = run_cli([*cmd, "--force"], tmp_path)
    one_error_line(again, "interrupted")
    assert again.returncode == 130
    assert [p.name for p in out.iterdir()] == [PACK_NAME]
    assert (out / PACK_NAME).read_bytes() == before
