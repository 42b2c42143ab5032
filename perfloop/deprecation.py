"""Names that moved keep working for one release, with a `DeprecationWarning`.

A module whose public names moved sets ``__getattr__ = moved(__name__, {name: new_module})``:
reading one of those names there imports it from its new module, warns once per place that
reads it (Python's default warning filter), and hands back the same object. CHANGELOG.md lists
every moved name; the aliases go in the release after the one that moved them.

>>> import warnings
>>> getattr_ = moved("old.place", {"dumps": "json"})
>>> with warnings.catch_warnings(record=True) as w:
...     warnings.simplefilter("always")
...     f = getattr_("dumps")
>>> import json; f is json.dumps, w[0].category.__name__
(True, 'DeprecationWarning')
>>> str(w[0].message)
'old.place.dumps moved to json.dumps; import it from there (the old name goes in the next release)'
>>> getattr_("loads")
Traceback (most recent call last):
...
AttributeError: module 'old.place' has no attribute 'loads'
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["callable_as", "moved"]


def moved(module: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module`` that finds each of ``names`` (name → the module
    it moved to) at its new home, with a `DeprecationWarning`; any other name is an
    `AttributeError`, as without it."""
    table = dict(names)

    def __getattr__(name: str) -> Any:
        new = table.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} moved to {new}.{name}; import it from there (the old name goes "
            "in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new), name)

    __getattr__.moved = table  # type: ignore[attr-defined]
    return __getattr__


def callable_as(module: str, package: str, function: str) -> None:
    """Let the moved module ``module`` be called as ``package``'s ``function`` of the same name.

    A module whose name was also a function of its package (``perfloop.models.goodput``)
    moves so the name means the function alone; its old place stays for a release. But
    importing that old module makes the package's attribute the module (Python sets it after
    the import), and whoever then calls the package's function would call a module. So the
    old module calls through to the function.
    """

    class _CallableModule(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return getattr(importlib.import_module(package), function)(*args, **kwargs)

    sys.modules[module].__class__ = _CallableModule
