"""What a decode call costs on this machine, measured as the run goes, and the mode it leads to.

A decode-sized model call runs as a verified step (one host sync per token, a miss paid with a
sync, its reads and the layers after it computed again: ``verified_step.py``) or with the
per-layer schedule (one host sync per MoE layer, nothing computed twice). Which is quicker depends
on the machine: on a GPU (and on a Mac) a host sync costs about what a layer's compute does, on
the CPU a sync is cheap and compute dear. ``DecodeCosts`` measures, with ``time.perf_counter``
around what the call does anyway (no host sync added, but for one probe at the run's first decode
call):

- ``sync``: the host sync's cost: the probe (a wait on a fresh tiny array, the least of a few),
  then, once both modes ran, the extra time a per-layer call takes per MoE layer over a verified
  step that missed nowhere (``(per_layer - verified) / (layers - 1)``: the sync a per-layer call
  makes, with the host work that goes with it);
- ``verified``: a verified call that missed nowhere (a sync and every layer's compute), and
  ``replay``: what each layer run again after a miss adds (its check's sync and the layers after it
  computed again), both from a running least-squares fit of the verified calls' times (their reads
  taken out) on their replays: through the mean of the calls that missed nowhere where there are
  some (measured, not extrapolated: docs/design.md, "Which mode a decode call takes", says why),
  else the fit's intercept;
- ``per_layer``: a per-layer call that missed nowhere, and ``per_layer_miss``: what each MoE layer
  that missed adds beside its reads (the host work of a miss), from the same fit of the per-layer
  calls' times on their MoE layers that missed;
- ``read_verified`` / ``read_per_layer``: seconds per expert read in each mode (a verified step's
  misses of a token read together, on the demand threads; a per-layer call's by its layer:
  ``CacheStats``' wait and install time);
- ``experts_per_miss``, ``replays_per_miss``, ``replays_per_call``: experts read per MoE layer that
  missed in each mode (a verified step reads the experts the pass beyond a miss named too, so
  one mean for both modes misprices a per-layer call's misses: docs/design.md), replays per layer
  that missed, replays per verified call that missed; ``again``: the share of verified calls run
  again whole, per layer (``verified_step._Again``).

Each is a running mean (the newest call weighs ``WEIGHT``; the fit forgets at ``DECAY``), so the
costs follow the run. ``limit`` is the choice: with ``k = share * layers`` MoE layers expected to
miss (``share``: ``StepRunner.missed_share``, the running share of MoE layers that missed),

    verified(share)  = verified + replays * replay + k * e_verified * read_verified
    per_layer(share) = per_layer + k * (per_layer_miss + e_per_layer * read_per_layer)

with ``e_...`` each mode's ``experts_per_miss``, ``replays = replays_per_miss * k``, or, where a
token's misses are read together (guesses and all: one replay per call that misses),
``replays_per_call * (1 - (1 - share) ** layers)``; a share ``again`` of verified calls costs a
per-layer call and a forward instead. The call is a verified step while ``verified(share) <=
per_layer(share)``: ``limit`` is the share where they meet. What is not measured yet comes from what
is: a per-layer call is ``verified + (layers - 1) * sync``, a replay is ``sync`` and half the
layers' compute; before any call was measured (the starting prior) every eligible call is tried as a
verified step, which measures both its clean cost and what a miss adds. After ``REFRESH`` calls
without a verified one, one runs (a measurement that chose the per-layer schedule once is not
trusted for ever).

The chooser is opt-in (``CacheTuning.verify_choice="costs"``): the share limits
(``MAX_MISSED_SHARE``...) decide by default on every backend: on the CPU it does no better than
they do, on CUDA and Metal it is unverified (docs/design.md, "Which mode a decode call takes", with
the figures).
"""

import math
import time
from typing import Dict, Optional

import mlx.core as mx

from ..errors import ConfigurationError

# weight of the newest call in each running mean; the fit of verified calls' times keeps this
# share of its sums at each call (a window of about ten calls)
WEIGHT = 0.25
DECAY = 0.9
# calls of each mode left out at the start: the first calls of a shape build kernels and fill
# the allocator's pools (docs/design.md, "Which mode a decode call takes")
WARMUP = 1
# a call that takes more than this many times its mode's estimate is left out (a pause of the
# host, another process)
OUTLIER = 20.0
# calls in the other mode after which the chooser runs one verified call again, to measure it
REFRESH = 64
# clean verified calls (decayed) the fit wants before a clean per-layer call stops trying one;
# such a try comes at most once in EXPLORE_GAP calls, a gap that doubles (up to REFRESH) with each
# verified call that missed and starts again at a clean one: the token after a clean one mostly
# misses, and a verified call that misses costs more than a per-layer one on the CPU (the figures:
# docs/design.md, "Which mode a decode call takes")
CLEAN_POINTS = 2.0
EXPLORE_GAP = 16
# clean calls (decayed) from which a mode's clean cost is their mean, not the fit's intercept
CLEAN_MEASURED = 1.0
# waits on a tiny array that the probe takes the least of
PROBE_REPEATS = 5
MODES = ("verified", "per_layer")
ESTIMATES = ("sync", "layer", "verified", "per_layer", "replay", "per_layer_miss",
             "read_verified", "read_per_layer")  # fmt: skip

