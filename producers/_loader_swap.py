"""Changing a DataLoader's ``num_workers`` / ``prefetch_factor`` / ``pin_memory`` mid-epoch.

Private helper of `perfloop.producers.knobs`: the job agent calls `rebuild_iterator` on the
training thread at a step boundary while the script's unmodified ``for batch in loader:`` keeps
holding the iterator it got from ``iter(loader)``. Contract: the loop goes on receiving exactly
the batches it would have received (the same sample indices, in the same order, the same epoch
length); only how they are produced changes. The training's random streams (torch's global
RNG, ``loader.generator``) are left as they were, so later epochs shuffle as they would have.

How (torch's own `torch.utils.data.dataloader` internals, checked before anything is changed):

1. *Drain* the effective iterator (the one producing batches now): from a multi-process one,
   take its remaining index iterator away, so receiving a batch sends no new indices to its
   workers (``_process_data`` → ``_try_put_index`` stops quietly on an exhausted
   ``_sampler_iter``), then receive every batch in flight, in order, into a buffer. A batch
   whose loading raised is buffered as its error and raised at its place in the sequence.
   A single-process iterator has nothing in flight.
2. *Build* a new iterator with the new settings (``loader._get_iterator`` semantics) whose index
   stream is the old one's remaining index iterator. Building one draws its workers' base seed
   from ``loader.generator`` or, without one, from torch's global RNG; here it is drawn from a
   private generator seeded from the old iterator's seed instead, so neither stream is touched
   (and the new workers' seeds differ from the next epoch's). The RNG states are deliberately
   not saved and restored around the construction: priming the new workers runs the sampler,
   whose own draws (a `RandomSampler` draws its seed when it starts and one more permutation
   when it runs out) belong to the training's stream and must stay drawn.
3. *Retire* the old workers (``_shutdown_workers``) once the new iterator is up, and *redirect*
   the script's iterator: its ``_next_data`` (what ``__next__`` calls) becomes an instance
   attribute that returns the buffered batches, then the new iterator's. A second change
   rebuilds the inner iterator and re-points the redirect. With ``persistent_workers=True``
   the loader's cached iterator becomes the new one, so the next epoch reuses its workers;
   otherwise the next ``iter(loader)`` simply builds one with the new settings.

A failure after the drain began (a worker died, the new workers did not start) puts everything
back: the old iterator gets its remaining indices again and is refilled, the buffered batches
still come first, and the loader keeps its old settings; the caller gets a `ConfigError`.

Only map-style datasets can be changed mid-epoch: an `IterableDataset` lives as one replica per
worker, each holding its own position/shard, which cannot be resharded mid-epoch.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from perfloop.exceptions import ConfigError

__all__ = ["loader_settings", "rebuild_iterator"]

SETTINGS = ("num_workers", "prefetch_factor", "pin_memory")

# torch internals this module relies on, checked before anything is changed.
_LOADER_ATTRS = ("_get_iterator", "_index_sampler", "_auto_collation", "_dataset_kind")
_ITER_ATTRS = ("_sampler_iter", "_index_sampler", "_dataset", "_base_seed", "_num_workers")
_MP_CLASS_ATTRS = ("_next_data", "_try_put_index", "_shutdown_workers")
_MP_ATTRS = (
    "_task_info",
    "_tasks_outstanding",
    "_send_idx",
    "_shutdown",
    "_prefetch_factor",
    "_workers",
)
_GOLDEN = 0x9E3779B97F4A7C15  # decorrelates the new workers' seed from the old one's


class _Failed:
    """A buffered batch whose loading raised: the error is raised at the batch's place."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Redirect:
    """Installed as ``it._next_data``: buffered batches first, then ``inner``'s batches."""

    __slots__ = ("buffer", "inner")

    def __init__(self, buffer: deque[Any], inner: Any) -> None:
        self.buffer = buffer
        self.inner = inner

    def __call__(self) -> Any:
        if self.buffer:
            item = self.buffer.popleft()
            if isinstance(item, _Failed):
                raise item.error
            return item
        # Through the class: after a rolled-back first change, ``inner`` is the script's own
        # iterator, whose instance attribute is this redirect.
        return type(self.inner)._next_data(self.inner)


