"""Bounded fuzz of the checkpoint parser (hypothesis): a few seconds in CI. ``tests/fuzz_long.py`` runs
the same properties for longer (and under atheris when it is installed).

Whatever the bytes, ``read_header`` and ``CheckpointFiles`` either return ranges that lie inside the file,
do not overlap and agree with dtype and shape, or raise ``CheckpointError`` naming the file (and the
tensor, when one entry is at fault). Never another exception, a hang, a read past the end or an
allocation sized by what the header claims.
"""

import json
import math
import os
import struct
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save as st_save

from mlx_lm_streaming.errors import CheckpointError
from mlx_lm_streaming.runtime.reads.index import CheckpointFiles
from mlx_lm_streaming.runtime.reads.safetensors_header import DTYPES, read_header
from mlx_lm_streaming.stores.safetensors import SafetensorsStore

FUZZ = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", 100)),
    deadline=5000,  # ms per example: a slow parse (quadratic, huge allocation) fails the test
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)

# --- the properties (shared with fuzz_long.py) --------------------------------------------------


def check_header_result(path: Path, refs: dict) -> None:
    """Ranges returned for an accepted file are inside it, consistent and disjoint; the store reads
    exactly those bytes."""
    size = path.stat().st_size
    blob = path.read_bytes()
    hlen = struct.unpack("<Q", blob[:8])[0]
    spans = []
    for name, ref in refs.items():
        assert ref.name == name and ref.file == path
        assert 8 + hlen <= ref.offset <= ref.offset + ref.nbytes <= size
        assert ref.nbytes == math.prod(ref.shape) * DTYPES[ref.dtype][1]
        spans.append((ref.offset, ref.offset + ref.nbytes))
    spans.sort()
    assert all(b1 >= e0 for (_, e0), (b1, _) in zip(spans, spans[1:]))
    if refs:
        files = CheckpointFiles(path.parent, files=[path])
        with SafetensorsStore(files, threads=2) as store:
            jobs = [(ref, memoryview(bytearray(ref.nbytes))) for ref in refs.values()]
            store.read_many(jobs)
            for ref, out in jobs:
                assert bytes(out) == blob[ref.offset : ref.offset + ref.nbytes]


def parse_or_named_error(path: Path, culprit=None):
    """``read_header(path)``: accepted and consistent, or a CheckpointError naming the file (and
    ``culprit``, when given). Returns the refs or the error."""
    try:
        refs, _ = read_header(path)
    except CheckpointError as e:
        msg = str(e)
        assert str(path) in msg, msg
        assert len(msg) < 2000, "error message sized by the damaged header"
        if culprit is not None:
            assert repr(culprit)[:60].rstrip("'") in msg, (culprit, msg)
        return e
    check_header_result(path, refs)
    return refs


def write_file(path: Path, header: bytes, data: bytes, hlen=None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if hlen is None else hlen) + header + data)
    return path


# --- strategies ---------------------------------------------------------------------------------

names = st.text(min_size=1, max_size=30).filter(lambda s: s != "__metadata__")
any_int = st.one_of(
    st.integers(-3, 70), st.integers(-(2**70), 2**70), st.sampled_from([2**63 - 1, 2**64, -1])
)
json_junk = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False) | any_int | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
dtypes = st.one_of(st.sampled_from(list(DTYPES)), st.sampled_from(["F64", "F8_E4M3", "f32", "", "Q4"]),
                   json_junk)
shapes = st.one_of(st.lists(st.integers(0, 6), max_size=4), st.lists(any_int, max_size=5), json_junk)
offsets = st.one_of(st.tuples(st.integers(0, 300), st.integers(0, 300)).map(list),
                    st.lists(any_int, max_size=3), json_junk)
entries = st.one_of(
    st.fixed_dictionaries({"dtype": dtypes, "shape": shapes, "data_offsets": offsets}),
    json_junk,
)


@st.composite
def valid_checkpoints(draw):
    """A real safetensors file (written by the safetensors library) of small random tensors."""
    tensors = {}
    for name in draw(st.lists(names, max_size=5, unique=True)):
        dtype = draw(st.sampled_from(["uint8", "int32", "float16", "float32", "uint32", "int64"]))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        tensors[name] = (np.arange(math.prod(shape)) % 97).astype(dtype).reshape(shape)
    return tensors


# --- tests --------------------------------------------------------------------------------------


