"""``torch.save`` on the training thread: a ``checkpoint`` span, and the rank reads as saving
to the progress reports while it lasts.
"""

from __future__ import annotations

import functools
from typing import Any

from perfloop.producers._hooks_state import _S, _get_ident, _now, _oops


def _make_save(orig: Any) -> Any:
    """``torch.save`` on the training thread: a ``checkpoint`` span."""

    @functools.wraps(orig)
    def save(*args: Any, **kwargs: Any) -> Any:
        s = _S
        if s.tid != _get_ident() or s.tracer is None or s.waiting is not None:
            return orig(*args, **kwargs)
        t0 = _now()
        s.waiting = ("checkpoint", "torch.save", t0)
        try:
            return orig(*args, **kwargs)
        finally:
            s.waiting = None
            t1 = _now()
            try:
                s.tracer.checkpoint(t0, t1, "torch.save")
            except Exception as e:
                _oops("the torch.save hook", e)
            s.pipe.overhead_ns += _now() - t1  # type: ignore[union-attr]

    save.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return save
