"""``pack`` wired in (issue 15, item 5): ``--out DIR``, the free-space check, the command line it
prints, and ``--expert-pack`` / ``MLX_LM_STREAMING_PACK`` / ``pack`` pointing the ``packed`` store at a
pack outside the model directory."""

import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest
from support import (
    BIN,
    clean_env,
    generate_cmd,
    generated_text,
    load_streaming,
    one_error_line,
    run,
    run_cli,
)

from mlx_lm_streaming.errors import ConfigurationError
from mlx_lm_streaming.runtime.options import ENV, StreamingOptions
from mlx_lm_streaming.runtime.sizes import decimal_gb
from mlx_lm_streaming.files.packfile import PACK_NAME


@pytest.fixture(scope="module")
def second_disk(checkpoint, tmp_path_factory):
    """The test checkpoint packed with ``--out DIR`` into a directory of its own; the command's
    stdout."""
    ckpt = checkpoint("qwen3_moe")
    disk2 = tmp_path_factory.mktemp("disk2")
    done = run([BIN / "mlx_lm_streaming", "pack", ckpt, "--out", disk2, "--quiet"], disk2)
    return ckpt, disk2, done.stdout


def test_pack_out_dir_then_the_printed_command_gives_stock_text(second_disk, tmp_path):
    ckpt, disk2, stdout = second_disk
    assert (disk2 / PACK_NAME).is_file() and not (ckpt / PACK_NAME).exists()
    last = stdout.splitlines()[-1]
    assert last.startswith("use it with: "), stdout
    command = shlex.split(last[len("use it with: ") :])
    # a command the shell finds, its environment activated or not (issue 45, item 11)
    assert Path(shutil.which(command[0])).samefile(BIN / "mlx_lm.generate"), command
    assert command[1:] == [
        "--model",
        str(ckpt.resolve()),
        "--streaming-experts",
        "--expert-store",
        "packed",
        "--expert-pack",
        str((disk2 / PACK_NAME).resolve()),
    ]
    stock = generated_text(run(generate_cmd(ckpt), tmp_path).stdout)
    streamed = run(command + generate_cmd(ckpt)[3:], tmp_path)
    assert generated_text(streamed.stdout) == stock
    # the variable alone (no --expert-store) reads the same pack, given as its directory
    env = clean_env(**{ENV["enabled"]: "1", ENV["pack"]: str(disk2)})
    assert generated_text(run(generate_cmd(ckpt), tmp_path, env=env).stdout) == stock


def test_the_pack_option_reads_that_pack(second_disk):
    ckpt, disk2, _ = second_disk
    model, _ = load_streaming(ckpt, pack=str(disk2))
    store = model.expert_streaming.store
    try:
        assert store.name == "packed" and store.pack.path == disk2 / PACK_NAME
    finally:
        model.expert_streaming.close()


def test_pack_refuses_without_free_space_naming_dir_needed_and_free(checkpoint, tmp_path):
    """The real command, with ``shutil.disk_usage`` saying 1000 bytes are free."""
    ckpt = checkpoint("qwen3_moe")
    out = tmp_path / "full"
    out.mkdir()
    script = (
        "import shutil, sys, types; from mlx_lm_streaming.__main__ import main; "
        "shutil.disk_usage = lambda p: types.SimpleNamespace(total=10**12, used=10**12, free=1000); "
        "sys.exit(main(sys.argv[1:]))"
    )
    cmd = [sys.executable, "-c", script, "pack", ckpt, "--out", out]  # no progress bar either
    line = one_error_line(run_cli(cmd, tmp_path), out, "0.000001 GB are free")
    assert not list(out.iterdir()), "nothing is written"
    # the bytes it asked for are the size of the pack it writes
    run([BIN / "mlx_lm_streaming", "pack", ckpt, "--out", out, "--quiet"], tmp_path)
    assert f"needs {decimal_gb(os.path.getsize(out / PACK_NAME))}," in line


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--expert-store", "memory", "--expert-pack", "{disk2}"], "--expert-store packed"),
        (["--expert-pack", "{missing}"], "no such file"),
    ],
)
def test_bad_expert_pack_flags_are_one_line(second_disk, tmp_path, flags, named):
    ckpt, disk2, _ = second_disk
    paths = {"disk2": disk2, "missing": tmp_path / "nothing"}
    flags = [f.format(**paths) for f in flags]
    cmd = generate_cmd(ckpt, "--streaming-experts", *flags)
    one_error_line(run_cli(cmd, tmp_path), "argument --expert-pack", named)


def test_pack_option_implies_the_packed_store_and_refuses_others():
    options = StreamingOptions(pack="/d/experts.pack")
    assert options.store == "packed"
    assert options.store_options == {"path": "/d/experts.pack"}
    with pytest.raises(ConfigurationError, match="pack needs the packed store"):
        StreamingOptions(pack="/d", store="memory")
    with pytest.raises(ConfigurationError, match="differ"):
        StreamingOptions(pack="/d", store_options={"path": "/e"})
    env = {ENV["enabled"]: "1", ENV["pack"]: "/d", ENV["store"]: "safetensors"}
    with pytest.raises(ConfigurationError, match=f"{ENV['pack']} needs {ENV['store']}=packed"):
        StreamingOptions.from_env(env)