class _Remaining:
    """An index sampler whose ``iter()`` is the old iterator's remaining index stream."""

    __slots__ = ("_it",)

    def __init__(self, it: Any) -> None:
        self._it = it

    def __iter__(self) -> Any:
        return self._it


def loader_settings(loader: Any) -> dict[str, object]:
    """``{'num_workers': int, 'prefetch_factor': int | None, 'pin_memory': bool}`` of ``loader``.

    >>> from torch.utils.data import DataLoader
    >>> loader_settings(DataLoader(list(range(4)), batch_size=2))
    {'num_workers': 0, 'prefetch_factor': None, 'pin_memory': False}
    """
    missing = [name for name in SETTINGS if not hasattr(loader, name)]
    if missing:
        raise ConfigError(
            f"{type(loader).__name__} is not a torch DataLoader: it has no {', '.join(missing)}"
        )
    return {
        "num_workers": int(loader.num_workers),
        "prefetch_factor": loader.prefetch_factor,
        "pin_memory": bool(loader.pin_memory),
    }


def rebuild_iterator(
    it: Any,
    loader: Any,
    *,
    num_workers: int | None = None,
    prefetch_factor: int | None = None,
    pin_memory: bool | None = None,
) -> dict[str, object]:
    """Apply the given settings to ``loader`` and to its live iterator ``it``, mid-epoch.

    ``it`` is the object the script's for-loop holds (what ``iter(loader)`` returned); it stays
    that object and goes on yielding exactly the batches, in the order, it would have yielded;
    the rest of the epoch is loaded with the new settings, and so is every later epoch. A
    setting left as None keeps its value, except that ``prefetch_factor`` follows torch: 2 when
    workers are turned on without one, None with ``num_workers=0``. Returns the previous values
    of the settings that changed (``{}`` when none did, and then nothing is rebuilt).

    Runs on the thread that iterates ``it``, between two ``next(it)`` calls. Raises
    `ConfigError` (one line naming the bad value and the valid ones) and changes nothing when
    the change cannot be made: an invalid value, an `IterableDataset`, an iterator that is not
    ``loader``'s, torch internals this torch lacks, or workers that fail to start.

    >>> from torch.utils.data import DataLoader
    >>> loader = DataLoader(list(range(6)), batch_size=2)
    >>> it = iter(loader)
    >>> next(it).tolist()
    [0, 1]
    >>> rebuild_iterator(it, loader, prefetch_factor=4)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    perfloop.exceptions.ConfigError: prefetch_factor=4 needs num_workers ≥ 1 (this loader ...
    >>> [batch.tolist() for batch in it]
    [[2, 3], [4, 5]]
    """
    dl = _torch_dataloader()
    _check_internals(dl, it, loader)
    target = _resolve(loader, num_workers, prefetch_factor, pin_memory)
    current = loader_settings(loader)
    previous = {k: current[k] for k in SETTINGS if current[k] != target[k]}
    if not previous:
        return {}

    redirect = it.__dict__.get("_next_data")
    if not isinstance(redirect, _Redirect):
        redirect = None
    eff = redirect.inner if redirect is not None else it
    multi = isinstance(eff, dl._MultiProcessingDataLoaderIter)
    remaining = eff._sampler_iter
    pending: list[Any] = []

    def roll_back() -> None:
        """Give ``eff`` its indices back and refill it; buffered batches still come first."""
        eff._sampler_iter = remaining
        if multi:
            _refill(eff)
        if pending:
            _install(it, redirect, pending, eff)

    if multi:
        eff._sampler_iter = iter(())
    try:
        if multi:
            _drain(eff, pending)
    except Exception as e:
        roll_back()
        raise ConfigError(
            f"cannot change the DataLoader to {_describe(target)}: receiving the batches in flight "
            f"failed ({type(e).__name__}: {_one_line(e)}); kept {_describe(current)}"
        ) from e
    except BaseException:
        roll_back()
        raise

    try:
        new = _build(loader, eff, remaining, target)
    except Exception as e:
        roll_back()
        raise ConfigError(
            f"cannot start the DataLoader iterator with {_describe(target)} "
            f"({type(e).__name__}: {_one_line(e)}); kept {_describe(current)}"
        ) from e
    except BaseException:
        roll_back()
        raise

    if multi:
        eff._shutdown_workers()
    eff._sampler_iter = iter(())  # exhausted, never None: ``__next__`` must not ``_reset`` it
    it._sampler_iter = eff._sampler_iter
    _install(it, redirect, pending, new)
    it._num_workers = new._num_workers  # what the data-loader hook reports
    cached = loader.__dict__.get("_iterator")
    if cached is not None and (cached is it or cached is eff):
        loader._iterator = new  # persistent workers: the next epoch reuses the new ones
    return previous


