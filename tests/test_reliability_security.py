"""Security: nothing from a checkpoint is executed, and no shard outside the model directory is read.

Rule for symlinked shards (``CheckpointFiles._check_inside``): a ``model*.safetensors`` may be a symlink
only to a regular file inside the model directory (after resolving the directory itself, so a symlinked
model directory is fine), or, for a Hugging Face cache snapshot ``<repo>/snapshots/<rev>/``, to a file in
that same repo's ``blobs/``. Anything else is refused at load with the shard named.
"""

import ast
import hashlib
import importlib.metadata
import json
import shutil
import sysconfig
from pathlib import Path

import mlx.core as mx
import pytest
from support import load_stock, load_streaming

from mlx_lm_streaming.errors import CheckpointChangedError, CheckpointError, UnsupportedModelError
from mlx_lm_streaming.runtime.reads.index import CheckpointFiles

PROMPT = mx.array([[5, 17, 99, 3, 250, 41, 7]])


@pytest.fixture
def model_dir(checkpoint, tmp_path):
    copy = tmp_path / "models" / "tiny"
    shutil.copytree(checkpoint("qwen3_moe", "affine4"), copy)
    return copy


@pytest.fixture(scope="module")
def expected(checkpoint):
    stock, _ = load_stock(checkpoint("qwen3_moe", "affine4"))
    return stock(PROMPT)


def shards(path: Path):
    return sorted(path.glob("model*.safetensors"))


# --- nothing from a checkpoint is executed ------------------------------------------------------


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_model_file_is_never_executed_by_streaming(model_dir, tmp_path, trust_remote_code):
    marker = tmp_path / "executed"
    (model_dir / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\n")
    config = json.loads((model_dir / "config.json").read_text())
    config["model_file"] = "evil.py"
    (model_dir / "config.json").write_text(json.dumps(config))
    import mlx_lm.utils

    from mlx_lm_streaming.integration.integration import install
    from support import held_out_env

    install()
    with held_out_env(), pytest.raises(UnsupportedModelError, match="evil.py"):
        mlx_lm.utils.load_model(
            model_dir,
            model_config={"streaming_experts": True},
            trust_remote_code=trust_remote_code,
        )
    assert not marker.exists()


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_model_file_only_through_mlx_lms_own_trust_remote_code(model_dir, tmp_path, monkeypatch,
                                                               trust_remote_code):
    """Streaming asked for by the environment (as the CLI flags do) falls back to stock loading for a
    model_file model, so mlx-lm's own ``trust_remote_code`` alone decides whether the file runs."""
    marker = tmp_path / "executed"
    (model_dir / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((model_dir / "config.json").read_text())
    config["model_file"] = "evil.py"
    (model_dir / "config.json").write_text(json.dumps(config))
    import mlx_lm.utils

    from mlx_lm_streaming.integration.integration import install

    install()
    monkeypatch.setenv("MLX_LM_STREAMING_EXPERTS", "1")
    # evil.py defines no Model: mlx-lm fails after (or, untrusted, before) importing it
    with pytest.raises((ValueError, AttributeError)):
        mlx_lm.utils.load_model(model_dir, trust_remote_code=trust_remote_code)
    assert marker.exists() == trust_remote_code


def test_header_strings_are_data(model_dir, tmp_path):
    """Code in tensor names and metadata is never run (the header is parsed as JSON, nothing else)."""
    import struct

    marker = tmp_path / "executed"
    code = f"__import__('os').system('touch {marker}')"
    shard = shards(model_dir)[0]
    blob = shard.read_bytes()
    hlen = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + hlen])
    header["__metadata__"] = {"format": "mlx", "x": code, "y": "{{7*7}}"}
    raw = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + hlen :])
    (model_dir / "evil.safetensors").write_bytes(shard.read_bytes())  # not model*: never opened
    model, _ = load_streaming(model_dir)
    mx.eval(model(PROMPT))
    assert not marker.exists()


