"""A command template: one command line with ``{name}`` placeholders, split like a shell would
(`shlex`) but never run by one. Its syntax is checked where the template is configured (the
actuator's ``PERFLOOP_STRAGGLER_HOOK``, `perfloop.settings.ActuatorSettings`) and again where
it is run (`perfloop.actuators.hook`)."""

from __future__ import annotations

import re
import shlex

from perfloop.exceptions import ConfigError

__all__ = ["PLACEHOLDERS", "PLACEHOLDER_PATTERN", "check_template"]

PLACEHOLDERS = ("node", "job", "ranks", "rec_id", "reason")
"""What a template may name, each as ``{name}``."""


PLACEHOLDER_PATTERN = re.compile(r"\{([A-Za-z_]\w*)\}")


def check_template(template: str) -> list[str]:
    """The template's arguments; `ConfigError` naming what is wrong (it cannot be split, it is
    empty, the program has a placeholder, or a placeholder is unknown).

    >>> check_template("kubectl cordon {host}")
    Traceback (most recent call last):
    ...
    perfloop.exceptions.ConfigError: unknown placeholder {host} in the action hook; valid: {node} {job} {ranks} {rec_id} {reason}
    """  # noqa: E501
    try:
        argv = shlex.split(template)
    except ValueError as e:
        raise ConfigError(f"the action hook {template!r} cannot be split: {e}") from None
    if not argv:
        raise ConfigError("the action hook is empty")
    valid = " ".join(f"{{{p}}}" for p in PLACEHOLDERS)
    for arg in argv:
        for name in PLACEHOLDER_PATTERN.findall(arg):
            if name not in PLACEHOLDERS:
                raise ConfigError(
                    f"unknown placeholder {{{name}}} in the action hook; valid: {valid}"
                )
    if PLACEHOLDER_PATTERN.search(argv[0]):
        raise ConfigError(f"the action hook's program {argv[0]!r} must be fixed (no placeholder)")
    return argv
