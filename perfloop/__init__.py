"""perfloop: predictive performance intelligence for AI training.

This package holds the CLI, the settings and the shared runtime (Kafka and warehouse
clients, the topic/table catalog, the embedded stack). The tiers live beside it:
`perfloop.producers`, `perfloop.streams`, `perfloop.models`, `perfloop.actuators`, and the
contract between them, `perfloop.schemas`.
"""

__version__ = "0.1.0.dev0"
__all__ = ["__version__"]
