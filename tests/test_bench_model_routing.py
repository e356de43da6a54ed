"""bench/gpu_pipeline.py --quick with a ``model:DIR`` routing: the trained demo model's own router
(no forced ids), hit and ram regimes on that checkpoint, exact token by token against its stocks;
the ram probe's figures and each ram row's ram limit reported."""

from pathlib import Path

from support import gpu_pipeline_quick

DEMO = Path(__file__).resolve().parent.parent / "docs" / "demo-model"


def test_quick_model_routing_and_ram_probe(tmp_path):
    proc, res, md = gpu_pipeline_quick(
        tmp_path, "--regimes", "hit,ram", "--routings", f"model:{DEMO}",
        # half the demo's experts: the ram regime misses (its 8 experts a layer at 0.9: 7 slots)
        "--ram-budget", "0.5", "--variants", "default",
    )  # fmt: skip
    label = "model demo-model (its own router)"
    ck = res["checkpoints"][label]
    assert set(res["checkpoints"]) == {label}
    # the demo's own expert size (4-bit, 256 x 256, three projections), not the synthetic shape's
    assert ck["expert_bytes"] == 122880 and ck["experts"] == 8 and ck["moe_layers"] == 4
    probe = ck["ram_probe"]
    assert probe["expert_bytes"] == ck["expert_bytes"]
    assert probe["k"] and all(v > 0 for v in probe["gbps"].values())
    assert "slots alone" in probe["gbps"]
    for k in probe["k"]:
        assert f"slots k{k}" in probe["gbps"] and f"slots k{k} spread" in probe["gbps"]
    assert {g["regime"] for g in res["groups"]} == {"hit", "ram"}
    for g in res["groups"]:
        where = f"{g['regime']} {g['budget']}"
        assert g["checkpoint"] == label
        assert set(g["configs"]) == {"stock", "stock_again", "default"}, where
        for key, c in g["configs"].items():
            assert c["exact"], f"{where} {key}: {c['exact_steps']}/{c['total_steps']}"
            assert c["total_steps"] == res["rounds"] * (res["block"] + 1), where
        c = g["configs"]["default"]
        assert 0 <= c["hit_rate"] <= 1, where
        if g["regime"] == "ram":
            lim = c["ram_limit"]
            assert c["misses_per_token"] > 0, where
            assert lim["k"] in probe["k"] and lim["gbps"] == probe["gbps"][f"slots k{lim['k']}"]
            assert lim["missed_bytes_per_token"] == c["misses_per_token"] * ck["expert_bytes"]
            # the limit adds the misses' reads to the stock step of the ratios' basis
            assert 1 / lim["tok_s"] > lim["missed_bytes_per_token"] / (lim["gbps"] * 1e9) > 0
            if g["stock_basis"]["used"] == "stock":
                assert lim["tok_s"] < 1 / g["configs"]["stock"]["s_per_token"]
            assert lim["of_limit"] > 0
    assert label in md and "ram limit tok/s" in md and "Ram probe" in md
    assert label in proc.stdout
