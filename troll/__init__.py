"""troll: TROLL (trust-region RL for LLMs) in a few small files. See README.md."""
