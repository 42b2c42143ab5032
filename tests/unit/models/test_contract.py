"""The contract suite runs over every registered online model (models/checks.py)."""

from __future__ import annotations

import math

import pytest

from perfloop.models import Predictor, register, registered
from perfloop.models.base import Features, Registration
from perfloop.models.checks import yield_checks

CASES = [
    pytest.param(reg, check, id=f"{name}-{check.__name__}")
    for name, reg in sorted(registered().items())
    for check in yield_checks(reg)
]


def test_every_online_model_is_registered() -> None:
    names = set(registered())
    assert {
        "StepTimeForecaster",
        "RegimeDetector",
        "PhaseTransitionForecaster",
        "TimeToOOM",
        "WindowAnomaly",
        "CrossRunPredictor",
        "GradientNoiseScale",
    } <= names


@pytest.mark.parametrize(("reg", "check"), CASES)
def test_contract(reg: Registration, check: object) -> None:
    check(reg)  # type: ignore[operator]


# -- the suite catches what it is meant to catch -----------------------------------------------
def _stream(seed: int):  # type: ignore[no-untyped-def]
    return [({"a": float(i + seed)}, float(i)) for i in range(30)]


class _SneakyParam(Predictor):
    """Changes a hyperparameter while learning."""

    def __init__(self, rate: float = 0.1) -> None:
        self.rate = rate

    def learn_one(self, x: Features, y: float | None = None) -> None:
        self.rate *= 0.5

    def predict_one(self, x: Features) -> float:
        return self.rate


class _Unseeded(Predictor):
    """Draws randomness from outside its seed."""

    def __init__(self) -> None:
        self._last = 0.0

    def learn_one(self, x: Features, y: float | None = None) -> None:
        import random

        self._last = random.random()

    def predict_one(self, x: Features) -> float:
        return self._last


class _MutatingAnswer(Predictor):
    def __init__(self) -> None:
        self._n = 0

    def learn_one(self, x: Features, y: float | None = None) -> None:
        pass

    def predict_one(self, x: Features) -> float:
        self._n += 1
        return float(self._n)


class _NeedsFeature(Predictor):
    def __init__(self) -> None:
        self._w = 1.0

    def learn_one(self, x: Features, y: float | None = None) -> None:
        pass

    def predict_one(self, x: Features) -> float:
        return self._w * x["a"]


class _Writes(Predictor):
    def __init__(self) -> None:
        pass

    def learn_one(self, x: Features, y: float | None = None) -> None:
        with open("/dev/null", "w") as f:
            f.write("x")

    def predict_one(self, x: Features) -> float:
        return 0.0


class _NanAnswer(Predictor):
    def __init__(self) -> None:
        pass

    def learn_one(self, x: Features, y: float | None = None) -> None:
        pass

    def predict_one(self, x: Features) -> float:
        return math.nan


@pytest.mark.parametrize(
    ("cls", "check_name", "message"),
    [
        (_SneakyParam, "check_params", "changed a hyperparameter"),
        (_Unseeded, "check_seed", "differs"),
        (_MutatingAnswer, "check_pure_answers", "changed the model"),
        (_NeedsFeature, "check_missing_features", "'a'"),
        (_Writes, "check_no_io", "a model called open"),
        (_NanAnswer, "check_missing_features", "NaN"),
    ],
)
def test_the_suite_rejects_a_model_that_breaks_the_contract(
    cls: type[Predictor], check_name: str, message: str
) -> None:
    reg = Registration(cls, cls, _stream)
    check = next(c for c in yield_checks(reg) if c.__name__ == check_name)
    with pytest.raises((AssertionError, KeyError), match=message):
        check(reg)


def test_registration_is_by_class_name() -> None:
    @register(example=lambda: _Local(), stream=_stream)
    class _Local(Predictor):
        def __init__(self) -> None:
            self._y = 0.0

        def learn_one(self, x: Features, y: float | None = None) -> None:
            self._y = y or 0.0

        def predict_one(self, x: Features) -> float:
            return self._y

    try:
        assert registered()["_Local"].cls is _Local
    finally:
        from perfloop.models import base

        base._REGISTRY.pop("_Local", None)
