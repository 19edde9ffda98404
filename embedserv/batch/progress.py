"""`embedserv batch`'s progress: a bar on a terminal (tqdm), else a log line every few seconds; both show rows
and tokens per second, errors so far and the time left."""

from __future__ import annotations

import logging
import sys
import time

logger = logging.getLogger("embedserv.batch")


class Progress:
    def __init__(self, total: int | None, done: int, bar: bool | None = None, every_s: float = 10.0) -> None:
        """`total`: the input's rows (None: unknown); `done`: rows a resumed run had written; `bar`: a tqdm bar
        (None: when stderr is a terminal)."""
        self.total, self.done, self.every_s = total, done, every_s
        self.rows = self.tokens = self.errors = 0
        self._start = self._logged = time.monotonic()
        self._bar = None
        if bar if bar is not None else sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=done, unit="row", dynamic_ncols=True, smoothing=0.1)

    def update(self, rows: int, tokens: int, errors: int) -> None:
        self.rows += rows
        self.tokens += tokens
        self.errors += errors
        now = time.monotonic()
        rates = self.rates(now)
        if self._bar is not None:
            self._bar.set_postfix_str(f"{rates[1]:,.0f} tokens/s, {self.errors} errors", refresh=False)
            self._bar.update(rows)
        elif now - self._logged >= self.every_s:
            self._logged = now
            logger.info("%s", self.line(now))

    def rates(self, now: float) -> tuple[float, float]:
        seconds = max(now - self._start, 1e-9)
        return self.rows / seconds, self.tokens / seconds

    def line(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        rows_per_s, tokens_per_s = self.rates(now)
        written = self.done + self.rows
        of = f" / {self.total:,}" if self.total else ""
        left = ""
        if self.total and rows_per_s > 0:
            left = f", {max(self.total - written, 0) / rows_per_s:,.0f} s left"
        return (
            f"{written:,}{of} rows, {rows_per_s:,.0f} rows/s, {tokens_per_s:,.0f} tokens/s, {self.errors} errors{left}"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        logger.info("done: %s", self.line())