BUILTINS = {"eval", "exec", "compile", "__import__"}
MODULES = {"pickle", "marshal", "shelve", "dill", "cloudpickle"}
HOOK_OFF = '("0", "false", "no", "off")'
# what the .pth line may run, and nothing else (Python's site.py executes .pth lines that start with
# "import"; our one line must run exactly this, and only when MLX_LM_STREAMING_HOOK is not off or,
# with it off, when streaming is asked for: then install() only says in one line that it cannot be)
PTH_LINE = (
    "import os, sys; exec({code!r}) if os.environ.get('MLX_LM_STREAMING_HOOK', '1').strip()"
    f".lower() not in {HOOK_OFF} or os.environ.get('MLX_LM_STREAMING_EXPERTS') or "
    "'--streaming-experts' in getattr(sys, 'argv', ()) else None"
)
PTH_CODE = """
try:
    import mlx_lm_streaming._bootstrap as m
    m.install()
except Exception as e:
    if not hasattr(sys, "_mlx_lm_streaming_failed"):
        sys._mlx_lm_streaming_failed = e
        sys.stderr.write(
            "mlx-lm-streaming: startup hook failed, mlx-lm runs stock (%s: %s); "
            "MLX_LM_STREAMING_HOOK=0 silences this\\n" % (type(e).__name__, e)
        )
"""
START_ENTRIES = ["mlx_lm_streaming._bootstrap:install"]


