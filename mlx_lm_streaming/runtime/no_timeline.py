"""``NO_TIMELINE``: the timeline's recording methods, recording nothing (no ``--streaming-trace``).

``files.timeline.Timeline`` records a run; ``ExpertCache.timeline`` is that recorder or None. Code
off the calling thread's per-layer path (the background readers, the demand threads' reads) takes
``cache.timeline or NO_TIMELINE`` and records unconditionally: a call that does nothing costs
nothing there beside a read. The calling thread's per-layer code keeps its ``if tl`` branches: there
a branch is cheaper than a call, and each call is counted (``bench/hot_path_calls.py``).
"""

import time


class NoTimeline:
    """Takes every ``Timeline`` recording call and records nothing."""

    # the same clock as ``Timeline.now`` (a C function: no Python call)
    now = staticmethod(time.perf_counter)

    def __bool__(self) -> bool:
        return False

    def span(self, name, start, cat, **args) -> None:
        pass

    def read(self, start, layer, expert, nbytes, kind, **args) -> None:
        pass

    def batch_read(self, start, batch, error=None) -> None:
        pass

    def layer(self, start, path, tokens, **args) -> None:
        pass


NO_TIMELINE = NoTimeline()
