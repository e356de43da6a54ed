"""Which mode a decode call takes: a verified step while recent tokens missed in few enough MoE
layers, else the per-layer schedule (``StepRunner.limit``, asked once per decode call).

A verified step (one host sync per token, a miss paid with a sync, its reads and the layers after it
computed again: ``verified_step.py``) is the quicker while few layers miss; with misses in most
layers the per-layer schedule (one sync per layer, nothing computed twice) is. ``MAX_MISSED_SHARE``
and the constants beside it say where, per backend, measured on the CPU and the H200. A measured-cost
chooser (``verify_choice="costs"``) was tried and left (issue 46: 0.69-0.88 of the best forced mode
on the CPU with late checks, against the rule of within 10% in every regime): docs/design.md,
"Which mode a decode call takes", has the figures.
"""

import math
from typing import Dict, Optional

from ...errors import ConfigurationError

# how a decode call chooses (``CacheTuning.verify_choice``; None: "limits"): "limits", by the share
# limits below; "always": every call that may be a verified step is one (tests and benchmarks)
CHOICES = ("limits", "always")
# choices that were and are no more: what to say to a user who still gives one
RETIRED = {"costs": "the measured-cost chooser left in issue 46 (docs/design.md)"}

# weight of the newest call in the running share of MoE layers that missed (``note_call``)
MISSED_WEIGHT = 0.25

# The limits, measured once on the CPU and the H200. Verified steps while recent tokens missed in
# at most this share of the MoE layers: each layer that misses costs a host sync and the layers after it computed again, so with misses in most
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


def note_call(runner, missed: int, verified: bool) -> None:
    """A decode-sized call of ``runner`` (``runner.StepRunner``) that ``missed`` in that many
    MoE layers, as a verified step or not: the runner's running shares of MoE layers and of calls
    that missed, and a clean token's retry."""
    share = min(1.0, missed / runner.moe)
    runner.missed_share += MISSED_WEIGHT * (share - runner.missed_share)
    runner.missed_tokens += MISSED_WEIGHT * ((missed > 0) - runner.missed_tokens)
    if share == 0 and not verified and runner.clean_retries:
        runner.missed_share = min(runner.missed_share, runner.limit())


def way(given: Optional[str], backend: str):
    """How a model's decode calls choose their mode: ``(choice, the runner's limit or None: the
    share limits, whether a clean token retries a verified step)`` for ``CacheTuning.
    verify_choice`` ``given`` (None: "limits") on ``backend``."""
    choice = given or "limits"
    if choice in RETIRED:
        raise ConfigurationError(f"verify_choice {choice!r} is retired: {RETIRED[choice]}")
    if choice not in CHOICES:
        raise ConfigurationError(f"verify_choice {choice!r} is none of {', '.join(CHOICES)}")
    retries = CLEAN_TOKEN_RETRIES.get(backend, True)
    return choice, _every_share if choice == "always" else None, retries


def _every_share() -> float:
    """``StepRunner.limit`` where every call that may be a verified step is one."""
    return math.inf


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
        # checks whose reads were issued as the pass named them (``CacheTuning.reads_in_pass``)
        "verified_read_in_pass": r.read_in_pass if r is not None else 0,
        # steps whose first MoE call's reads went as it was built (``first_call_reads``)
        "verified_first_call_reads": r.first_call_reads if r is not None else 0,
        # decode-sized calls run per layer, and how each call's mode was chosen
        "per_layer_decodes": r.per_layer_decodes if r is not None else 0,
        # verified steps checked once the next token was built on them (checked_late.py), and
        # next tokens taken back because the step before them missed
        "checked_late": r.checked_late if r is not None else 0,
        "checked_late_dropped": r.dropped if r is not None else 0,
        "decode_choice": r.choice if r is not None else None,
    }
