"""Value parsers of the deploy config: byte sizes, memory budgets and graph grids.

Each spelling a user may write (YAML, CLI flag or environment variable) is parsed here and
nowhere else, so a size or a grid reads the same wherever it is given. Standard library only.
"""

from __future__ import annotations

import re
from typing import Literal

GRAPH_GRID_ENV = "DUPLEXCACHE_CFM_GRAPH_GRID"
AUTO: Literal["auto"] = "auto"

_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """Parse a byte size: an int, or a string like ``"80GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"4096"``.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal units (KB, MB, GB, TB) powers
    of 1000; units are case-insensitive. A fractional size must come to a whole number of bytes.
    """
    if isinstance(value, bool):  # bool is an int subclass; True bytes is surely a mistake
        raise ValueError(f"byte size must be an int or a string like '80GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte size must be >= 0, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"byte size must be an int or a string like '80GiB', got {value!r}")
    match = _BYTES_RE.match(value)
    if match is None:
        raise ValueError(f"cannot parse byte size {value!r}: expected e.g. '80GiB', '512MiB', '4096'")
    number, unit = match.group(1), match.group(2).lower()
    if unit not in _BYTE_UNITS:
        known = "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB"
        raise ValueError(f"unknown byte unit {match.group(2)!r} in {value!r} (known: {known})")
    scale = _BYTE_UNITS[unit]
    if "." in number:
        whole, frac = number.split(".")
        numerator = int(whole + frac) * scale
        denominator = 10 ** len(frac)
        if numerator % denominator:
            raise ValueError(f"byte size {value!r} is not a whole number of bytes")
        return numerator // denominator
    return int(number) * scale


def format_bytes(num_bytes: int) -> str:
    """The shortest exact binary-unit spelling of ``num_bytes`` (``format_bytes(2**30) == '1GiB'``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return str(num_bytes)


def parse_budget(value: int | str) -> int | str:
    """``"auto"`` (sized from the free device memory at start-up) or a byte size."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    return parse_bytes(value)


def parse_graph_grid(value: str | list[int] | tuple[int, ...] | None,
                     source: str = GRAPH_GRID_ENV) -> tuple[int, ...] | None:
    """Graph tiers (``"1,4,8,16"`` or a list) as a sorted tuple of unique positive ints.

    ``None`` (not set) stays ``None``; an empty or malformed value is an error naming ``source``
    and the offending item, because a grid that silently parsed to nothing would change nothing.
    """
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{source}: empty graph grid {value!r}; expected e.g. '1,4,8,16'")
        tiers = []
        for item in value.split(","):
            try:
                tiers.append(int(item.strip()))
            except ValueError:
                raise ValueError(f"{source}={value!r}: {item.strip()!r} is not an integer tier") from None
    elif isinstance(value, (list, tuple)):
        tiers = list(value)
        if not tiers or not all(isinstance(t, int) and not isinstance(t, bool) for t in tiers):
            raise ValueError(f"{source}: graph grid must be a non-empty list of ints, got {value!r}")
    else:
        raise ValueError(f"{source}: graph grid must be a string like '1,4,8,16' or a list, got {value!r}")
    for tier in tiers:
        if tier < 1:
            raise ValueError(f"{source}={value!r}: tier {tier} must be positive (>= 1)")
    return tuple(sorted(set(tiers)))
