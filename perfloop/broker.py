"""Moved: the embedded broker is the stack's, `perfloop.stack.broker`. These names warn and
keep working for one release."""

from perfloop.deprecation import moved

__all__: list[str] = []

__getattr__ = moved(
    __name__,
    {n: "perfloop.stack.broker" for n in ("RETENTION_NOTE", "broker_argv", "tansu_binary")},
)
