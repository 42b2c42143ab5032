"""The contract suite: checks every registered online model must pass (`perfloop.models.base`).

`yield_checks` gives the checks for one registration; each takes the `Registration` and raises
`AssertionError` naming what broke. The tests run every check over every registered model
(tests/unit/models/test_contract.py), so a new model is held to the contract by registering it.

* ``params`` — hyperparameters are the constructor's arguments, stored under their names, and
  learning does not change them;
* ``clone`` — a clone answers as a fresh model, whatever the original learned;
* ``pickle`` — a model pickled half-way through its stream answers the rest as the original;
* ``seed`` — two models built alike answer alike (randomness comes from the seed only);
* ``pure answers`` — ``predict_one`` / ``score_one`` change nothing;
* ``missing features`` — an empty ``x``, a missing or a NaN feature gives an answer, not an
  error; a scorer's answer is in [0, 1]; nothing answers NaN;
* ``no I/O`` — learning and answering open no file and no socket.

>>> from perfloop.models import registered
>>> reg = registered()["StepTimeForecaster"]
>>> for check in yield_checks(reg):
...     check(reg)
"""

from __future__ import annotations

import builtins
import contextlib
import inspect
import math
import os
import pickle
import socket
from collections.abc import Callable, Iterator
from typing import Any

from perfloop.models.base import Features, Model, Registration

__all__ = ["answer", "yield_checks"]

Check = Callable[[Registration], None]


def answer(model: Model, x: Features) -> float:
    """The model's answer for ``x``: ``score_one`` for a scorer, ``predict_one`` otherwise."""
    if model.kind == "scorer":
        return float(model.score_one(x))  # type: ignore[attr-defined]
    return float(model.predict_one(x))  # type: ignore[attr-defined]


def _run(model: Model, items: list[tuple[dict[str, float], float | None]]) -> list[float]:
    out = []
    for x, y in items:
        out.append(answer(model, x))
        model.learn_one(x, y)
    return out


def _same(a: list[float], b: list[float], what: str) -> None:
    assert len(a) == len(b), f"{what}: {len(a)} answers against {len(b)}"
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        if not (u == v or (math.isnan(u) and math.isnan(v))):
            raise AssertionError(f"{what}: answer {i} differs: {u!r} against {v!r}")


def _items(reg: Registration, seed: int = 0) -> list[tuple[dict[str, float], float | None]]:
    items = list(reg.stream(seed))
    assert len(items) >= 20, f"{reg.cls.__name__}: its example stream has fewer than 20 items"
    return items


def check_params(reg: Registration) -> None:
    model = reg.example()
    sig_names = set(model.params)
    ctor = {p for p in inspect.signature(reg.cls.__init__).parameters if p != "self"}
    assert sig_names == ctor, f"params {sorted(sig_names)} are not the constructor's {sorted(ctor)}"
    before = pickle.dumps(model.params)
    _run(model, _items(reg))
    assert pickle.dumps(model.params) == before, "learning changed a hyperparameter"


def check_clone(reg: Registration) -> None:
    items = _items(reg)
    trained = reg.example()
    _run(trained, items)
    clone = trained.clone()
    assert type(clone) is type(trained), "clone is of another class"
    assert pickle.dumps(clone.params) == pickle.dumps(trained.params), "clone's params differ"
    _same(_run(clone, items), _run(reg.example(), items), "a clone against a fresh model")


def check_pickle(reg: Registration) -> None:
    items = _items(reg)
    half = len(items) // 2
    model = reg.example()
    _run(model, items[:half])
    copy = pickle.loads(pickle.dumps(model))
    _same(_run(copy, items[half:]), _run(model, items[half:]), "after a pickle round trip")


def check_seed(reg: Registration) -> None:
    items = _items(reg, seed=1)
    _same(_run(reg.example(), items), _run(reg.example(), items), "two models built alike")


def check_pure_answers(reg: Registration) -> None:
    items = _items(reg)
    model = reg.example()
    _run(model, items[: len(items) // 2])
    state = pickle.dumps(model)
    for x, _ in items[len(items) // 2 :]:
        answer(model, x)
        answer(model, {})
    assert pickle.dumps(model) == state, "answering changed the model"


def check_missing_features(reg: Registration) -> None:
    items = _items(reg)
    fresh = reg.example()
    model = reg.example()
    _run(model, items)
    x0 = items[-1][0]
    probes: list[dict[str, float]] = [{}]
    for name in x0:
        probes.append({k: v for k, v in x0.items() if k != name})
        probes.append({**x0, name: math.nan})
    for m in (fresh, model):
        for x in probes:
            a = answer(m, x)
            assert not math.isnan(a), f"answer NaN for features {sorted(x)}"
            if m.kind == "scorer":
                assert 0.0 <= a <= 1.0, f"score {a} outside [0, 1]"
        m.learn_one({}, None if m.kind != "predictor" else items[0][1])


@contextlib.contextmanager
def _no_io() -> Iterator[list[str]]:
    calls: list[str] = []

    def deny(name: str) -> Callable[..., Any]:
        def f(*a: Any, **k: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"a model called {name}")

        return f

    saved = (builtins.open, os.open, socket.socket)
    builtins.open, os.open = deny("open"), deny("os.open")
    socket.socket = deny("socket.socket")  # type: ignore[assignment,misc]
    try:
        yield calls
    finally:
        builtins.open, os.open, socket.socket = saved  # type: ignore[misc]


def check_no_io(reg: Registration) -> None:
    items = _items(reg)
    model = reg.example()
    with _no_io() as calls:
        _run(model, items)
    assert not calls, f"I/O while learning or answering: {calls}"


def yield_checks(reg: Registration) -> Iterator[Check]:
    """The contract checks for one registered model."""
    del reg  # every check applies to every kind of model
    yield check_params
    yield check_clone
    yield check_pickle
    yield check_seed
    yield check_pure_answers
    yield check_missing_features
    yield check_no_io
