"""Training scripts that perfloop runs in its demos and benchmarks, as a user would run theirs:
unmodified (they do not import perfloop)."""
