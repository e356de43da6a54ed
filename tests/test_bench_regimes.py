"""bench/gpu_pipeline.py --quick: the three regimes, the placement's limit and a command-line tuning
variant, run on the CPU at tiny size; every configuration exact, every regime's ratio there."""

import sys
from pathlib import Path

import numpy as np
import pytest
from mlx.utils import tree_flatten
from support import PlacementRecorder, decode, gpu_pipeline_quick, load_stock, same

from mlx_lm_streaming.runtime.reads.host_views import host_address

BENCH = Path(__file__).resolve().parent.parent / "bench"

SPLIT = ("ids wait", "host to submit", "reads", "installs", "compute", "rest", "between layers")


def test_quick_regimes_placed_and_tuning_variant(tmp_path):
    proc, res, md = gpu_pipeline_quick(
        tmp_path, "--regimes", "hit,ram,cold", "--ckpt-dir", tmp_path / "ckpt",
        "--tuning-variant", "nolk:lookahead=false",
        # the split is the per-layer schedule's (a verified step has one check per token)
        "--tuning-variant", "perlayer:verified_steps=false",
        "--variants", "default,perlayer_tl,nolk_tl", "--placed", "--profile", "1",
    )  # fmt: skip
    assert res["tuning_variants"] == {
        "nolk": {"lookahead": False},
        "perlayer": {"verified_steps": False},
    }
    regimes = {g["regime"] for g in res["groups"]}
    assert regimes == {"hit", "ram", "cold"}
    # hit and ram at one budget each, cold at --quick's two; uniform and trace routing each
    assert len(res["groups"]) == 2 + 2 + 4
    names = {"stock", "stock_again", "stock_own"}
    names |= {"default", "perlayer_tl", "nolk_tl", "stock_placed"}
    for g in res["groups"]:
        where = f"{g['regime']} {g['routing']} {g['budget']}"
        assert set(g["configs"]) == names, where
        for name, c in g["configs"].items():  # --profile: each one's host time per step
            p = c["step_profile"]
            assert 0 < p["build_ms"] <= p["step_ms"] and p["launch_ms"] > 0, (where, name, p)
            assert 0 < p["call_ms"] and set(p["minus_stock"]) == set(p) - {"minus_stock"}, p
            assert p["check_ms"] == 0 or not name.startswith("stock"), (where, name, p)
        assert set(g["configs"]["stock"]["step_profile"]["minus_stock"].values()) == {0}
        assert g["stock_differs_at"] is None, where  # (the CPU: stock's own steps agree)
        assert g["stock_vs_stock"] > 0, where
        # stock as a user sees it timed in every round; the ratios' stock named, with its reason
        basis = g["stock_basis"]
        assert basis["used"] in ("stock", "stock_user") and basis["why"], where
        assert len(basis["user_tok_s_rounds"]) == res["rounds"], where
        assert (basis["used"] == "stock") == (abs(basis["harness_off"]) <= 0.05), where
        assert g["injection_cost"] < 1, where
        for key, c in g["configs"].items():
            if key == "stock_own":  # its own router: other experts than the injected ids
                assert c["exact"] is None, where
                continue
            assert c["exact"], f"{where} {key}: {c['exact_steps']}/{c['total_steps']}"
            assert c["total_steps"] == res["rounds"] * (res["block"] + 1), where
            assert c["ratio"] > 0 and c["of_placed"] > 0, f"{where} {key}"
            if key == "stock_placed":  # the placement's limit: its device experts' share of uses
                assert 0 < c["placed_device_share"] <= 1 and c["of_placed"] == 1.0, where
            if key.startswith("stock"):
                continue
            assert 0 <= c["hit_rate"] <= 1, f"{where} {key}"
            if g["regime"] == "cold":
                assert c["ratio"] == c["ratio_to_limit_median"]
            else:
                assert c["ratio"] == c["ratio_to_stock"]
            if g["regime"] == "hit":
                assert c["hit_rate"] == 1.0, f"{where} {key}"
            if key.endswith("_tl"):
                split = c["timeline"]["split"]
                # every MoE layer once per token (a step cut short at either end of the measured
                # window counts fewer)
                assert 0.75 * res["moe_layers"] <= split["layer calls per token"], where
                assert split["layer calls per token"] <= res["moe_layers"], where
                assert set(split["ms per token"]) == set(SPLIT) | {"outside", "token"}, where
                assert set(split["ms per layer"]) == set(SPLIT), where
                # (the token's time outside its layer calls is a difference of two means over
                # windows that need not line up at --quick's two-token blocks: not checked here)
                parts = {k: v for k, v in split["ms per token"].items() if k != "outside"}
                assert all(v >= 0 for v in parts.values()), (where, split)
            else:
                assert "timeline" not in c
    for regime in ("hit", "ram", "cold"):
        assert f"### {regime}" in md
        assert f"### {regime}" in proc.stdout
    assert "stock_placed" in md and "nolk_tl" in md
    assert "as a user sees it (stream_generate)" in md and "the injected ids cost" in md


