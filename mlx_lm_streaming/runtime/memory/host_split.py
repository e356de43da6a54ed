"""How much host memory the host tier takes (``tiers.set_up``, ``report``): the rest of the experts
where the host can spare it, less a margin for the OS, other programs and the page cache."""

from typing import Optional

from ..sizes import decimal_gb, gb_as_given
from .free_memory import meminfo_field

# of the host RAM the OS calls available, this much stays free for the OS, other programs and the
# page cache when the default host tier is sized (the larger of the two)
HOST_MARGIN_BYTES = 4 * 10**9
HOST_MARGIN_SHARE = 0.1
FLAG = "--expert-host-gb / MLX_LM_STREAMING_HOST_GB / expert_host_gb"


def available_host_bytes() -> Optional[int]:
    """``MemAvailable`` of /proc/meminfo (Linux: where mlx-cuda runs), or None (its line read as
    the moving budget reads it: ``free_memory.meminfo_field``)."""
    try:
        with open("/proc/meminfo") as f:
            return meminfo_field(f.read(), "MemAvailable")
    except OSError:
        return None


def host_room(available: Optional[int]) -> int:
    """What the host tier may take of ``available`` bytes: less the margin, never below 0."""
    if available is None:
        return 0
    return max(0, available - max(HOST_MARGIN_BYTES, int(HOST_MARGIN_SHARE * available)))


def split(total: int, device: int, given_gb, available: Optional[int]) -> int:
    """The host tier's bytes for ``total`` expert bytes of which ``device`` fit the device budget:
    0 where the device holds them all; given: its bytes (``ConfigurationError`` where more than
    the host can spare); the default: the rest where the host can spare it, else 0. A tier that
    with the device's cannot hold every expert is 0 (misses stream from disk, as without)."""
    from ...errors import ConfigurationError
    from ...option_table import GB

    rest = max(0, total - device)
    if rest == 0 or given_gb == 0:
        return 0
    room = host_room(available)
    if given_gb is None:
        return rest if rest <= room else 0
    asked = min(int(given_gb * GB), rest)
    if asked > room:
        raise ConfigurationError(
            f"{FLAG} {gb_as_given(given_gb)}: the host tier would take {decimal_gb(asked)}, more "
            f"than the {decimal_gb(room)} of available host memory less a margin; lower it or give 0"
        )
    return asked if asked >= rest else 0
