"""perfloop's run bootstrap: `perfloop run` puts this folder first on ``PYTHONPATH``.

In every Python process of the run, it first runs the ``sitecustomize`` module that this one
shadows (if any), then, when ``PERFLOOP_RUN_HOOKS=1``, waits for ``import torch`` to finish
and installs perfloop's training hooks (`perfloop.producers.hooks.install`) before the
script's own code goes on. It never breaks the process: any failure is one line on stderr.
This module is the entry point of the hooks, so it reads the environment (the settings).
"""

from __future__ import annotations

import contextlib
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _say(msg: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(f"perfloop: {msg}\n")


def _chain() -> None:
    """Run the sitecustomize this one shadows (the next one on sys.path)."""
    import importlib.machinery
    import importlib.util

    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        _say(f"the chained sitecustomize ({spec.origin}) failed: {type(e).__name__}: {e}")


def _install_hooks() -> None:
    try:
        from perfloop.producers import hooks
        from perfloop.settings import ProducerSettings

        settings = ProducerSettings()
        hooks.install(settings, command=os.environ.get("PERFLOOP_RUN_COMMAND", " ".join(sys.argv)))
    except Exception as e:
        _say(f"training hooks not installed: {type(e).__name__}: {e}")


class _TorchWatcher:
    """A meta-path finder that runs `_install_hooks` right after ``torch`` is imported."""

    def __init__(self) -> None:
        self.busy = False

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name != "torch" or self.busy:
            return None
        self.busy = True
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
        except Exception:
            spec = None
        finally:
            self.busy = False
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return None
        with_hooks = loader.exec_module
        watcher = self

        def exec_module(module: object) -> None:
            with_hooks(module)
            watcher.remove()
            _install_hooks()

        try:
            loader.exec_module = exec_module  # this spec's own loader instance
        except Exception:
            return None
        return spec

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)


def _main() -> None:
    try:
        _chain()
    except Exception as e:
        _say(f"cannot chain sitecustomize: {type(e).__name__}: {e}")
    if os.environ.get("PERFLOOP_RUN_HOOKS") != "1":
        return
    if "torch" in sys.modules:
        _install_hooks()
    else:
        sys.meta_path.insert(0, _TorchWatcher())  # type: ignore[arg-type]


_main()