def _torch_dataloader() -> Any:
    try:
        from torch.utils.data import dataloader
    except ImportError as e:  # pragma: no cover - torch is what the caller iterates
        raise ConfigError(
            f"cannot change DataLoader settings: torch is not importable ({e})"
        ) from e
    return dataloader


def _check_internals(dl: Any, it: Any, loader: Any) -> None:
    """Raise `ConfigError` unless ``it``/``loader`` are torch's, with the internals used here."""
    missing = [
        f"torch.utils.data.dataloader.{name}"
        for name in ("_BaseDataLoaderIter", "_MultiProcessingDataLoaderIter", "_DatasetKind")
        if not hasattr(dl, name)
    ]
    if not missing:
        missing = [
            f"_MultiProcessingDataLoaderIter.{a}"
            for a in _MP_CLASS_ATTRS
            if not hasattr(dl._MultiProcessingDataLoaderIter, a)
        ]
    if not missing:
        if not isinstance(loader, getattr(dl, "DataLoader", ())):
            raise ConfigError(f"loader is a {type(loader).__name__}, not a torch DataLoader")
        missing = [f"DataLoader.{a}" for a in _LOADER_ATTRS if not hasattr(loader, a)]
    if missing:
        raise _lacks(missing)
    if not isinstance(it, dl._BaseDataLoaderIter):
        raise ConfigError(
            f"the iterator is a {type(it).__name__}, not the DataLoader iterator iter(loader) "
            "returned"
        )
    redirect = it.__dict__.get("_next_data")
    eff = redirect.inner if isinstance(redirect, _Redirect) else it
    wanted: tuple[str, ...] = _ITER_ATTRS
    if isinstance(eff, dl._MultiProcessingDataLoaderIter):
        wanted = _ITER_ATTRS + _MP_ATTRS
    missing = [f"{type(eff).__name__}.{a}" for a in wanted if not hasattr(eff, a)]
    if missing:
        raise _lacks(missing)
    if eff._dataset is not loader.dataset or eff._index_sampler is not loader._index_sampler:
        raise ConfigError("the iterator was not created by this DataLoader (iter(loader))")
    if loader._dataset_kind == dl._DatasetKind.Iterable:
        raise ConfigError(
            f"cannot change DataLoader settings mid-epoch for an IterableDataset "
            f"({type(loader.dataset).__name__}): each worker holds its own replica/shard, which "
            "cannot be resharded mid-epoch; only map-style datasets can be changed"
        )


def _lacks(missing: list[str]) -> ConfigError:
    import torch

    return ConfigError(
        f"cannot change DataLoader settings mid-epoch: torch {torch.__version__} lacks "
        f"{', '.join(missing)}"
    )


