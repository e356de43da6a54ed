"""Long fuzz of the checkpoint parser: the properties of ``test_fuzz_index.py``, for longer.

Not collected by pytest (no ``test_`` prefix). Two engines:

    python tests/fuzz_long.py --examples 20000            # hypothesis, every property
    python tests/fuzz_long.py --atheris --seconds 600     # coverage-guided (pip install atheris)

Under atheris, each input is a whole shard file (mutated from seeds written by the safetensors library)
or, with its first byte odd, a ``model.safetensors.index.json``; the property is the same: accepted and
consistent, or a ``CheckpointError`` naming the file. Any other exception, or a hang, is a crash
atheris reports with the input that caused it.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def run_hypothesis(examples: int) -> None:
    os.environ["FUZZ_EXAMPLES"] = str(examples)
    import test_fuzz_index as t  # reads FUZZ_EXAMPLES at import

    work = Path(tempfile.mkdtemp(prefix="fuzz_long_"))
    for name in ("test_random_bytes", "test_random_headers", "test_valid_files_parse_exactly",
                 "test_damaged_entry_names_file_and_tensor",
                 "test_overlapping_ranges_name_both_tensors"):
        start = time.monotonic()
        (work / name).mkdir()
        getattr(t, name)(tmp_path=work / name)
        print(f"{name}: {examples} examples, {time.monotonic() - start:.1f} s", flush=True)
    start = time.monotonic()
    model = make_two_shards(work / "index")
    t.test_index_weight_map(two_shards=model)
    print(f"test_index_weight_map: {examples} examples, {time.monotonic() - start:.1f} s")


def make_two_shards(model: Path) -> Path:
    import numpy as np
    from safetensors.numpy import save

    from test_fuzz_index import SHARDS

    model.mkdir(parents=True)
    for i, name in enumerate(SHARDS):
        (model / name).write_bytes(save({f"w{i}": np.ones(4, dtype=np.float32)}))
    return model


def run_atheris(seconds: int, extra) -> None:
    import atheris

    with atheris.instrument_imports():
        from mlx_lm_streaming.runtime.reads import index
    import numpy as np
    from safetensors.numpy import save

    import test_fuzz_index as t
    from mlx_lm_streaming.errors import CheckpointError

    work = Path(tempfile.mkdtemp(prefix="fuzz_atheris_"))
    corpus = work / "corpus"
    corpus.mkdir()
    seeds = [
        save({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.uint32)}),
        save({"layers.0.mlp.switch_mlp.gate_proj.weight": np.ones((4, 2, 8), np.uint32),
              "layers.0.mlp.switch_mlp.gate_proj.scales": np.ones((4, 2, 1), np.float16)}),
        b"\x01" + json.dumps({"weight_map": {"w0": t.SHARDS[0], "w1": t.SHARDS[1]}}).encode(),
    ]
    for i, seed in enumerate(seeds):
        (corpus / f"seed{i}").write_bytes(seed)
    shard = work / "model.safetensors"
    model = make_two_shards(work / "model")
    index_file = model / "model.safetensors.index.json"

    def target(data: bytes) -> None:
        if data[:1] == b"\x01":
            index_file.write_bytes(data[1:])
            try:
                index.CheckpointFiles(model)
            except CheckpointError as e:
                assert str(index_file) in str(e), str(e)
            return
        shard.write_bytes(data)
        t.parse_or_named_error(shard)

    atheris.Setup(
        [sys.argv[0], f"-max_total_time={seconds}", "-timeout=5", "-rss_limit_mb=2048", *extra,
         str(corpus)],
        target,
    )
    atheris.Fuzz()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=20000, help="hypothesis examples per property")
    parser.add_argument("--atheris", action="store_true", help="coverage-guided fuzzing with atheris")
    parser.add_argument("--seconds", type=int, default=600, help="atheris time budget")
    args, extra = parser.parse_known_args()
    sys.path.insert(0, str(Path(__file__).parent))
    sys.path.insert(0, str(Path(__file__).parent.parent))
    if args.atheris:
        run_atheris(args.seconds, extra)
    else:
        run_hypothesis(args.examples)


if __name__ == "__main__":
    main()