# how a backend's decode calls choose between a verified step and the per-layer schedule, where
# ``CacheTuning.verify_choice`` does not say: "costs", by this run's measured costs
# (``DecodeCosts``); "limits", by the share limits below (``MAX_MISSED_SHARE``...); "always": every
# call that may be a verified step is one. "limits" everywhere: on the CPU the chooser does not
# beat them, on CUDA and Metal, where the limits are the guess, it was not measured
# (docs/design.md, "Which mode a decode call takes"). It is opt-in (``verify_choice="costs"``)
CHOICE: dict = {}
CHOICE_ELSE = "limits"
CHOICES = ("costs", "limits", "always")

# weight of the newest call in the running share of MoE layers that missed (``note_call``)
MISSED_WEIGHT = 0.25

# The limits ("limits"), measured once on the CPU and the H200, kept where the chooser was not.
# Verified steps while recent tokens missed in at most this share of the MoE layers: each layer
# that misses costs a host sync and the layers after it computed again, so with misses in most
# layers the per-layer schedule (one sync per layer, nothing computed twice) is cheaper. On a GPU a
# host sync costs as much as a layer's compute; on the CPU compute is dear and a sync cheap, so
# there verified steps are tried only after a run of tokens that missed nowhere (measured:
# docs/benchmarks/README.md, "Decode regimes")
MAX_MISSED_SHARE = {"cpu": 0.01}
MAX_MISSED_SHARE_GPU = 0.35
# the same on a GPU when a token's misses are read together: a token that missed costs about one
# more sync and a partial forward, not one per layer that missed
MAX_MISSED_SHARE_TOGETHER_GPU = 1.0
# on a GPU, a token that missed in no layer lets the next one be a verified step, whatever the
# running share says: after a burst of misses (a new topic, the cache filling) the running share
# kept the per-layer schedule, slower than a verified step, for the tokens it took to decay
# (docs/benchmarks/README.md, "Behind the code's constants"). Not on the CPU, where a verified step
# that misses costs more than the sync it saves.
CLEAN_TOKEN_RETRIES = {"cpu": False}


def note_call(runner, missed, verified, seconds=None, reads=0.0, experts=0, replays=0,
              again=False) -> None:
    """A decode-sized call of ``runner`` (``runner.StepRunner``) that ``missed`` in that
    many MoE layers, as a verified step or not (``again``: one run again whole, per layer),
    ``seconds`` long (None: not measured), ``reads`` of them reading ``experts`` experts,
    ``replays`` layers run again: the runner's running share of MoE layers that missed, its costs
    (where it chooses by them), and a clean token's retry."""
    share = min(1.0, missed / runner.moe)
    runner.missed_share += MISSED_WEIGHT * (share - runner.missed_share)
    runner.missed_tokens += MISSED_WEIGHT * ((missed > 0) - runner.missed_tokens)
    costs = runner.costs
    if costs is not None:
        costs.together = runner.together and runner.guess_precision >= runner.min_precision
        costs.add(verified, None if again else seconds, reads, experts, missed, replays, again)
    if share == 0 and not verified and runner.clean_retries:
        limit = runner.limit()
        if costs is None or limit >= 1 / runner.moe:
            runner.missed_share = min(runner.missed_share, limit)


def way(given: Optional[str], backend: str, verified_steps: bool = True):
    """How a model's decode calls choose their mode: ``(choice, DecodeCosts or None, the
    runner's limit or None: the share limits, whether a clean token retries a verified step)``
    for ``CacheTuning.verify_choice`` ``given`` (None: ``CHOICE``) on ``backend`` (nothing to
    measure where ``CacheTuning.verified_steps`` is off). By costs, a
    clean token retries where a verified step that misses in one layer is still the quicker
    (``note_call``)."""
    choice = given or CHOICE.get(backend, CHOICE_ELSE)
    if choice not in CHOICES:
        raise ConfigurationError(f"verify_choice {choice!r} is none of {', '.join(CHOICES)}")
    if choice == "costs" and verified_steps:  # (nothing to choose with verified steps off)
        costs = DecodeCosts()
        return choice, costs, costs.limit, True
    retries = CLEAN_TOKEN_RETRIES.get(backend, True)
    return choice, None, _every_share if choice == "always" else None, retries


