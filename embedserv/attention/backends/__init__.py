"""Attention backends. Each computes the same function; `naive` is the oracle the others are tested against."""
