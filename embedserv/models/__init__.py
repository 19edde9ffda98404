"""Native model implementations: token-wise code over a flat [num_tokens, hidden] batch."""