def dynamic_code(name: str, source: str):
    """Calls of eval/exec/compile/__import__ (the builtins, not methods such as ``mx.eval``) and
    imports of pickle-like modules in Python ``source``, read with ``ast``."""
    offenders = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in BUILTINS:
                offenders.append(f"{name}:{node.lineno}: {node.func.id}()")
        elif isinstance(node, ast.Import):
            found = {a.name.split(".")[0] for a in node.names}
            offenders += [f"{name}:{node.lineno}: import {n}" for n in found & MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in MODULES:
                offenders.append(f"{name}:{node.lineno}: from {node.module}")
    return offenders


def pth_offenders(name: str, text: str):
    """A .pth runs its lines that start with ``import``: ours must run exactly ``PTH_LINE``."""
    run = [line for line in text.splitlines() if line.startswith(("import ", "import\t"))]
    other = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    if len(run) != 1 or other != run:
        return [f"{name}: expected one import line and comments, got {other}"]
    tree = ast.parse(run[0])
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    code = [c.args[0].value for c in calls if getattr(c.func, "id", None) == "exec"]
    if len(code) != 1 or not isinstance(code[0], str):
        return [f"{name}: expected one exec of a string, got {run[0]!r}"]
    offenders = []
    if ast.dump(tree) != ast.dump(ast.parse(PTH_LINE.format(code=code[0]))):
        offenders.append(f"{name}: the import line is not the expected one: {run[0]!r}")
    if ast.dump(ast.parse(code[0])) != ast.dump(ast.parse(PTH_CODE)):
        offenders.append(f"{name}: exec runs unexpected code: {code[0]!r}")
    return offenders


def installed_offenders(dist):
    """Every file of the installed distribution (its RECORD), each by kind; an unknown kind is an
    offender too, so a new kind of installed file must be added here."""
    files = {str(f): f for f in dist.files}
    offenders = []
    for name, f in sorted(files.items()):
        path = Path(f.locate())
        if ".dist-info/" in name and path.suffix != ".py":
            continue  # metadata, read and never run (entry points: checked below)
        if path.suffix == ".pyc":
            source = f"{path.parent.parent.name}/{path.name.split('.')[0]}.py"
            if not any(n.endswith(source) for n in files):
                offenders.append(f"{name}: compiled from no installed source")
        elif path.suffix == ".py" or name.startswith("../") and "/bin/" in f"/{name}":
            offenders += dynamic_code(name, path.read_text())
        elif path.suffix == ".pth":
            offenders += pth_offenders(name, path.read_text())
        elif path.suffix == ".start":
            lines = [x for x in path.read_text().splitlines() if x.strip() and x[0] != "#"]
            if lines != START_ENTRIES:
                offenders.append(f"{name}: runs {lines}, expected {START_ENTRIES}")
        else:
            offenders.append(f"{name}: installed file of unknown kind")
    for ep in dist.entry_points:
        if ep.value.split(".")[0].split(":")[0] != "mlx_lm_streaming":
            offenders.append(f"entry point {ep.name} = {ep.value}: outside our package")
    return offenders


def test_installed_files_run_no_dynamic_code():
    """No eval/exec/pickle in anything we install, but the .pth line's one ``exec`` of exactly
    ``PTH_CODE``: a checkpoint is only ever parsed as JSON + bytes. Walks the installed
    distribution's RECORD (the suite runs against a non-editable install)."""
    purelib = sysconfig.get_paths()["purelib"]
    dist = next(importlib.metadata.distributions(name="mlx-lm-streaming", path=[purelib]))
    names = {Path(str(f)).name for f in dist.files}
    assert {"mlx_lm_streaming.pth", "mlx_lm_streaming.start", "loading.py"} <= names
    assert installed_offenders(dist) == []


@pytest.mark.parametrize(
    "tamper",
    [
        lambda t: t + "import os; os.system('true')\n",
        lambda t: t.replace("m.install()", "m.install(); exec(open('x').read())"),
        lambda t: t.replace("import os, sys;", "import os, sys; __import__('x');"),
        lambda t: t.replace("not in (", "in ("),
        lambda t: t.replace("exec(", "eval("),
    ],
)
def test_pth_check_refuses_any_other_code(tamper):
    text = (Path(__file__).resolve().parent.parent / "hooks" / "mlx_lm_streaming.pth").read_text()
    assert pth_offenders("source .pth", text) == []
    assert pth_offenders("tampered .pth", tamper(text))


# --- shard paths cannot escape the model directory ----------------------------------------------


def test_shard_symlink_outside_the_model_dir_is_refused(model_dir, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shard = shards(model_dir)[1]
    target = outside / shard.name
    shutil.move(shard, target)
    shard.symlink_to(target)
    with pytest.raises(CheckpointError, match="outside the model directory") as info:
        load_streaming(model_dir)
    assert str(shard) in str(info.value)


def test_shard_symlink_to_a_device_is_refused(model_dir):
    shard = shards(model_dir)[1]
    shard.unlink()
    shard.symlink_to("/dev/zero")
    with pytest.raises(CheckpointError) as info:
        CheckpointFiles(model_dir)
    assert str(shard) in str(info.value)


def test_symlinks_inside_the_model_dir_and_a_symlinked_model_dir_work(model_dir, tmp_path, expected):
    sub = model_dir / "weights"
    sub.mkdir()
    for shard in shards(model_dir):
        shutil.move(shard, sub / shard.name)
        shard.symlink_to(Path("weights") / shard.name)
    link = tmp_path / "link-to-model"
    link.symlink_to(model_dir, target_is_directory=True)
    for path in (model_dir, link):
        model, _ = load_streaming(path, expert_cache_gb=1e-4)
        assert mx.array_equal(model(PROMPT), expected).item()


def hf_cache_layout(src: Path, hub: Path, repo: str = "models--acme--tiny") -> Path:
    """``<hub>/<repo>/snapshots/<rev>/<file> -> ../../blobs/<sha256>``, as huggingface_hub writes it."""
    blobs = hub / repo / "blobs"
    snapshot = hub / repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blobs / digest)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snapshot


def test_hugging_face_cache_snapshot_works(checkpoint, tmp_path, expected):
    snapshot = hf_cache_layout(checkpoint("qwen3_moe", "affine4"), tmp_path / "hub")
    assert all(s.is_symlink() for s in shards(snapshot))
    model, _ = load_streaming(snapshot, expert_cache_gb=1e-4)
    assert mx.array_equal(model(PROMPT), expected).item()
    # the HF_HOME itself behind a symlink (another disk) changes nothing
    link = tmp_path / "hub-link"
    link.symlink_to(tmp_path / "hub", target_is_directory=True)
    model, _ = load_streaming(link / snapshot.relative_to(tmp_path / "hub"), expert_cache_gb=1e-4)
    assert mx.array_equal(model(PROMPT), expected).item()


def test_snapshot_symlink_into_another_repos_blobs_is_refused(checkpoint, tmp_path):
    hub = tmp_path / "hub"
    snapshot = hf_cache_layout(checkpoint("qwen3_moe", "affine4"), hub)
    other = hub / "models--evil--other" / "blobs"
    other.mkdir(parents=True)
    shard = shards(snapshot)[0]
    shutil.copyfile(shard, other / "stolen")
    shard.unlink()
    shard.symlink_to(Path("..") / ".." / ".." / "models--evil--other" / "blobs" / "stolen")
    with pytest.raises(CheckpointError, match="outside the model directory") as info:
        CheckpointFiles(snapshot)
    assert str(shard) in str(info.value)


def test_retargeted_symlink_after_load_is_detected(model_dir, tmp_path):
    """A shard symlink pointed at another file after load is a changed checkpoint (new inode)."""
    model, _ = load_streaming(model_dir, expert_cache_gb=1e-4)
    for shard in shards(model_dir):
        copy = model_dir / (shard.name + ".copy")
        shutil.copyfile(shard, copy)
        shard.unlink()
        shard.symlink_to(copy.name)
    with pytest.raises(CheckpointChangedError, match="changed on disk"):
        mx.eval(model(PROMPT))
