"""Variables that look like ours and are not: ``MLX_LM_STREAMING_*`` names no option has, and near
misses of the prefix (``MLX_LM_STREAMNG_EXPERTS``). ``options`` makes them an error where streaming
is asked for, and a warning where it is not; each is named with the closest real one."""

import os
from typing import Optional

from ..option_table import ENV, OTHER_ENV, PREFIX


def unknown_variables(environ=os.environ) -> list:
    """The variables set in ``environ`` that look like ours and are not: ``MLX_LM_STREAMING_*``
    and near misses of that prefix (``MLX_LM_STREAMNG_EXPERTS``, ``mlx_lm_streaming_experts``),
    sorted. One rule for all of them: an error where streaming is asked for, else a warning."""
    known = set(ENV.values()) | set(OTHER_ENV)
    return sorted(k for k in environ if k not in known and _looks_like_ours(k))


def _looks_like_ours(name: str) -> bool:
    import difflib

    if name.startswith(PREFIX):
        return True
    head = name.upper()[: len(PREFIX)]
    return difflib.SequenceMatcher(None, head, PREFIX).ratio() >= 0.8


def closest_variable(name: str) -> Optional[str]:
    """The variable of ours whose name is closest to ``name`` (``difflib``), if any is close.
    Compared without the common prefix, which would make every name look alike (a near miss of
    the prefix, with it: the prefix is where it went wrong)."""
    import difflib

    everything = sorted(set(ENV.values()) | set(OTHER_ENV))
    if not name.startswith(PREFIX):
        close = difflib.get_close_matches(name.upper(), everything, n=1, cutoff=0.6)
        return close[0] if close else None
    ours = {v[len(PREFIX) :]: v for v in everything}
    close = difflib.get_close_matches(name[len(PREFIX) :], list(ours), n=1, cutoff=0.6)
    return ours[close[0]] if close else None


def misspelt(name: str) -> str:
    closest = closest_variable(name)
    return f"{name} (did you mean {closest}?)" if closest else f"{name} (misspelt?)"
