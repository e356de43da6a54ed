"""Sizes as every line prints them: decimal GB (10**9 bytes, as mlx-lm's "Peak memory"), one way
for the load line, the stats line and its table, ``plan``, ``pack`` and the errors."""

import decimal
import math

from ..option_table import GB


def gb_digits(nbytes: float, up: bool = False) -> str:
    """Bytes as a number of decimal GB (10**9 bytes, as mlx-lm's "Peak memory"), the one way every
    line prints a size: 3 decimals from 1 GB (``4.295``), 3 significant digits below it
    (``0.00265``, ``0.0000768``), never an exponent. ``up``: rounded up, so that a budget of that
    many GB holds ``nbytes`` (a minimum a command prints is accepted when passed back)."""
    gb = nbytes / GB
    if gb <= 0:
        return "0"
    if gb >= 1:
        decimals = 3
    else:  # (trailing zeros of the 3 digits dropped: 0.0012, not 0.00120)
        decimals = 2 - math.floor(math.log10(gb))
    value = gb
    if up:
        step = 10.0**-decimals
        value = math.ceil(round(gb / step, 6)) * step
        while budget_bytes(float(f"{value:.{decimals}f}")) < nbytes:
            value += step
    text = f"{value:.{decimals}f}"
    return text if gb >= 1 else text.rstrip("0").rstrip(".")


def decimal_gb(nbytes: float, up: bool = False) -> str:
    """Bytes as decimal GB, in ``gb_digits``'s one way: ``4.295 GB``, ``0.00265 GB``."""
    return f"{gb_digits(nbytes, up)} GB"


def gb_as_given(gb: float) -> str:
    """A number of GB a user gave, said back as given (its shortest digits), never an exponent:
    ``0.0000154``, ``100000``."""
    text = format(decimal.Decimal(repr(float(gb))), "f")
    return text[:-2] if text.endswith(".0") else text


def gb_at_least(nbytes: int) -> str:
    """``nbytes`` as a number of GB to pass to ``--expert-cache-gb``, rounded up."""
    return gb_digits(nbytes, up=True)


def budget_bytes(gb: float) -> int:
    """A budget in GB as bytes, as loading takes it: to the nearest byte (a budget computed as
    ``bytes / GB`` gives those bytes back, though ``/ 10**9`` is not exact in binary)."""
    return int(round(gb * GB))
