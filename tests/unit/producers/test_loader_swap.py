"""Changing DataLoader settings mid-epoch: real torch loaders with real worker processes.

Every scenario compares against an unchanged single-process run with the same seed (the order of
sample indices does not depend on how batches are loaded): the epoch in which the change happens
and the epoch after it must give the same indices in the same order.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from perfloop.exceptions import ConfigError
from perfloop.producers._loader_swap import loader_settings, rebuild_iterator

N, BATCH = 40, 4  # 10 batches an epoch
SEED = 7

pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")


class Indices(Dataset[torch.Tensor]):
    """Sample ``i`` is ``tensor(i)``; sample ``fail_at`` raises when loaded; the samples in
    ``slow`` take ``delay_s`` each to load."""

    def __init__(
        self,
        n: int = N,
        fail_at: int | None = None,
        slow: frozenset[int] = frozenset(),
        delay_s: float = 0.0,
    ) -> None:
        self.n = n
        self.fail_at = fail_at
        self.slow = slow
        self.delay_s = delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.fail_at:
            raise ValueError(f"bad sample {i}")
        if i in self.slow:
            time.sleep(self.delay_s)
        return torch.tensor(i)


class Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(N))


def make_loader(workers: int = 0, *, seeded: bool = True, **kw: Any) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(SEED) if seeded else None
    kw.setdefault("shuffle", True)
    return DataLoader(
        kw.pop("dataset", Indices()),
        batch_size=BATCH,
        num_workers=workers,
        generator=generator,
        **kw,
    )


def take(it: Iterator[torch.Tensor], n: int | None = None) -> list[list[int]]:
    out = []
    for batch in it:
        out.append(batch.tolist())
        if n is not None and len(out) == n:
            break
    return out


def unchanged(epochs: int = 2, workers: int = 0, **kw: Any) -> list[list[list[int]]]:
    """The epochs of a loader left alone (``workers`` matters only with persistent workers:
    their iterator draws its seed once, not once an epoch)."""
    loader = make_loader(workers, **kw)
    return [take(iter(loader)) for _ in range(epochs)]


def live_workers(it: Any) -> list[Any]:
    return [w for w in getattr(it, "_workers", ()) if w.is_alive()]


def inner(it: Any) -> Any:
    """The iterator producing ``it``'s batches now."""
    return getattr(it.__dict__.get("_next_data"), "inner", it)


SCENARIOS = {
    "0→2 workers": (0, [{"num_workers": 2}], (2, 2, False)),
    "2→0 workers": (2, [{"num_workers": 0}], (0, None, False)),
    "2→1 workers": (2, [{"num_workers": 1}], (1, 2, False)),
    "0→2→1 workers": (0, [{"num_workers": 2}, {"num_workers": 1}], (1, 2, False)),
    # Priming 2 workers × 4 exhausts the sampler inside the rebuild, so the shuffle's last
    # draw from the loader's generator happens there, and must stay drawn.
    "prefetch 2→4": (2, [{"prefetch_factor": 4}], (2, 4, False)),
    "pin_memory on": (1, [{"pin_memory": True}], (1, 2, True)),
}


