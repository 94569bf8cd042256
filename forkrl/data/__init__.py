"""Problems and rewards: the built-in synthetic tasks, JSONL datasets, the resumable data order and the
verifiers (exact match, math-verify)."""
