"""``NO_TIMELINE``: the timeline's recording methods, recording nothing (no ``--streaming-trace``).

``files.timeline.Timeline`` records a run; ``ExpertCache.timeline`` is that recorder or
``NO_TIMELINE``, and every hook records unconditionally: ``tl.span(...)``, ``tl.layer(...)``, with
no ``if tl`` branch (issue 40). Here each recording method is ``"".format``, a method of C that takes
any arguments and returns the empty string: no Python call on the hot path (the calls
``bench/hot_path_calls.py`` counts stay as they were with the branches), and ``now`` is the
timeline's own clock (a C function). The object is false, for the few places that do more than
record where a timeline is set (``bool(cache.timeline)``).
"""

import time

_NOTHING = "".format  # (C: any positional and keyword arguments, no work, no Python frame)


class NoTimeline:
    """Takes every ``Timeline`` recording call and records nothing."""

    # the same clock as ``Timeline.now`` (a C function: no Python call)
    now = staticmethod(time.perf_counter)
    span = read = batch_read = layer = staticmethod(_NOTHING)

    def __bool__(self) -> bool:
        return False


NO_TIMELINE = NoTimeline()