def _resolve(
    loader: Any, num_workers: Any, prefetch_factor: Any, pin_memory: Any
) -> dict[str, Any]:
    """The settings after the change, validated as ``DataLoader.__init__`` and its iterators do."""
    if num_workers is not None and (
        isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0
    ):
        raise ConfigError(
            f"num_workers={num_workers!r}: use a whole number ≥ 0 (0 loads in this process)"
        )
    if prefetch_factor is not None and (
        isinstance(prefetch_factor, bool)
        or not isinstance(prefetch_factor, int)
        or prefetch_factor < 1
    ):
        raise ConfigError(
            f"prefetch_factor={prefetch_factor!r}: use a whole number ≥ 1 (batches each worker "
            "loads ahead)"
        )
    if pin_memory is not None and not isinstance(pin_memory, bool):
        raise ConfigError(f"pin_memory={pin_memory!r}: use True or False")
    workers = int(loader.num_workers) if num_workers is None else num_workers
    if workers == 0:
        if prefetch_factor is not None:
            raise ConfigError(
                f"prefetch_factor={prefetch_factor!r} needs num_workers ≥ 1 (this loader would "
                "have num_workers=0): leave prefetch_factor unset or also set num_workers"
            )
        if loader.persistent_workers:
            raise ConfigError(
                "num_workers=0 with persistent_workers=True: torch needs num_workers ≥ 1"
            )
        if loader.timeout:
            raise ConfigError(
                f"num_workers=0 with timeout={loader.timeout!r}: torch's in-process loading "
                "needs timeout=0, so use num_workers ≥ 1"
            )
        prefetch = None
    elif prefetch_factor is not None:
        prefetch = prefetch_factor
    else:
        prefetch = 2 if loader.prefetch_factor is None else loader.prefetch_factor
    return {
        "num_workers": workers,
        "prefetch_factor": prefetch,
        "pin_memory": bool(loader.pin_memory) if pin_memory is None else pin_memory,
    }


def _drain(eff: Any, pending: list[Any]) -> None:
    """Receive every batch ``eff``'s workers hold, in order; ``eff`` must send no more indices.

    A batch whose loading raised (torch re-raises it after moving past it) is kept as its
    error; any other error (a worker died, a timeout) propagates.
    """
    while eff._task_info:
        before = len(eff._task_info)
        try:
            pending.append(type(eff)._next_data(eff))
        except Exception as e:
            if len(eff._task_info) >= before:
                raise
            pending.append(_Failed(e))


def _refill(eff: Any) -> None:
    """Send ``eff``'s workers indices up to its prefetch depth again (after a rolled-back drain).

    The depth counts what torch counts: batches the workers still owe (``_tasks_outstanding``)
    and batches received ahead of their turn and held in ``_task_info`` (each of which sends
    an index when it is delivered). Counting only the first would send too many, and torch
    raises "Number of outstanding tasks exceeded maximum allowed tasks" a few batches later.
    """
    if eff._shutdown:
        return
    depth = eff._prefetch_factor * eff._num_workers
    while eff._tasks_outstanding + _held(eff) < depth:
        sent = eff._send_idx
        eff._try_put_index()
        if eff._send_idx == sent:
            return


def _held(eff: Any) -> int:
    """Batches ``eff`` received ahead of their turn (``_task_info`` entries holding data)."""
    return sum(1 for info in eff._task_info.values() if len(info) == 2)


def _build(loader: Any, eff: Any, remaining: Any, target: dict[str, Any]) -> Any:
    """Set ``target`` on ``loader`` and return its new iterator over the ``remaining`` indices.

    ``loader`` is left unchanged when this raises. The iterator is built from a shallow view of
    ``loader`` (guards bypassed) whose index sampler is ``remaining`` and whose generator is a
    private one seeded from ``eff``'s seed, so the user's RNG streams are not drawn from; then
    its index sampler is the real one again, so a persistent iterator's next-epoch ``_reset``
    uses it.
    """
    import torch

    old = {k: loader.__dict__[k] for k in SETTINGS if k in loader.__dict__}
    try:
        for k in SETTINGS:
            setattr(loader, k, target[k])
        view = object.__new__(type(loader))
        view.__dict__.update(loader.__dict__)
        sampler_attr = "batch_sampler" if loader._auto_collation else "sampler"
        view.__dict__[sampler_attr] = _Remaining(remaining)
        view.__dict__["generator"] = torch.Generator().manual_seed(
            (int(eff._base_seed) + _GOLDEN) % 2**64
        )
        new = view._get_iterator()
        new._index_sampler = loader._index_sampler
        return new
    except BaseException:
        for k in SETTINGS:
            if k in old:
                setattr(loader, k, old[k])
        raise


def _install(it: Any, redirect: _Redirect | None, pending: list[Any], inner: Any) -> None:
    """Make ``it`` deliver ``pending`` (after what it already buffers), then ``inner``'s batches."""
    if redirect is None:
        it._next_data = _Redirect(deque(pending), inner)
    else:
        redirect.buffer.extend(pending)
        redirect.inner = inner


def _describe(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={settings[k]!r}" for k in SETTINGS)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 200 else text[:197] + "..."
