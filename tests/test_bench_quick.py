"""Every script in bench/ runs at a tiny size and finds what it should, so none rots between the runs
whose figures docs/benchmarks/ records (startup.py runs in test_integration_hook.py). Timings are
the scripts' business, never asserted here."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from support import held_out_env

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
INDEX = (BENCH / "README.md").read_text()


def bench(*args, env=None, timeout=300):
    """``python ARGS`` in the repository, with ``env`` added to a clean environment; fails the test
    with the script's output when it exits with an error."""
    with held_out_env():
        done = subprocess.run(
            [sys.executable, *map(str, args)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
        )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


def test_prefill(tmp_path):
    # --layer-major-prefill at the tiny shape: two prompts of 3 and 6 chunks, cold, 25% and 50%:
    # layer-major reads each routed expert about once, chunk by chunk several times over, and
    # every run's tokens after the prompt are stock's
    out = bench(
        BENCH / "prefill.py", "--archs", "tiny", "--prefill-tokens",
        "96,192", "--prefill-step", "32", "--decode-tokens", "4", "--hold-tokens", "128",
        "--ckpt-dir", tmp_path / "ckpt", "--out", tmp_path, "--tag", "prefill",
    )  # fmt: skip
    report = json.loads((tmp_path / "prefill.json").read_text())
    runs = [r for r in report["runs"] if r["mode"] != "stock"]
    assert len(runs) == 8 and "| 192 | 50% | layer-major |" in out
    for r in runs:
        assert r["same_tokens_as_stock"] and r["same_first_logprobs_as_stock"], r
        if r["mode"] == "layer_major":
            assert r["layer_major_prompts"] == 1 and r["prefix_read_over_must_read"] <= 1.05, r
        else:
            assert r["layer_major_prompts"] == 0 and r["read_over_must_read"] > 1.1, r
    assert report["hold"]["held_gb"] > 0 and report["hold"]["groups"] == 1


def test_the_index_names_every_script_and_only_those():
    scripts = {p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh")}
    indexed = set(re.findall(r"^\| `([\w.]+\.(?:py|sh))` \|", INDEX, re.M))
    assert indexed == scripts


def test_memory(tmp_path):
    # the default mode (--rss) at the tiny shape: stock, full and cold each in a process of its own
    out = bench(
        BENCH / "memory.py", "--quick", "--prefill-tokens", "8", "--ckpt-dir", tmp_path / "ckpt",
        "--out", tmp_path, "--tag", "quick",
    )  # fmt: skip
    (arch,) = json.loads((tmp_path / "quick.json").read_text())["archs"]
    rss = arch["rss"]
    assert arch["arch"] == "tiny" and set(rss) == {"stock", "full", "cold"}
    for r in rss.values():
        assert r["peak_rss"] > r["rss_after_imports"] > 0 and r["weights_and_budget"] > 0, r
    assert 0 < rss["cold"]["budget"] < rss["full"]["budget"]
    assert arch["rss_cold_over_budget"] == rss["cold"]["over_weights_and_budget"]
    assert "| cold |" in out and (tmp_path / "quick.md").read_text() in out


def test_gpu_pipeline(tmp_path):
    bench(
        BENCH / "gpu_pipeline.py", "--shape", "tiny", "--layers", "2", "--regimes", "cold",
        "--budgets", "0.25", "--variants", "default", "--rounds", "1", "--block", "1",
        "--warmup", "1", "--user-tokens", "4", "--probe-mb", "8",
        "--ckpt-dir", tmp_path / "ckpt", "--out", tmp_path, "--tag", "quick",
    )  # fmt: skip
    report = json.loads((tmp_path / "quick.json").read_text())
    groups = {(g["routing"].split(":")[0], g["budget"]) for g in report["groups"]}
    assert groups == {("uniform", 0.25), ("trace", 0.25)}
    for group in report["groups"]:
        for name, config in group["configs"].items():
            if name != "stock_own":  # (its own router's experts: not compared)
                assert all(config["same_as_stock"]), (group["routing"], name)
        assert group["configs"]["default"]["hit_rate"] < 1


def test_tiers_shift(tmp_path):
    # the two tiers at tiny size with the CUDA placement replaced by a record: two routing traces
    # one after the other, every step stock's, both tiers in the tiered run's summary
    bench(BENCH / "tiers_shift.py", "--try-on-cpu", "--ckpt-dir", tmp_path / "ckpt", "--out",
          tmp_path, "--tag", "shift")
    report = json.loads((tmp_path / "shift.json").read_text())
    assert report["exact_steps"] == report["steps"] == 48
    assert report["runs"]["tiers"]["summary"]["tier_host_gb"] > 0
    assert len(report["runs"]["tiers"]["phases"]) == 2 and report["phase1"]["steady_tok_s"] > 0


def test_timeline_png_and_summary(q3_path, tmp_path):
    # a timeline of the per-layer schedule at 4 slots a layer (its layers miss), drawn and summed
    import mlx.core as mx
    from support import decode, with_slots

    from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning

    trace, png = tmp_path / "timeline.json", tmp_path / "timeline.png"
    model = with_slots(q3_path, 4, trace=str(trace), tuning=CacheTuning(verified_steps=False))
    decode(model, mx.array([[(5 * i + 3) % 512 for i in range(12)]]))
    model.expert_streaming.close()
    out = bench(BENCH / "timeline_png.py", trace, "--out", png)
    assert png.read_bytes().startswith(b"\x89PNG") and f"wrote {png}" in out
    summary = json.loads(bench(BENCH / "timeline_summary.py", trace))
    assert summary["reads per step"] > 0 and summary["MB read per step"] > 0


def test_timeline_summary_of_a_verified_steps_loads(q3_path, tmp_path):
    # verified steps at 2 slots a layer miss in most tokens: the loads of a token's misses lie
    # between two passes, outside the steps' spans, and are summed on their own: the decode's
    # wait in them and the disk's idle part of it
    import mlx.core as mx
    from support import decode, with_slots

    from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning

    trace = tmp_path / "timeline.json"
    tuning = CacheTuning(verify_choice="always", lookahead_min_precision=0.0)
    model = with_slots(q3_path, 2, trace=str(trace), tuning=tuning)
    decode(model, mx.array([[(5 * i + 3) % 512 for i in range(12)]]), steps=8)
    assert model.expert_streaming.steps.replays > 0
    model.expert_streaming.close()
    summary = json.loads(bench(BENCH / "timeline_summary.py", trace))
    assert summary["verify loads per step"] > 0, summary
    assert 0 <= summary["disk idle in verify loads ms"] <= summary["verify load ms"], summary
    assert summary["GB/s over verify loads"] > 0, summary


def test_cuda_parity(tmp_path):
    bench(BENCH / "cuda_parity.py", "--cases", "1", "--out", tmp_path / "parity.json")
    (case,) = json.loads((tmp_path / "parity.json").read_text())["cases"]
    assert case["exact"] and case["error"] is None, case
    # the CPU is deterministic: stock against itself differs in no batch, so every batch is judged
    assert case["stock_run_to_run"] == {"1": None, "2": None}, case


def test_device_scripts_parse():
    # gpu.sh and gpu_env.sh need the H200; here only that bash can read them
    for script in ("gpu.sh", "gpu_env.sh"):
        subprocess.run(["bash", "-n", BENCH / script], check=True)


def test_hot_path_calls():
    """The call counts run, and are no more than the newest ones docs/benchmarks records (the
    counts are deterministic: a change to the hot path that adds calls updates the page)."""
    counts = json.loads(bench(BENCH / "hot_path_calls.py"))["per_moe_layer_call"]
    page = json.loads((ROOT / "docs/benchmarks/hot-path-calls.json").read_text())
    recorded = page.get("after", page["before"])["per_moe_layer_call"]
    assert set(counts) == {"verified", "per_layer_hit", "per_layer_miss", "complete"}
    for case, calls in counts.items():
        assert 0 < calls <= recorded[case], (case, calls, recorded[case])


def test_every_script_a_test_trace_names_exists():
    # a trace in tests/data names the scripts that made it (its header's model, source and note):
    # they must be there to make it again (the routing model's two were once retired to git)
    named = {}
    for trace in sorted((ROOT / "tests" / "data").rglob("*.jsonl")):
        with open(trace) as f:
            header = json.loads(f.readline())
        text = " ".join(str(header.get(k, "")) for k in ("model", "source", "note"))
        for script in re.findall(r"\b((?:bench|docs|tools|synthetic)/[\w/]+\.(?:py|sh))\b", text):
            named.setdefault(script, []).append(trace.name)
    assert "bench/train_routing_model.py" in named  # the check finds what a header names
    missing = {s: t for s, t in named.items() if not (ROOT / s).is_file()}
    assert not missing, f"scripts named by traces in tests/data but not in the tree: {missing}"


def test_the_build_files_name_only_scripts_that_exist():
    # pyproject.toml said why matplotlib is a test dependency by a script retired long before
    # (bench/experts.py): what the package's build and CI files name must be there
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", ".ci/run"):
        text = (ROOT / name).read_text()
        named = re.findall(r"\b((?:bench|docs|tools|tests|synthetic)/[\w/]+\.(?:py|sh))\b", text)
        missing = [script for script in named if not (ROOT / script).is_file()]
        assert not missing, f"{name} names scripts that are not in the tree: {missing}"


def test_routing_model_figures(tmp_path):
    # --compare on a committed trace (the quickest to replay) gives the figures docs/benchmarks
    # records for it; the model mode runs on the demo model (a Qwen3-MoE too) and writes a trace
    # that the package reads
    trace = ROOT / "tests" / "data" / "routing" / "gemma-4-26b-a4b.jsonl"
    bench(BENCH / "routing_model_figures.py", "--compare", trace, "--out", tmp_path)
    got = json.loads((tmp_path / "routing-compare.json").read_text())
    recorded = ROOT / "docs" / "benchmarks" / "routing-compare.json"
    assert got[trace.name] == json.loads(recorded.read_text())[trace.name]
    prompts = tmp_path / "heldout.json"
    text = "Return the value of the file named by path, or None when it does not exist."
    prompts.write_text(json.dumps({"prompts": [text]}))
    out = bench(
        BENCH / "routing_model_figures.py", "--model", ROOT / "docs" / "demo-model",
        "--prompts", prompts, "--out", tmp_path, "--seqs", "1", "--decode", "4",
    )  # fmt: skip
    assert "next_router_on_moe_input top-k: precision" in out
    from mlx_lm_streaming.files.routing_trace import read_trace

    trace = read_trace(tmp_path / "routing-model.jsonl")
    assert trace.num_layers == 4 and sum(r.phase == "decode" for r in trace.rows) == 4


def test_routing_model_next_pass(tmp_path):
    # --next-pass: the true tokens are stock's greedy decode (the passes before each are taken
    # back); the counts are consistent, and a cache of every expert misses no more than one of
    # half (the same tokens, so the same picks: LRU's stack property)
    import importlib.util

    import mlx.core as mx
    import numpy as np
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    spec = importlib.util.spec_from_file_location("figures", BENCH / "routing_model_figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    resident = [3, 1, 5]
    figures._touch(resident, [1, 7], 3)
    assert resident == [5, 1, 7]  # 3 the oldest not used: evicted; 1 used again, 7 new
    assert np.array(figures._table([5, 1, 7], 8)).tolist() == [1, 1, 1, 1, 1, 5, 1, 7]
    text = "Return the value of the file named by path, or None when it does not exist."
    prompts = tmp_path / "heldout.json"
    prompts.write_text(json.dumps({"prompts": [text]}))
    got = {}
    for share in ("1.0", "0.5"):
        bench(
            BENCH / "routing_model_figures.py", "--model", ROOT / "docs" / "demo-model",
            "--prompts", prompts, "--out", tmp_path, "--decode", "6", "--temp", "0",
            "--next-pass", share,
        )  # fmt: skip
        got[share] = json.loads((tmp_path / f"routing-next-pass-{share}.json").read_text())
    model, tokenizer = load(str(ROOT / "docs" / "demo-model"))
    ids = mx.array(tokenizer.encode(text)[:96])
    stock = [int(t) for t, _ in generate_step(ids, model, max_tokens=6)]
    for share, fig in got.items():
        assert fig["decoded"] == [stock], share
    full, half = got["1.0"], got["0.5"]
    assert full["slots"] == 8 and half["slots"] == 4 and half["tokens"] == full["tokens"] == 5
    assert full["missed"] <= half["missed"]
    assert 0 <= half["hit"] <= min(half["named"], half["missed"]) and half["missed"] > 0


def test_train_routing_model_without_torch():
    # the parts that need no torch (the corpus, the tokenizer, the batches) at a tiny size; the
    # training itself needs torch and transformers' models (on the H200)
    import importlib.util

    spec = importlib.util.spec_from_file_location("train", BENCH / "train_routing_model.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    texts, held, roots = train.corpus(300_000)
    assert texts and roots
    tok = train.make_tokenizer(texts, 512, 200_000)
    data = train.encode(tok, texts[:20])
    assert tok.token_to_id(train.EOS) is not None and data.max() < 512
    (batch,) = list(train.batches(data, 1, 2, 32, seed=0))
    assert batch.shape == (2, 32)
    assert bench(BENCH / "train_routing_model.py", "--help").startswith("usage:")

