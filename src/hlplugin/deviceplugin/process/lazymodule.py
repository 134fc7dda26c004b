"""A module imported at its first use instead of at start (the standard library's LazyLoader).

For a library that only some later event needs: h11 parses the first HTTP request, never
anything before the daemon registers, yet takes milliseconds to import. ``load(name)`` puts a
module in ``sys.modules`` whose code runs at the first attribute looked up on it (then it is the
ordinary module, looked up at the ordinary cost); an import of the same name meanwhile gets that
module too. Where the module is imported already, it is returned as it is.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def load(name: str) -> ModuleType:
    """``name``, its code run at first use; ModuleNotFoundError at once if it is not installed."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