@pytest.mark.parametrize(
    "shape, layers, experts, traced",
    [("qwen35_tiny", 4, 256, False), ("gemma4_tiny", 6, 128, True)],
)
def test_quick_new_families(tmp_path, shape, layers, experts, traced):
    # the Qwen3.5/3.6 hybrid (three Gated DeltaNet layers and one of full attention) and gemma-4
    # (five sliding-window layers and one global) at tiny dims, each routing (gemma-4's own trace
    # too): every regime exact against stock; --layers counts decoder layers, each an MoE layer
    _, res, _ = gpu_pipeline_quick(
        tmp_path, "--shape", shape, "--layers", str(layers), "--regimes", "hit,ram,cold",
        "--budgets", "0.25", "--ckpt-dir", tmp_path / "ckpt", "--variants", "default",
    )  # fmt: skip
    assert (res["moe_layers"], res["experts"]) == (layers, experts)
    routings = {g["routing"].split(":")[0] for g in res["groups"]}
    assert routings == ({"uniform", "trace"} if traced else {"uniform"})
    assert len(res["groups"]) == 3 * len(routings)
    for g in res["groups"]:
        where = f"{g['regime']} {g['routing']} {g['budget']}"
        for key, c in g["configs"].items():
            if key != "stock_own":
                assert c["exact"], f"{where} {key}: {c['exact_steps']}/{c['total_steps']}"
        hit = g["configs"]["default"]["hit_rate"]
        assert hit == 1.0 if g["regime"] == "hit" else hit < 1, where


def test_the_placement_limit_places_each_layers_most_used_experts(q3):
    # stock_placed (gpu_pipeline.py --placed): stock's expert modules keep their calls' ids and
    # compute stock's bits; each layer's most used quarter is placed on the device, the rest on
    # the host, a range per expert and array (recorded here: the CUDA calls need mlx-cuda)
    path, tokens, want = q3
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_pipeline
        import routing_replay
    finally:
        sys.path.remove(str(BENCH))
    model, _ = load_stock(path)
    places = routing_replay.expert_modules(model)
    gpu_pipeline.count_uses(model, places)
    assert same(want, decode(model, tokens))
    uses = [np.bincount(np.concatenate([np.array(i).reshape(-1) for i in m._kept]), minlength=16)
            for _, _, m in places]  # fmt: skip

    class Placer(PlacementRecorder):
        def wait(self):
            pass

    placer = Placer()
    share = gpu_pipeline.place_hottest(model._counted, 0.25, placer)
    served = 0
    for (_, _, module), counts in zip(places, uses):
        weight = module.gate_proj.weight
        per = weight.nbytes // 16
        base = host_address(weight)
        on = sorted((a - base) // per for a, n, flag in placer.placed
                    if flag and base <= a < base + weight.nbytes)  # fmt: skip
        assert len(on) == 4 and min(counts[on]) >= max(np.delete(counts, on)), (on, counts)
        served += counts[on].sum()
        assert module._kept == []  # counted afresh for the next placement
    assert share == pytest.approx(served / sum(u.sum() for u in uses))
    # a range per expert of every array of every layer, each once
    arrays = sum(len(tree_flatten(m.parameters())) for _, _, m in places)
    assert len(placer.placed) == 16 * arrays == len({a for a, _, _ in placer.placed})


def test_rows_are_compared_up_to_where_stock_is_not_itself():
    # mlx-cuda's stock, past 256 KV entries, is not its own run to run (cuDNN's attention:
    # methods.md): each row exact where it is stock's at every step before stock_again first
    # differs, that step kept (``stock_differs_at``); where stock_again agrees, every step counts
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_pipeline
    finally:
        sys.path.remove(str(BENCH))

    def entries(again, default, own=None):
        rows = {"stock_again": again, "default": default, "stock_own": own}
        return {k: dict(same_as_stock=v, exact=None if v is None else all(v))
                for k, v in rows.items()}  # fmt: skip

    got = entries([True] * 5 + [False] * 3, [True] * 6 + [False, True])
    assert gpu_pipeline.exact_to_stocks_own(got) == 5
    assert got["default"]["exact"] and got["stock_again"]["exact"]
    assert got["stock_own"]["exact"] is None
    got = entries([True] * 5 + [False] * 3, [True] * 4 + [False] * 4)  # differs before stock does
    assert gpu_pipeline.exact_to_stocks_own(got) == 5 and got["default"]["exact"] is False
    got = entries([True] * 8, [True] * 7 + [False])  # stock agrees with itself: every step
    assert gpu_pipeline.exact_to_stocks_own(got) is None and got["default"]["exact"] is False


def test_quick_the_default_as_a_user_sees_it(tmp_path):
    # --user-streaming: the default model through stream_generate too, once a round among the
    # others, on the rounds' own rows (resident in a hit regime) and its routing put back after,
    # so the harness's steps stay stock's and hit; its speed against stock's through
    # stream_generate, in each group and in the report's line
    _, res, md = gpu_pipeline_quick(
        tmp_path, "--regimes", "hit", "--routings", "uniform", "--variants", "default",
        "--ckpt-dir", tmp_path / "ckpt", "--user-streaming", "--block", "8", "--prompt", "4",
        "--user-tokens", "6",
    )  # fmt: skip
    (g,) = res["groups"]
    assert all({"stock_user", "default_user"} <= set(r) for r in g["rounds"])
    assert g["default_user_of_stock_user"] > 0
    c = g["configs"]["default"]
    assert c["exact"] and c["hit_rate"] == 1.0, (c["exact_steps"], c["hit_rate"])
    assert "(the default so: " in md
