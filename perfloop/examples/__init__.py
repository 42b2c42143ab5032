"""Training scripts that perfloop runs in its demos and benchmarks, as a user would run theirs:
unmodified (they do not import perfloop); and services a user would write on perfloop's typed
client (`approver`: approves the recommendations worth taking, docs/client.md)."""
