"""The decode chooser (runtime/costs.py): a verified step or per layer, by measured costs.

A simulation of each mode's time under a machine's cost profile (sync, a layer's compute, a read)
feeds ``DecodeCosts`` the call times it would measure; the chooser's pick at each running share of
missed MoE layers must be the mode the simulation finds the quicker at that share."""

import mlx.core as mx
import numpy as np
import pytest
from support import decode, load_stock, same, with_slots

from mlx_lm_streaming.runtime import costs, report
from mlx_lm_streaming.runtime.expert_cache import CacheTuning

LAYERS = 16
EXPERTS_PER_MISS = 2
# seconds: a host sync, a layer's compute, a read of one expert
PROFILES = {
    # a Mac (and the H200): a host sync costs what a layer does; reads from the page cache fast
    "metal": dict(sync=1.0e-3, layer=1.0e-3, read=0.3e-3),
    # this CPU: a sync is cheap, compute dear
    "cpu": dict(sync=0.03e-3, layer=2.0e-3, read=1.0e-3),
    # a Mac whose token's misses are read together (``read_misses_together``): one replay from
    # the first missed layer, its reads overlapped four at a time
    "metal_together": dict(sync=1.0e-3, layer=1.0e-3, read=0.3e-3, together=True),
}
SHARES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0)


def missed_layers(rng, share):
    """The MoE layers one call misses in, each with probability ``share`` (the miss pattern)."""
    return np.nonzero(rng.random(LAYERS) < share)[0]


def simulate(profile, verified, missed):
    """``(seconds, reads, replays)`` of one call under ``profile`` that misses in ``missed``.
    Verified: one sync and every layer, then for each missed layer (in order) a sync, its reads,
    and the layers from it to the last computed again (read together: once, from the first
    missed layer). Per layer: each layer a sync and its compute, and its reads where it
    missed."""
    s, c, r = profile["sync"], profile["layer"], profile["read"]
    reads = len(missed) * EXPERTS_PER_MISS * r
    if not verified:
        return LAYERS * (s + c) + reads, reads, 0
    if profile.get("together"):
        if not len(missed):
            return s + LAYERS * c, 0.0, 0
        reads /= 4
        return 2 * s + LAYERS * c + c * (LAYERS - missed[0]) + reads, reads, 1
    seconds = s + LAYERS * c + sum(s + c * (LAYERS - j) for j in missed) + reads
    return seconds, reads, len(missed)


def mean_time(profile, verified, share, calls=400):
    rng = np.random.default_rng(1)
    times = [simulate(profile, verified, missed_layers(rng, share))[0] for _ in range(calls)]
    return np.mean(times)


def trained(profile, per_layer_calls=True, seed=0):
    """A ``DecodeCosts`` fed the calls of a run under ``profile``: verified and (unless
    ``per_layer_calls`` is False) per-layer calls at various shares, as ``StepRunner`` measures."""
    chooser = costs.DecodeCosts(LAYERS)
    chooser.probe = profile["sync"] / 2  # the probe: less than a sync inside a forward
    chooser.together = profile.get("together", False)
    rng = np.random.default_rng(seed)
    modes = (True, False) if per_layer_calls else (True,)
    for i in range(60):
        share = (0.0, 0.05, 0.15, 0.3)[i % 4]
        for verified in modes:
            missed = missed_layers(rng, share)
            seconds, reads, replays = simulate(profile, verified, missed)
            chooser.add(verified, seconds, reads, len(missed) * EXPERTS_PER_MISS, len(missed),
                        replays)  # fmt: skip
    return chooser


@pytest.mark.parametrize("profile", list(PROFILES))
def test_the_chooser_picks_the_quicker_mode_of_a_simulation(profile):
    p = PROFILES[profile]
    chooser = trained(p)
    limit = chooser.limit()
    for share in SHARES:
        verified, per_layer = mean_time(p, True, share), mean_time(p, False, share)
        if abs(verified - per_layer) <= 0.1 * min(verified, per_layer):
            continue  # within 10%: either is right
        assert (share <= limit) == (verified < per_layer), (profile, share, limit)
    # the estimates behind it are the profile's (the sync within 5% of a layer's compute: it is
    # told from the difference of two fitted call times)
    est = chooser.estimate
    assert abs(est["sync"] - p["sync"]) <= 0.05 * p["layer"], est
    assert est["layer"] == pytest.approx(p["layer"], rel=0.2)
    assert est["read_per_layer"] == pytest.approx(p["read"], rel=0.01)
    expected = chooser.expected(0.1)
    assert expected[0] == pytest.approx(mean_time(p, True, 0.1), rel=0.15)
    assert expected[1] == pytest.approx(mean_time(p, False, 0.1), rel=0.15)


