"""Byte sizes as people write them (``8GiB``, ``512MB``), and the weight-streaming budget given as one."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

# Sizes: decimal units are powers of 1000 (MB = 10^6 bytes), binary ones powers of 1024 (MiB = 2^20), as IEC 80000-13
# has them; both spellings parse, case aside.
DECIMAL_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}
BINARY_UNITS = {"TiB": 1 << 40, "GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}
_BYTE_UNITS = {"": 1, "B": 1} | {unit.upper(): size for unit, size in (DECIMAL_UNITS | BINARY_UNITS).items()}


def parse_size(text: str) -> int:
    """Bytes from a size such as ``8GiB``, ``512MB`` or a number of bytes; ValueError when it is none."""
    value = text.strip().upper().replace(" ", "")
    number = value.rstrip("KMGTIB")
    try:
        size = float(number) * _BYTE_UNITS[value[len(number) :]]
    except (ValueError, KeyError, OverflowError):
        raise ValueError(f"'{text}' is not a size") from None
    if not 0 <= size < float("inf"):
        raise ValueError(f"'{text}' is not a size")
    return int(size)


def format_size(size: int) -> str:
    """A size in the units it was most likely given in: decimal (``1.0 MB``, ``8.00 GB``) when it is a whole number
    of hundredths of its decimal unit, as a size a person wrote in MB or GB is; else binary (``8.00 GiB``, and measured
    sizes). Two decimals from GB/GiB up, one below."""
    decimal = _unit_for(size, DECIMAL_UNITS)
    unit, scale = decimal if size * 100 % decimal[1] == 0 else _unit_for(size, BINARY_UNITS)
    return f"{size / scale:.{2 if scale >= 10**9 else 1}f} {'kB' if unit == 'KB' else unit}"


def _unit_for(size: int, units: dict[str, int]) -> tuple[str, int]:
    """The largest of ``units`` (largest first) that ``size`` reaches, else the smallest."""
    return next(((unit, scale) for unit, scale in units.items() if size >= scale), list(units.items())[-1])


@dataclass(frozen=True)
class WeightBudget:
    """How much of a weight-streaming engine's streamable weights stay on the GPU: ``auto`` (TensorRT's choice
    from free memory), a percentage of the streamable weights, or a size (``8GiB``, ``512MB``, bytes). It applies to
    each streaming engine of a set on its own: a size is kept per engine, never split across the set."""

    text: str
    percent: float | None = None
    size: int | None = None

    @classmethod
    def parse(cls, text: str) -> WeightBudget:
        value = text.strip().upper().replace(" ", "")
        try:
            if value == "AUTO":
                return cls(text)
            if value.endswith("%"):
                percent = float(value[:-1])
                if 0 <= percent <= 100:
                    return cls(text, percent=percent)
            else:
                return cls(text, size=parse_size(value))
        except ValueError:
            pass
        raise ConfigError(
            f"weight streaming budget '{text}' is not auto, a percentage 0%..100% of the streamable weights, "
            "or a size such as 8GiB, 512MB or a number of bytes"
        )