@FUZZ
@given(blob=st.binary(max_size=400))
def test_random_bytes(tmp_path, blob):
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob)
    parse_or_named_error(path)


@FUZZ
@given(header=st.dictionaries(names, entries, max_size=6), data=st.binary(max_size=300),
       lie=st.one_of(st.none(), st.integers(-20, 20), st.sampled_from([2**64 - 1, 2**40])))
def test_random_headers(tmp_path, header, data, lie):
    raw = json.dumps(header).encode()
    hlen = None if lie is None else max(0, min(len(raw) + lie, 2**64 - 1)) if lie < 2**30 else lie
    parse_or_named_error(write_file(tmp_path / "model.safetensors", raw, data, hlen))


@FUZZ
@given(tensors=valid_checkpoints())
def test_valid_files_parse_exactly(tmp_path, tensors):
    path = tmp_path / "model.safetensors"
    path.write_bytes(st_save(tensors))
    refs, _ = read_header(path)
    assert set(refs) == set(tensors)
    blob = path.read_bytes()
    for name, arr in tensors.items():
        ref = refs[name]
        assert ref.shape == arr.shape and ref.mx_dtype.size == arr.dtype.itemsize
        assert blob[ref.offset : ref.offset + ref.nbytes] == arr.tobytes()
    check_header_result(path, refs)


MUTATIONS = {
    "offsets past the end": lambda e, n: {**e, "data_offsets": [e["data_offsets"][0], n + 1]},
    "offsets far past the end": lambda e, n: {**e, "data_offsets": [2**62, 2**62 + 4]},
    "reversed offsets": lambda e, n: {**e, "data_offsets": e["data_offsets"][::-1]}
    if e["data_offsets"][0] != e["data_offsets"][1]
    else {**e, "data_offsets": [1, 0]},
    "negative offset": lambda e, n: {**e, "data_offsets": [-4, e["data_offsets"][1]]},
    "unknown dtype": lambda e, n: {**e, "dtype": "F8_E5M2"},
    "dtype not a string": lambda e, n: {**e, "dtype": ["F32"]},
    "size disagrees": lambda e, n: {**e, "shape": e["shape"] + [3] if math.prod(e["shape"]) else [1]},
    "huge shape": lambda e, n: {**e, "shape": [2**40, 2**40, 2**40]},
    "huge rank": lambda e, n: {**e, "shape": [2**62] * 20000},
    "negative dim": lambda e, n: {**e, "shape": [-1] + e["shape"]},
    "float dim": lambda e, n: {**e, "shape": [1.5]},
    "bool dim": lambda e, n: {**e, "shape": [True]},
    "missing offsets": lambda e, n: {k: v for k, v in e.items() if k != "data_offsets"},
    "entry not an object": lambda e, n: [e],
}


@FUZZ
@given(tensors=valid_checkpoints(), data=st.data(), mutation=st.sampled_from(sorted(MUTATIONS)))
def test_damaged_entry_names_file_and_tensor(tmp_path, tensors, data, mutation):
    assume(tensors)
    blob = st_save(tensors)
    hlen = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + hlen])
    body = blob[8 + hlen :]
    victim = data.draw(st.sampled_from(sorted(tensors)))
    header[victim] = MUTATIONS[mutation](header[victim], len(body))
    path = write_file(tmp_path / "model.safetensors", json.dumps(header).encode(), body)
    start = time.thread_time()  # CPU time: a busy machine does not stretch it
    err = parse_or_named_error(path, culprit=victim)
    assert isinstance(err, CheckpointError), f"{mutation} accepted"
    assert time.thread_time() - start < 2.0


