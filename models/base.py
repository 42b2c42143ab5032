"""The one protocol every online model follows, and the registry the contract suite runs over.

A model learns from one observation at a time and answers for one at a time:

* a **predictor** (`Predictor`) has ``learn_one(x, y)`` and ``predict_one(x) -> float``;
* a **scorer** (`Scorer`) has ``learn_one(x)`` and ``score_one(x) -> float`` in [0, 1];
* a **forecaster** (`Forecaster`) sees a time series: ``learn_one(x)`` takes the newest
  observation (its target among the features) and ``predict_one(x)`` forecasts the target's next
  value (or the time until an event) from what it has seen and the features in ``x``.

``x`` is a flat ``dict[str, float]``; a missing or non-finite feature counts as not observed,
never as an error. ``predict_one`` / ``score_one`` never change the model. Hyperparameters are
the constructor's arguments only, stored on the instance under the same names
(`Model.params`, `Model.clone`); everything learned lives in other attributes. A model does no
I/O, draws randomness only from its ``seed`` argument, and pickles, so stream workers persist it
in their snapshots and swap it for a clone with new hyperparameters.

Every model class registers itself with an example configuration (`register`); the contract
suite `perfloop.models.checks` runs over `registered()`.

>>> class Last(Predictor):
...     def __init__(self, default: float = 0.0) -> None:
...         self.default = default
...         self._y = default
...     def learn_one(self, x: Features, y: float | None = None) -> None:
...         self._y = self.default if y is None else y
...     def predict_one(self, x: Features) -> float:
...         return self._y
>>> m = Last(default=1.0)
>>> m.learn_one({}, 5.0)
>>> m.predict_one({}), m.params, m.clone().predict_one({})
(5.0, {'default': 1.0}, 1.0)
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

__all__ = [
    "Features",
    "Forecaster",
    "Model",
    "Predictor",
    "Registration",
    "Scorer",
    "feature",
    "register",
    "registered",
]

Features = Mapping[str, float]
"""One observation: feature name → value (a missing or non-finite value is not observed)."""


def feature(x: Features, name: str) -> float | None:
    """``x[name]`` as a float when present and finite, else None.

    >>> feature({"a": 1, "b": float("nan")}, "a"), feature({"b": float("nan")}, "b")
    (1.0, None)
    """
    v = x.get(name)
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


class Model:
    """Base of every online model: hyperparameters are the constructor's arguments."""

    kind: Literal["predictor", "scorer", "forecaster"]

    @property
    def params(self) -> dict[str, Any]:
        """The constructor arguments, read back from the attributes of the same names."""
        sig = inspect.signature(type(self).__init__)
        names = [p for p in sig.parameters if p != "self"]
        return {name: copy.deepcopy(getattr(self, name)) for name in names}

    def clone(self, **changes: Any) -> Any:
        """A fresh, untrained model with the same hyperparameters (and ``changes``)."""
        params = self.params | changes
        return type(self)(**params)

    def learn_one(self, x: Features, y: float | None = None) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{type(self).__name__}({args})"


class Predictor(Model):
    """``learn_one(x, y)``: learn that ``x`` gave ``y``; ``predict_one(x)``: the expected ``y``."""

    kind = "predictor"

    def predict_one(self, x: Features) -> float:
        raise NotImplementedError


class Forecaster(Model):
    """``learn_one(x)``: the newest observation; ``predict_one(x)``: the target's next value."""

    kind = "forecaster"

    def predict_one(self, x: Features) -> float:
        raise NotImplementedError


class Scorer(Model):
    """``learn_one(x)``: one more normal-or-not observation; ``score_one(x)``: 0 (usual) … 1."""

    kind = "scorer"

    def score_one(self, x: Features) -> float:
        raise NotImplementedError


@dataclass(frozen=True)
class Registration:
    """A registered model class, how to build an example, and a stream to exercise it with.

    ``stream(seed)`` yields ``(x, y)`` pairs (``y`` None for scorers and forecasters): the
    contract suite learns from them and compares answers.
    """

    cls: type[Model]
    example: Callable[[], Model]
    stream: Callable[[int], Iterable[tuple[dict[str, float], float | None]]]


_REGISTRY: dict[str, Registration] = {}
M = TypeVar("M", bound=type[Model])


def register(
    example: Callable[[], Model],
    stream: Callable[[int], Iterable[tuple[dict[str, float], float | None]]],
) -> Callable[[M], M]:
    """Class decorator: add the class to the registry the contract suite runs over."""

    def deco(cls: M) -> M:
        _REGISTRY[cls.__name__] = Registration(cls, example, stream)
        return cls

    return deco


def registered() -> dict[str, Registration]:
    """Every registered model class by name (importing `perfloop.models` registers them all)."""
    return dict(_REGISTRY)
