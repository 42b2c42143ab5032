"""Reading settings at an entry point: a bad or unknown ``PERFLOOP_*`` variable is one line
(`perfloop.settings` re-exports these)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from perfloop._settings_base import BaseServiceSettings
from perfloop.listening import reach_listening_stack

__all__ = ["INTERNAL_ENV", "check_environment", "known_settings", "load_settings"]

_S = TypeVar("_S", bound=BaseSettings)


def load_settings(cls: type[_S]) -> _S:
    """``cls()`` from the environment; a bad ``PERFLOOP_*`` value is one `ConfigError` line.

    >>> import os; os.environ["PERFLOOP_ALLOWED_LATENESS_S"] = "zero"
    >>> from perfloop.exceptions import ConfigError
    >>> from perfloop.settings import StreamsSettings
    >>> try:
    ...     load_settings(StreamsSettings)
    ... except ConfigError as e:
    ...     print(str(e).split(":")[0])
    invalid setting PERFLOOP_ALLOWED_LATENESS_S='zero'
    >>> del os.environ["PERFLOOP_ALLOWED_LATENESS_S"]
    """
    from perfloop.exceptions import ConfigError

    try:
        settings = cls()
    except ValidationError as e:
        raise ConfigError(_one_line(e.errors()[0])) from None
    if isinstance(settings, BaseServiceSettings):  # the listening stack of this machine
        settings = reach_listening_stack(settings)
    return settings


def _one_line(err: Any) -> str:
    """A settings validation error as one line: the variable, the value given and what it
    must be (the valid values where the field has a fixed set)."""
    if not err.get("loc"):  # a check of several settings together: its message names them
        return f"invalid settings: {str(err['msg']).removeprefix('Value error, ')}"
    name = f"PERFLOOP_{str(err['loc'][0]).upper()}"
    given = err.get("input")
    what = err["msg"]
    pattern = str((err.get("ctx") or {}).get("pattern", ""))
    choices = re.fullmatch(r"\^\(([\w|-]+)\)\$", pattern)
    if choices:
        what = "must be one of " + ", ".join(choices.group(1).split("|"))
    shown = f"={given!r}" if isinstance(given, str | int | float) else ""
    return f"invalid setting {name}{shown}: {what}"


INTERNAL_ENV = frozenset(
    {
        "PERFLOOP_BROKER_PID",
        "PERFLOOP_CPU_GROUP",
        "PERFLOOP_GROUP_NICE",
        "PERFLOOP_GROUP_RAISED",
        "PERFLOOP_RUN_COMMAND",
        "PERFLOOP_RUN_HOOKS",
        # docker/compose.yaml's own variables (read by Compose, not by perfloop)
        "PERFLOOP_IMAGE",
        "PERFLOOP_STREAMS_REPLICAS",
    }
)
"""``PERFLOOP_*`` variables that are not settings: those perfloop sets for its own processes,
and docker/compose.yaml's."""
_INTERNAL_PREFIXES = ("PERFLOOP_BENCH_", "PERFLOOP_TEST_")


def _setting_classes() -> list[type[BaseServiceSettings]]:
    out, todo = [], [BaseServiceSettings]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def known_settings() -> dict[str, list[type[BaseServiceSettings]]]:
    """Every settings variable (``PERFLOOP_<FIELD>``) and the classes that read it: every
    subclass of `BaseServiceSettings` defined (`perfloop.settings`, which re-exports this,
    defines the services' classes)."""

    out: dict[str, list[type[BaseServiceSettings]]] = {}
    for cls in _setting_classes():
        for field, info in cls.model_fields.items():
            alias = info.validation_alias if isinstance(info.validation_alias, str) else info.alias
            name = alias.upper() if alias else f"PERFLOOP_{field.upper()}"
            out.setdefault(name, []).append(cls)
    return out


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Validate every ``PERFLOOP_*`` variable of ``environ`` (the process's environment) at an
    entry point, whichever service will read it: an unknown name (with the closest known
    ones) or a bad value (with the valid values) is one `ConfigError` line.

    >>> from perfloop.exceptions import ConfigError
    >>> for env in ({"PERFLOOP_TIER": "bogus"}, {"PERFLOOP_WINDOW_S": "zero"}):
    ...     try:
    ...         check_environment(env)
    ...     except ConfigError as e:
    ...         print(str(e).partition(";")[0])
    invalid setting PERFLOOP_TIER='bogus': must be one of observe, recommend, approve, auto
    unknown setting PERFLOOP_WINDOW_S (did you mean PERFLOOP_WINDOWS or PERFLOOP_RESEND_WINDOW_S?)
    >>> check_environment({"PERFLOOP_TIER": "observe", "PERFLOOP_RUN_HOOKS": "1", "HOME": "/"})
    """
    import difflib
    import os

    from perfloop.exceptions import ConfigError

    env = os.environ if environ is None else environ
    names = sorted(k.upper() for k in env if k.upper().startswith("PERFLOOP_"))
    known = known_settings()
    for name in names:
        if name in known or name in INTERNAL_ENV or name.startswith(_INTERNAL_PREFIXES):
            continue
        close = difflib.get_close_matches(name, list(known), n=2, cutoff=0.75)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise ConfigError(f"unknown setting {name}{hint}; docs/settings.md lists them")
    checked: set[type[BaseServiceSettings]] = set()
    for name in names:
        for cls in known.get(name, ()):
            if cls in checked:
                continue
            checked.add(cls)
            try:
                if environ is None:
                    cls()
                else:  # a mapping of one's own (tests): its values as the fields' inputs
                    cls(**_env_values(cls, env))
            except ValidationError as e:
                raise ConfigError(_one_line(e.errors()[0])) from None


def _env_values(cls: type[BaseServiceSettings], env: Mapping[str, str]) -> dict[str, str]:
    """``cls``'s fields as ``env`` gives them (a mapping that is not the environment: its
    values are taken as they are, not decoded as the environment's JSON values would be)."""
    upper = {k.upper(): v for k, v in env.items()}
    out = {}
    for field, info in cls.model_fields.items():
        name = (info.alias or f"PERFLOOP_{field}").upper()
        if name in upper:
            out[field] = upper[name]
    return out
