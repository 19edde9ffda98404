"""Sizes as flags and config keys give them: `2GiB`, `512MB`, `1e9` -> bytes (--kv-cache-memory, --embedding-cache)."""

from __future__ import annotations

from embedserv.errors import ConfigError

_MEMORY_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _size(text: str) -> float | None:
    """`2GiB`, `512MB`, `1e9` -> a number of bytes; None if it is not a size."""
    cleaned = text.strip().lower().replace(" ", "")
    number = cleaned.rstrip("kmgib")
    unit = cleaned[len(number) :]
    try:
        return float(number) * _MEMORY_UNITS[unit]
    except (ValueError, KeyError):
        return None


def parse_memory(text: str) -> float:
    """`2GiB`, `512MB`, `1e9` (bytes) or `0.5` (a fraction of device memory) -> a float."""
    value = _size(text)
    if value is None:
        raise ConfigError(
            f"--kv-cache-memory {text!r} is not a size; give bytes (2GiB, 512MiB, 1e9) or a fraction (0.5)"
        )
    if not value > 0:
        raise ConfigError(f"--kv-cache-memory must be above 0, not {text!r}")
    return value


def parse_bytes(text: str, flag: str) -> int:
    """`256MiB`, `1GB`, `1e9`, `0` -> whole bytes, 0 or more."""
    value = _size(text)
    if value is None or not 0 <= value < float("inf"):
        raise ConfigError(f"{flag} {text!r} is not a size; give bytes (256MiB, 1GB, 1e9) or 0 for none")
    return int(value)
