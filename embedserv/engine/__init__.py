"""The engine: one asyncio Engine per served model, from tokenization to finished outputs."""
