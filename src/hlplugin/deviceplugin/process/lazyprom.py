"""prometheus_client without its exposition code until the first scrape.

The package's ``__init__`` imports its exposition module, which pulls in ``http.server``,
``urllib.request`` and ``wsgiref``: about 4 MiB resident and tens of milliseconds of start-up in
every daemon, though only a scrape of /metrics needs it. ``defer()`` registers the package without
running its ``__init__``, so the submodules a daemon uses at start (``metrics``, ``registry``, the
collectors) import alone; ``complete()`` runs the ``__init__`` in place at the first scrape. Any
``from prometheus_client import X`` or ``prometheus_client.X`` completes it first, so other code
sees the whole package as ever. Where the package is imported already, both do nothing.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any

PACKAGE = "prometheus_client"
_deferred: ModuleType | None = None


def defer() -> None:
    """Register the package, its ``__init__`` not run yet; before anything imports it."""
    global _deferred
    if PACKAGE in sys.modules:
        return
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.loader is None:
        return  # not installed: the import that needs it fails as it would have
    package = importlib.util.module_from_spec(spec)

    def __getattr__(name: str) -> Any:  # a name the __init__ defines: run it, then look again
        # A submodule ("from . import values") is for the import system to load, not a reason
        # to run the __init__.
        if (_deferred is None or name.startswith("__")
                or importlib.util.find_spec(f"{PACKAGE}.{name}") is not None):
            raise AttributeError(name)
        complete()
        return getattr(package, name)

    package.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[PACKAGE] = package
    _deferred = package


def complete() -> None:
    """Run the package's ``__init__`` now (its exposition module with it), once."""
    global _deferred
    package, _deferred = _deferred, None
    if package is None:
        return
    del package.__getattr__
    assert package.__spec__ is not None and package.__spec__.loader is not None
    package.__spec__.loader.exec_module(package)