def _every_share() -> float:
    """``StepRunner.limit`` where every call that may be a verified step is one."""
    return math.inf


def probe_sync(repeats: int = PROBE_REPEATS) -> float:
    """Seconds of the host's wait on a tiny array evaluated on the device: the least of
    ``repeats``."""
    a = mx.zeros((1,))
    mx.eval(a)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a = a + 1
        mx.eval(a)
        best = min(best, time.perf_counter() - start)
    return best


class DecodeCosts:
    """Running measurements of a model's decode calls in each mode, and ``limit``: the share of
    missed MoE layers up to which a verified step is the quicker."""

    def __init__(self, layers: int = 0):
        self.layers = layers  # MoE layers
        self.probe: Optional[float] = None
        # per mode, decayed sums of a fit of a call's seconds (its reads taken out) on its
        # replays (verified) or its MoE layers that missed (per layer): sums of 1, x, x*x, y, x*y,
        # and of 1 and y over the calls with x = 0 (clean calls: where there are some, the clean
        # cost is their mean, measured, and the slope is fitted through it: ``_limit``)
        self.fits = {m: [0.0] * 7 for m in MODES}
        # a per-layer call missed nowhere since the last verified call, while fewer than
        # ``CLEAN_POINTS`` verified calls that missed nowhere were measured lately: the next call
        # is a verified one, to measure it
        self.clean_per_layer = False
        # running means, None until measured: seconds per expert read in each mode, experts read
        # per MoE layer that missed, replays per MoE layer that missed (verified)
        self.read_s = dict.fromkeys(MODES)
        self.experts_per_miss = dict.fromkeys(MODES)
        self.replays_per_miss: Optional[float] = None
        self.replays_per_call: Optional[float] = None  # per verified call that missed
        # whether a token's misses are read together, guesses and all (``StepRunner``: one
        # replay per call that misses, not one per layer)
        self.together = False
        # running share of verified calls that ran again whole, per layer (``verified_step.
        # _Again``: a miss where layers cannot be run again): such a call costs a per-layer one
        # and the forward before it
        self.again = 0.0
        self.calls = {m: 0 for m in MODES}  # calls measured or not, by mode
        self.since_verified = 0  # calls since the last verified one
        self.explore_gap = EXPLORE_GAP  # (``EXPLORE_GAP``)
        self.cache_limit: Optional[float] = None  # ``limit`` until the next measurement
        self.estimate: Dict[str, Optional[float]] = dict.fromkeys(ESTIMATES)

    def start(self, layers: int) -> None:
        """At the run's first decode call: the MoE layers, and the sync probe."""
        self.layers = max(1, layers)
        self.probe = probe_sync()

    def limit(self) -> float:
        """The share of missed MoE layers up to which the next decode call should be a verified
        step: 1.0 (every share) before any measurement and when no verified call ran for
        ``REFRESH`` calls; below 0 where per-layer calls are the quicker even with no miss."""
        since = self.since_verified
        if since >= REFRESH or (
            since >= self.explore_gap
            and self.clean_per_layer
            and self.fits["verified"][5] < CLEAN_POINTS
        ):
            return 1.0
        limit = self.cache_limit
        if limit is None:
            limit = self.cache_limit = self._limit()
        return limit

    def _limit(self) -> float:
        """``limit`` from the measurements; the estimates behind it kept (``estimate``). One
        function, the fits solved inline: it runs once per decode call."""
        layers, sync = self.layers or 1, self.probe
        fitted = {}
        for mode, (n, sx, sxx, sy, sxy, n0, sy0) in self.fits.items():
            clean = extra = None
            if n0 >= CLEAN_MEASURED:
                # clean calls measured: their mean, and the slope of the others through it (an
                # intercept extrapolated from calls that missed is biased by the run's first,
                # slowest calls: docs/design.md, "Which mode a decode call takes")
                clean = sy0 / n0
                if sxx > 1e-9:
                    extra = max(0.0, (sxy - clean * sx) / sxx)
            elif n > 0:
                mean_x, mean_y = sx / n, sy / n
                var = sxx / n - mean_x * mean_x
                # (an intercept extrapolated far from every call is not trusted)
                fits = var > 1e-3 and n >= 2 and (n0 >= 0.5 or mode == "per_layer")
                slope = (sxy / n - mean_x * mean_y) / var if fits else -1.0
                if slope >= 0:
                    clean, extra = max(0.0, mean_y - slope * mean_x), slope
                elif mean_x < 1e-3:  # calls that missed nowhere
                    clean = mean_y
                elif mode == "verified" and sync is not None:
                    # no clean call lately: split by the prior (a replay is a sync and half the
                    # layers' compute, a clean call a sync and every layer's)
                    compute = max(0.0, mean_y - sync * (1 + mean_x)) / (layers * (1 + mean_x / 2))
                    clean, extra = sync + layers * compute, sync + compute * layers / 2
                else:  # per layer, the same misses in every call: their host work unknown
                    clean = mean_y
            fitted[mode] = (clean, extra)
        (clean, replay), (per_layer, host) = fitted["verified"], fitted["per_layer"]
        # the sync a per-layer call makes: what it costs more than a clean verified call, per
        # MoE layer but one; the probe until both were measured
        if clean is not None and per_layer is not None and layers > 1:
            sync = max(sync or 0.0, (per_layer - clean) / (layers - 1))
        if clean is None and per_layer is not None and sync is not None:
            clean = max(0.0, per_layer - (layers - 1) * sync)
        if per_layer is None and clean is not None and sync is not None:
            per_layer = clean + (layers - 1) * sync
        layer = None if clean is None else max(0.0, clean - (sync or 0.0)) / layers
        if replay is None and layer is not None:
            replay = (sync or 0.0) + layer * layers / 2
        read_v, read_p = self.read_s["verified"], self.read_s["per_layer"]
        read_v, read_p = (read_v if read_v is not None else read_p), (read_p or read_v)
        self.estimate = {
            "sync": sync, "layer": layer, "verified": clean, "per_layer": per_layer,
            "replay": replay, "per_layer_miss": host, "read_verified": read_v,
            "read_per_layer": read_p,
        }  # fmt: skip
        if clean is None or per_layer is None:
            # the starting prior: try verified steps, and measure them; where they ran again
            # whole (not measured), per-layer calls
            return 1.0 if self.again < 0.5 else -1.0
        # the share up to which a verified call is expected the quicker: ``expected``'s terms,
        # inline (no call per share tried): at 0, at 1, then halving the interval between
        e_v, e_p = self._experts_per_miss()
        rho = self.replays_per_miss if self.replays_per_miss is not None else 1.0
        rho_call = self.replays_per_call if self.replays_per_call is not None else 1.0
        per_v, per_p = e_v * (read_v or 0.0), (host or 0.0) + e_p * (read_p or 0.0)
        lo, hi, share, again = 0.0, 1.0, 0.0, self.again
        for i in range(16):
            k = share * layers
            r = rho_call * (1 - (1 - share) ** layers) if self.together else rho * k
            p = per_layer + k * per_p
            quicker = (1 - again) * (clean + r * replay + k * per_v) + again * (p + clean) <= p
            if i == 0 and not quicker:
                return -1.0  # per layer even where nothing misses
            if i == 1 and quicker:
                return 1.0
            if i > 1:
                lo, hi = (share, hi) if quicker else (lo, share)
            share = 1.0 if i == 0 else (lo + hi) / 2
        return lo

    def _experts_per_miss(self):
        """Experts read per MoE layer that missed, ``(verified, per layer)``: each mode's own, the
        other's where one is not measured yet, 1 where neither is."""
        e_v, e_p = self.experts_per_miss["verified"], self.experts_per_miss["per_layer"]
        e_v = e_v if e_v is not None else e_p
        e_p = e_p if e_p is not None else e_v
        return (e_v if e_v is not None else 1.0), (e_p if e_p is not None else 1.0)

    def expected(self, share: float):
        """``(verified, per_layer)``: the expected seconds of the next call in each mode at a
        running share ``share`` of MoE layers that missed; None where not known yet. With ``k =
        share * layers`` MoE layers expected to miss, a verified call runs ``replays_per_miss *
        k`` layers again (read together, one replay per call that misses: ``replays_per_call *
        (1 - (1 - share) ** layers)``) and reads ``experts_per_miss * k`` experts."""
        self._limit()
        c = self.estimate
        if c["verified"] is None or c["per_layer"] is None:
            return None, None
        layers = self.layers or 1
        k = share * layers
        e_v, e_p = self._experts_per_miss()
        if self.together:
            rho_call = self.replays_per_call if self.replays_per_call is not None else 1.0
            replays = rho_call * (1 - (1 - share) ** layers)
        else:
            replays = (self.replays_per_miss if self.replays_per_miss is not None else 1.0) * k
        verified = c["verified"] + replays * c["replay"] + k * e_v * (c["read_verified"] or 0.0)
        per_layer = c["per_layer"] + k * ((c["per_layer_miss"] or 0.0)
                                          + e_p * (c["read_per_layer"] or 0.0))  # fmt: skip
        # a share ``again`` of verified calls runs again whole: a per-layer call after a forward
        again = self.again
        return (1 - again) * verified + again * (per_layer + c["verified"]), per_layer

    # the measurements, once per decode call

    def add(self, verified: bool, seconds: Optional[float], reads: float, experts: int,
            missed: int, replays: int = 0, again: bool = False) -> None:
        """A decode call: in the mode ``verified`` or not, ``seconds`` long (None: not to measure),
        ``reads`` of them reading ``experts`` experts for the ``missed`` MoE layers that missed,
        ``replays`` layers run again (verified; ``again``: the call ran again whole, per layer)."""
        mode = "verified" if verified else "per_layer"
        self.calls[mode] += 1
        if verified:
            self.again += WEIGHT * (again - self.again)
            self.explore_gap = EXPLORE_GAP if missed == 0 else min(REFRESH, 2 * self.explore_gap)
        self.clean_per_layer = not verified and (self.clean_per_layer or missed == 0)
        self.since_verified = 0 if verified else self.since_verified + 1
        self.cache_limit = None
        if seconds is None or self.calls[mode] <= WARMUP:
            return
        if experts and reads > 0:
            old = self.read_s[mode]
            self.read_s[mode] = reads / experts if old is None else old + WEIGHT * (
                reads / experts - old)
        if missed:
            old = self.experts_per_miss[mode]
            new = experts / missed
            self.experts_per_miss[mode] = new if old is None else old + WEIGHT * (new - old)
            if verified:
                old, new = self.replays_per_miss, replays / missed
                self.replays_per_miss = new if old is None else old + WEIGHT * (new - old)
                old = self.replays_per_call
                self.replays_per_call = replays if old is None else old + WEIGHT * (replays - old)
        work = max(0.0, seconds - reads)
        x = replays if verified else missed
        c = self.estimate  # (as the last choice saw them)
        guess = c["verified" if verified else "per_layer"]
        fit = self.fits[mode]
        # (only against a measured clean cost: an intercept extrapolated from calls that missed
        # in most layers came out near 0 on the CPU, and every clean call after it was left out
        # as an outlier, so the estimate never mended)
        if (
            guess
            and fit[5] >= CLEAN_MEASURED
            and work > OUTLIER * (guess + x * (c["replay" if verified else "sync"] or 0.0))
        ):
            return
        fit[0] = DECAY * fit[0] + 1.0
        fit[1] = DECAY * fit[1] + x
        fit[2] = DECAY * fit[2] + x * x
        fit[3] = DECAY * fit[3] + work
        fit[4] = DECAY * fit[4] + x * work
        fit[5] = DECAY * fit[5] + (x == 0)
        fit[6] = DECAY * fit[6] + (work if x == 0 else 0.0)

    def summary(self) -> Dict[str, object]:
        """For ``--streaming-stats``: the estimates in seconds (None: not measured), the probe,
        the calls of each mode, the share limit now."""
        limit = self.limit()
        return {**self.estimate, "probe": self.probe, "calls": dict(self.calls), "limit": limit}


def summary(runner) -> Dict[str, object]:
    """The decode calls' part of ``--streaming-stats``' counters (``ExpertCache.summary``) for a
    model's ``runner.StepRunner`` (None: none yet)."""
    r = runner
    return {
        # calls run as verified steps (verified_step.py), and layers run again in them
        "verified_steps": r.verified if r is not None else 0,
        "verified_replays": r.replays if r is not None else 0,
        # experts read on the word of a pass beyond a miss, and those the pass run again used
        "verified_named": r.named if r is not None else 0,
        "verified_named_used": r.named_used if r is not None else 0,
        # decode-sized calls run per layer; how each call's mode was chosen; the costs measured
        # for the choice (``DecodeCosts.summary``; None: not chosen by costs, or no decode yet)
        "per_layer_decodes": r.per_layer_decodes if r is not None else 0,
        # verified steps checked once the next token was built on them (checked_late.py), and
        # next tokens taken back because the step before them missed
        "checked_late": r.checked_late if r is not None else 0,
        "checked_late_dropped": r.dropped if r is not None else 0,
        "decode_choice": r.choice if r is not None else None,
        "decode_costs": (
            r.costs.summary() if r is not None and r.costs is not None and r.moe else None
        ),
    }
