"""Everything that turns a call into model inputs: the tokenizer, prompts, images, and each model's token rules.
It runs where calls are parsed (the server process, or each front-end process with --frontends N)."""
