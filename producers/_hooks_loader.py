"""DataLoader iteration: the wait for each batch (``data_wait``), the batch's size and tokens
(`_inspect_batch`), and which iterator of which DataLoader, in which epoch, fed the step (what
the job agent changes).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

from perfloop.producers._hooks_session import _traced
from perfloop.producers._hooks_state import _S, _now, _oops


def _inspect_batch(batch: Any, tensor_type: Any) -> tuple[int, int]:
    """(batch size, tokens): the first dimension of the first tensor; tokens = elements of
    the first integer tensor with two or more dimensions (token ids)."""
    items: Any
    if isinstance(batch, tensor_type):
        items = (batch,)
    elif isinstance(batch, dict):
        items = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    else:
        return 0, 0
    bs = tok = 0
    for i, x in enumerate(items):
        if i >= 4:
            break
        if isinstance(x, tensor_type):
            if not bs and x.dim() >= 1:
                bs = int(x.shape[0])
            if not tok and x.dim() >= 2 and not x.is_floating_point() and not x.is_complex():
                tok = int(x.numel())
    return bs, tok


def _make_next(orig: Any) -> Any:
    @functools.wraps(orig)
    def __next__(self: Any) -> Any:
        tr = _traced()
        if tr is None:
            return orig(self)
        t0 = _now()
        _S.waiting = ("data_wait", "", t0)
        try:
            batch = orig(self)
        except StopIteration:
            _S.waiting = None
            t1 = _now()
            try:
                tr.fetch(t0, t1, stop=True)
            except Exception as e:
                _oops("the data-loader hook", e)
            raise
        except BaseException:
            _S.waiting = None
            raise
        t1 = _now()
        _S.waiting = None
        try:
            bs, tok = _inspect_batch(batch, _S.torch.Tensor)
            iters = _S.iters
            ref = iters.get(id(self))
            if ref is None or ref() is not self:
                if len(iters) >= 16:
                    iters.clear()
                iters[id(self)] = weakref.ref(self)
            tr.fetch(
                t0,
                t1,
                bs,
                tok,
                (id(self), getattr(self, "_perfloop_epoch", 0)),
                getattr(self, "_num_workers", 0),  # kept current by a mid-epoch change
            )
        except Exception as e:
            _oops("the data-loader hook", e)
        _S.pipe.overhead_ns += _now() - t1  # type: ignore[union-attr]
        return batch

    __next__.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return __next__


def _make_iter(orig: Any) -> Any:
    @functools.wraps(orig)
    def __iter__(self: Any) -> Any:
        it = orig(self)
        try:
            n = _S.epochs.get(self, -1) + 1
            _S.epochs[self] = n
            it._perfloop_epoch = n
            it._perfloop_loader = self  # what the job agent changes
        except Exception as e:
            _oops("the data-loader epoch counter", e)
        return it

    __iter__.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return __iter__