@pytest.mark.parametrize("start, changes, after", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_change_mid_epoch_keeps_the_batch_sequence(
    start: int, changes: list[dict[str, Any]], after: tuple[Any, ...]
) -> None:
    expected = unchanged()
    loader = make_loader(start)
    it = iter(loader)
    seen = take(it, 3)
    for change in changes:
        before = loader_settings(loader)
        old = inner(it)
        old_workers = list(getattr(old, "_workers", ()))
        previous = rebuild_iterator(it, loader, **change)
        assert previous == {k: v for k, v in before.items() if loader_settings(loader)[k] != v}
        assert set(change) <= set(previous)
        assert not any(w.is_alive() for w in old_workers), "the old workers were not shut down"
        assert inner(it) is not old
        seen += take(it, 3)
    seen += take(it)

    assert seen == expected[0]
    assert len(seen) == len(loader) == N // BATCH
    workers, prefetch, pin = after
    assert loader_settings(loader) == {
        "num_workers": workers,
        "prefetch_factor": prefetch,
        "pin_memory": pin,
    }
    assert inner(it)._num_workers == workers == it._num_workers
    assert not live_workers(inner(it)), "the epoch's workers outlived it"

    nxt = iter(loader)
    assert type(nxt).__name__ == (
        "_MultiProcessingDataLoaderIter" if workers else "_SingleProcessDataLoaderIter"
    )
    assert nxt._num_workers == workers
    assert getattr(nxt, "_prefetch_factor", None) == prefetch
    assert take(nxt) == expected[1]


def test_global_rng_is_unchanged_by_a_rebuild() -> None:
    def run(change: bool) -> tuple[list[list[int]], torch.Tensor, list[list[int]], torch.Tensor]:
        torch.manual_seed(SEED)
        loader = make_loader(0, seeded=False)  # shuffles and seeds from the global RNG
        it = iter(loader)
        seen = take(it, 4)
        if change:
            rebuild_iterator(it, loader, num_workers=2)
        dropout = torch.rand(5)  # the training's own draws right after the change
        seen += take(it)
        return seen, dropout, take(iter(loader)), torch.rand(5)

    base, changed = run(False), run(True)
    assert changed[0] == base[0]
    assert torch.equal(changed[1], base[1])
    assert changed[2] == base[2]  # the next epoch's shuffle draws its seed from the global RNG
    assert torch.equal(changed[3], base[3])


def test_persistent_workers_next_epoch_reuses_the_new_workers() -> None:
    expected = unchanged(3, 2, persistent_workers=True)
    loader = make_loader(2, persistent_workers=True)
    it: Any = iter(loader)
    seen = take(it, 3)
    old_workers = list(it._workers)
    assert rebuild_iterator(it, loader, num_workers=1) == {"num_workers": 2}
    new = inner(it)
    assert loader._iterator is new
    assert not any(w.is_alive() for w in old_workers)
    seen += take(it)
    assert seen == expected[0]
    assert len(live_workers(new)) == 1, "persistent workers stay up between epochs"

    second = iter(loader)
    assert second is new
    assert second._num_workers == 1 and len(live_workers(second)) == 1
    assert take(second) == expected[1]

    # A change in the next epoch goes through the same path, from the reset iterator.
    third = iter(loader)
    seen = take(third, 5)
    rebuild_iterator(third, loader, num_workers=2)
    seen += take(third)
    assert seen == expected[2]
    assert loader._iterator is inner(third) and len(live_workers(inner(third))) == 2
    inner(third)._shutdown_workers()


def test_a_failing_batch_in_flight_still_fails_at_its_place() -> None:
    def run(workers: int, change: bool) -> list[Any]:
        loader = make_loader(workers, dataset=Indices(fail_at=9), shuffle=False)
        it = iter(loader)
        out: list[Any] = [next(it).tolist()]
        if change:  # batch 2 (samples 8..11) is in flight with 2 workers, prefetch 2
            rebuild_iterator(it, loader, num_workers=1)
        while True:
            try:
                out.append(next(it).tolist())
            except StopIteration:
                return out
            except ValueError as e:
                out.append("bad sample 9" if "bad sample 9" in str(e) else str(e))

    expected = run(0, change=False)
    assert expected[2] == "bad sample 9" and len(expected) == N // BATCH
    assert run(2, change=True) == expected


def test_no_change_rebuilds_nothing() -> None:
    loader = make_loader(0)
    it = iter(loader)
    take(it, 2)
    assert rebuild_iterator(it, loader, num_workers=0, pin_memory=False) == {}
    assert "_next_data" not in it.__dict__


def test_iterable_dataset_is_refused_and_nothing_changes() -> None:
    loader = make_loader(0, dataset=Stream(), shuffle=False)
    it = iter(loader)
    seen = take(it, 2)
    with pytest.raises(ConfigError, match=r"IterableDataset \(Stream\).*resharded mid-epoch"):
        rebuild_iterator(it, loader, num_workers=2)
    assert loader_settings(loader) == {
        "num_workers": 0,
        "prefetch_factor": None,
        "pin_memory": False,
    }
    seen += take(it)
    assert [i for batch in seen for i in batch] == list(range(N))


INVALID = {
    "negative workers": (0, {"num_workers": -1}, r"num_workers=-1: use a whole number ≥ 0"),
    "bool workers": (0, {"num_workers": True}, r"num_workers=True"),
    "prefetch 0": (2, {"prefetch_factor": 0}, r"prefetch_factor=0: use a whole number ≥ 1"),
    "prefetch without workers": (
        0,
        {"prefetch_factor": 3},
        r"prefetch_factor=3 needs num_workers ≥ 1",
    ),
    "prefetch while dropping workers": (
        2,
        {"num_workers": 0, "prefetch_factor": 2},
        r"prefetch_factor=2 needs num_workers ≥ 1",
    ),
    "pin_memory not a bool": (0, {"pin_memory": "yes"}, r"pin_memory='yes': use True or False"),
}


@pytest.mark.parametrize("start, change, message", INVALID.values(), ids=INVALID.keys())
def test_invalid_values_are_refused_and_nothing_changes(
    start: int, change: dict[str, Any], message: str
) -> None:
    expected = unchanged(1)[0]
    loader = make_loader(start)
    before = loader_settings(loader)
    it = iter(loader)
    seen = take(it, 3)
    with pytest.raises(ConfigError, match=message):
        rebuild_iterator(it, loader, **change)
    assert loader_settings(loader) == before
    assert "_next_data" not in it.__dict__
    seen += take(it)
    assert seen == expected


def test_settings_torch_forbids_with_zero_workers_are_refused() -> None:
    loader = make_loader(1, persistent_workers=True)
    it: Any = iter(loader)
    with pytest.raises(ConfigError, match=r"persistent_workers=True: torch needs num_workers ≥ 1"):
        rebuild_iterator(it, loader, num_workers=0)
    assert loader_settings(loader)["num_workers"] == 1
    assert take(it) == unchanged(1)[0]
    it._shutdown_workers()

    loader = make_loader(1, timeout=30.0)
    it = iter(loader)
    with pytest.raises(ConfigError, match=r"timeout=30.0"):
        rebuild_iterator(it, loader, num_workers=0)
    assert take(it) == unchanged(1)[0]


def test_missing_torch_internals_are_refused_and_nothing_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loader = make_loader(0)
    it = iter(loader)
    seen = take(it, 2)
    with monkeypatch.context() as m:
        m.delattr(DataLoader, "_get_iterator")
        with pytest.raises(ConfigError, match=r"lacks DataLoader\._get_iterator"):
            rebuild_iterator(it, loader, num_workers=2)
    assert loader_settings(loader)["num_workers"] == 0
    seen += take(it)
    assert seen == unchanged(1)[0]


def test_an_iterator_of_another_loader_is_refused() -> None:
    loader, other = make_loader(0), make_loader(0)
    with pytest.raises(ConfigError, match=r"not the DataLoader iterator"):
        rebuild_iterator(iter([1, 2]), loader, num_workers=1)
    with pytest.raises(ConfigError, match=r"not created by this DataLoader"):
        rebuild_iterator(iter(other), loader, num_workers=1)
    assert loader_settings(loader)["num_workers"] == 0


def test_workers_that_cannot_start_leave_everything_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.utils.data import dataloader

    def cannot_start(self: Any, loader: Any) -> None:
        self._shutdown = True  # what torch's __del__ reads
        raise OSError("Too many open files")

    expected = unchanged(1)[0]
    loader = make_loader(2)
    it = iter(loader)
    seen = take(it, 3)
    with monkeypatch.context() as m:
        m.setattr(dataloader._MultiProcessingDataLoaderIter, "__init__", cannot_start)
        with pytest.raises(
            ConfigError,
            match=r"cannot start the DataLoader iterator with num_workers=1.*Too many open files"
            r".*kept num_workers=2",
        ):
            rebuild_iterator(it, loader, num_workers=1)
    assert loader_settings(loader) == {"num_workers": 2, "prefetch_factor": 2, "pin_memory": False}
    assert len(live_workers(it)) == 2, "the old workers must go on loading"
    seen += take(it)  # the batches received before the failure come first, then the old workers'
    assert seen == expected
    assert len(seen) == N // BATCH


def _change_failing_at_the_second_receive(it: Any, loader: DataLoader[Any]) -> None:
    """Change ``it`` to 1 worker while its drain's first receive gets a batch and its second
    fails as a timed-out worker would; the change must be refused as a `ConfigError`."""
    real_get = it._get_data
    calls = 0

    def flaky_get() -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("DataLoader timed out after 1 seconds")
        return real_get()

    it._get_data = flaky_get
    try:
        with pytest.raises(ConfigError, match=r"receiving the batches in flight failed.*timed out"):
            rebuild_iterator(it, loader, num_workers=1)
    finally:
        del it._get_data


def test_a_failure_while_draining_leaves_everything_as_it_was() -> None:
    expected = unchanged(1)[0]
    loader = make_loader(2)
    it: Any = iter(loader)
    seen = take(it, 3)
    _change_failing_at_the_second_receive(it, loader)
    assert loader_settings(loader)["num_workers"] == 2
    assert len(live_workers(it)) == 2
    seen += take(it, 3)  # the batch received before the failure, then the refilled workers'

    # The same iterator can still be changed afterwards.
    assert rebuild_iterator(it, loader, num_workers=1) == {"num_workers": 2}
    assert not live_workers(it) and len(live_workers(inner(it))) == 1
    seen += take(it)
    assert seen == expected


def test_a_failure_while_draining_after_a_batch_came_ahead_of_its_turn_keeps_the_depth() -> None:
    """Batch 3 (worker 1) loads slowly, so the drain first receives a later batch of worker 0,
    which torch holds until batch 3 arrives; then the receive fails. Refilling the old workers must
    count the held batch: torch sends an index when it delivers it, and one index too many makes
    torch raise "Number of outstanding tasks exceeded maximum allowed tasks" batches later."""
    expected = unchanged(1)[0]
    loader = make_loader(2, dataset=Indices(slow=frozenset(expected[3]), delay_s=0.4))
    it: Any = iter(loader)
    seen = take(it, 3)
    _change_failing_at_the_second_receive(it, loader)
    held = [idx for idx, info in it._task_info.items() if len(info) == 2]
    assert held and min(held) > 3, "worker 0's batches must have come first and be held"
    depth = it._prefetch_factor * it._num_workers
    assert it._tasks_outstanding + len(held) == depth
    seen += take(it)  # every later batch, each refill within torch's limit
    assert seen == expected
