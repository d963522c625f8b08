"""Sizes an operator writes (`10GB`, `512MiB`, `80%`), parsed once for every option that takes one."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes from `123`, `10GB` (10^9) or `10GiB` (2^30); ValueError saying what is accepted."""
    m = _SIZE.fullmatch(text)
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: write bytes, or a number with B, KB, MB, GB, TB "
                         "(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class DiskLimit:
    """A limit on a filesystem's use: absolute bytes, or a percentage of its size."""

    bytes: int | None = None
    percent: float | None = None

    @classmethod
    def parse(cls, text: str) -> DiskLimit:
        """`80%` or a size as `parse_size` reads it."""
        t = text.strip()
        if t.endswith("%"):
            try:
                pct = float(t[:-1])
            except ValueError:
                pct = -1.0
            if not 0 < pct <= 100:
                raise ValueError(f"{text!r} is not a percentage between 0 and 100")
            return cls(percent=pct)
        return cls(bytes=parse_size(t))

    def exceeded(self, used: int, total: int) -> bool:
        """Whether `used` bytes of a filesystem of `total` bytes is above the limit."""
        if self.percent is not None:
            return total > 0 and used * 100 > self.percent * total
        return self.bytes is not None and used > self.bytes

    def __str__(self) -> str:
        return f"{self.percent:g}%" if self.percent is not None else f"{self.bytes} bytes"
