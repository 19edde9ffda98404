"""Async tests without pytest-asyncio."""

from __future__ import annotations

import asyncio
import functools


def run_async(test):
    """Runs an async test function in a fresh event loop."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        asyncio.run(test(*args, **kwargs))

    return wrapper
