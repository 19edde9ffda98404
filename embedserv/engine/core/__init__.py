"""The engine core: workers, their step loops and step sources, `infer` and `generate` (the only callers
of the executor)."""