@FUZZ
@given(tensors=valid_checkpoints(), data=st.data())
def test_overlapping_ranges_name_both_tensors(tmp_path, tensors, data):
    sized = sorted(n for n, a in tensors.items() if a.nbytes)
    assume(len(sized) >= 2)
    a, b = data.draw(st.lists(st.sampled_from(sized), min_size=2, max_size=2, unique=True))
    blob = st_save(tensors)
    hlen = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + hlen])
    # b becomes a second name for a's bytes
    header[b] = dict(header[a])
    path = write_file(tmp_path / "model.safetensors", json.dumps(header).encode(), blob[8 + hlen :])
    err = parse_or_named_error(path)
    assert isinstance(err, CheckpointError) and "overlap" in str(err)
    assert repr(a) in str(err) and repr(b) in str(err)


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"\xff\xfe{}", "not valid JSON"),
        ('{"t": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}'.encode("utf-16"), "JSON"),
        (b'{"a": 1, "a": 2}', "appears twice"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"t": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}', "JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b"", "not valid JSON"),
    ],
    ids=["invalid utf-8", "utf-16", "duplicate key", "deep nesting", "5000-digit int", "array", "empty"],
)
def test_bad_json(tmp_path, raw, match):
    path = write_file(tmp_path / "model.safetensors", raw, b"\0" * 8)
    with pytest.raises(CheckpointError, match=match) as info:
        read_header(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "blob, match",
    [
        (b"", "too short"),
        (b"\x05\0\0", "too short"),
        (struct.pack("<Q", 2**64 - 1) + b"{}", "header length"),
        (struct.pack("<Q", 200_000_000) + b"{}" + b" " * 100, "header length"),
        (struct.pack("<Q", 3) + b"{}", "header length"),
    ],
    ids=["empty", "3 bytes", "max u64", "over 100 MB", "one past the end"],
)
def test_lying_header_length(tmp_path, blob, match):
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError, match=match) as info:
        read_header(path)
    assert str(path) in str(info.value)


def test_no_allocation_sized_by_the_header(tmp_path):
    """A 1 KB file claiming exabytes: memory use stays that of the file, time stays milliseconds."""
    header = {"many": {"dtype": "U8", "shape": [2**62] * 100_000, "data_offsets": [0, 4]}}
    path = write_file(tmp_path / "model.safetensors", json.dumps(header).encode(), b"\0" * 64)
    tracemalloc.start()
    start = time.thread_time()  # CPU time: a busy machine does not stretch it
    try:
        with pytest.raises(CheckpointError):
            read_header(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.thread_time() - start < 2.0
    assert peak < 50 * path.stat().st_size + (1 << 20), peak


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev-zero symlink"])
def test_not_a_regular_file(tmp_path, kind):
    """A FIFO would block ``open`` forever and /dev/zero never ends: both are refused at once."""
    path = tmp_path / "model.safetensors"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    assert str(path) in str(info.value)


# --- index files --------------------------------------------------------------------------------

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
BAD_SHARD_NAMES = ["../model-00001-of-00002.safetensors", "/etc/passwd", "sub/model.safetensors",
                   "..", ".", "", "a\\b.safetensors", "x\0y", "model-00003-of-00002.safetensors"]


@pytest.fixture
def two_shards(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for i, name in enumerate(SHARDS):
        (model / name).write_bytes(st_save({f"w{i}": np.ones(4, dtype=np.float32)}))
    return model


@FUZZ
@given(weight_map=st.dictionaries(
    st.text(max_size=10),
    st.one_of(st.sampled_from(SHARDS), st.sampled_from(BAD_SHARD_NAMES), st.text(max_size=12),
              json_junk),
    max_size=6,
))
def test_index_weight_map(two_shards, weight_map):
    index = two_shards / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    bad = [t for t, shard in weight_map.items() if shard not in SHARDS]
    try:
        files = CheckpointFiles(two_shards)
    except CheckpointError as e:
        assert bad, f"valid index refused: {e}"
        assert str(index) in str(e)
        assert any(repr(t)[:60].rstrip("'") in str(e) for t in bad), str(e)
    else:
        assert not bad, f"index naming {bad} accepted"
        assert set(files.tensors) == {"w0", "w1"}


@pytest.mark.parametrize(
    "raw",
    [b"\xff\xfe", b"[]", b'{"weight_map": []}', b'{"weight_map": {"a": ["x"]}}', b"{",
     b"[" * 50_000, b'{"weight_map": {"a": 1, "b": "model-00001-of-00002.safetensors"}}'],
    ids=["not utf-8", "array", "list map", "list shard", "truncated", "deep", "int shard"],
)
def test_bad_index_file(two_shards, raw):
    index = two_shards / "model.safetensors.index.json"
    index.write_bytes(raw)
    with pytest.raises(CheckpointError) as info:
        CheckpointFiles(two_shards)
    assert str(index) in str(info.value)


@pytest.mark.parametrize("name", BAD_SHARD_NAMES)
def test_index_shard_outside_model_dir(two_shards, name):
    index = two_shards / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w0": SHARDS[0], "layers.0.w": name}}))
    with pytest.raises(CheckpointError, match="layers.0.w") as info:
        CheckpointFiles(two_shards)
    assert str(index) in str(info.value)