def test_the_profiles_lead_to_different_choices():
    # the same misses, two machines: verified steps up to a larger share of missed layers where a
    # sync costs what a layer does than where compute is dear (no constant decides it)
    metal, cpu = trained(PROFILES["metal"]).limit(), trained(PROFILES["cpu"]).limit()
    assert metal > 0.05 > cpu >= 0, (metal, cpu)


@pytest.mark.parametrize("profile", list(PROFILES))
def test_verified_calls_alone_tell_the_choice_through_the_probe(profile):
    # no per-layer call measured yet: a per-layer call is estimated from the clean verified call and
    # the probe (a lower bound of the sync), so the chooser leans to the per-layer schedule, which
    # it then measures; it never keeps verified steps where the simulation finds them slower
    p = PROFILES[profile]
    limit = trained(p, per_layer_calls=False).limit()
    for share in SHARES:
        if share <= limit:
            assert mean_time(p, True, share) <= 1.1 * mean_time(p, False, share), (share, limit)


def test_before_any_measurement_verified_steps_are_tried():
    chooser = costs.DecodeCosts(LAYERS)
    assert chooser.limit() == 1.0  # the starting prior
    chooser.add(True, 0.5, 0.0, 0, 0)  # the first call of a mode is not measured (warm-up)
    assert chooser.limit() == 1.0 and chooser.estimate["verified"] is None


def test_a_run_of_per_layer_calls_measures_a_verified_one_again():
    p = PROFILES["cpu"]
    chooser = trained(p)
    assert chooser.limit() < 0.05
    for _ in range(costs.REFRESH):
        chooser.add(False, simulate(p, False, [])[0], 0.0, 0, 0)
    assert chooser.limit() == 1.0  # one verified call, measured
    chooser.add(True, simulate(p, True, [])[0], 0.0, 0, 0)
    assert chooser.limit() < 0.05


def test_an_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="verify_choice"):
        costs.way("sometimes", "cpu")


@pytest.fixture(scope="module")
def varied(q3_path):
    stock, _ = load_stock(q3_path)
    tokens = mx.array([[(5 * i + 3) % 512 for i in range(12)]])
    return tokens, decode(stock, tokens, steps=24)


@pytest.mark.parametrize("slots", [2, 4, 15])
def test_decode_by_measured_costs_is_stocks(q3_path, varied, slots):
    tokens, want = varied
    model = with_slots(q3_path, slots, tuning=CacheTuning(verify_choice="costs"))
    assert same(want, decode(model, tokens, steps=24))
    runner = model.expert_streaming.steps
    assert runner.choice == "costs" and runner.costs is not None
    calls = runner.costs.calls
    assert calls["verified"] + calls["per_layer"] == 24  # every decode call chose
    assert calls["per_layer"] == runner.per_layer_decodes
    model.expert_streaming.close()


def test_the_stats_say_the_measured_costs(q3_path, varied):
    tokens, _ = varied
    model = with_slots(q3_path, 4, tuning=CacheTuning(verify_choice="costs"))
    decode(model, tokens, steps=12)
    state = model.expert_streaming
    stats = state.stats()
    c = stats["decode_costs"]
    # (a layer's share may come out 0 where the measured sync is most of a clean call)
    assert c["probe"] > 0 and c["sync"] >= c["probe"] and c["layer"] >= 0
    assert c["calls"]["verified"] == stats["verified_steps"] > 0
    line = report.layers_table(state)  # (the default line leaves the runtime's words out)
    assert "decode calls" not in state.stats_line()
    verified, per_layer = stats["verified_steps"], stats["per_layer_decodes"]
    assert f"decode calls: {verified} verified steps, {per_layer} per layer" in line
    assert f"host sync {c['sync'] * 1e3:.3f} ms" in line
    assert f"MoE layer {c['layer'] * 1e3:.3f} ms" in line
    state.close()
    limits = with_slots(q3_path, 4, tuning=CacheTuning(verify_choice="limits"))
    decode(limits, tokens, steps=4)
    assert limits.expert_streaming.stats()["decode_costs"] is None
    assert "per layer (by share limits)" in report.layers_table(limits.expert_streaming)
    limits.expert_streaming.close()


def test_verified_calls_that_run_again_whole_choose_the_per_layer_schedule():
    # a miss where layers cannot be run again (``verified_step._Again``): the call runs again
    # whole, per layer, after its forward; where most verified calls end so, none is chosen
    chooser = trained(PROFILES["metal_together"])
    assert chooser.limit() == 1.0
    for _ in range(10):
        chooser.add(True, None, 0.0, 0, LAYERS, again=True)
    assert chooser.limit() < 0
    verified, per_layer = chooser.expected(0.0)
    assert verified > per_layer
