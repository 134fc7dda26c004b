"""The upstream Go plugin's environment variables whose names differ from ours, read as aliases,
so operators migrating from it keep their settings (its DEVICE_COUNT, DEVICE_UID and DEVICE_GID
are ours already; docs/operations.md lists them all).

Ours wins when both are set, and a disagreement is warned about. An empty alias counts as unset,
as upstream reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# Our option (its Settings field) -> the upstream plugin's variable.
UPSTREAM: dict[str, str] = {"host_dev_dir": "HOST_DEVICE_DIR"}


def variable(ours: str | None, alias: str | None, parse: Callable[[str], Any],
             env: Mapping[str, str], warnings: list[str]) -> str | None:
    """The variable that sets an option: ``ours`` if set, else ``alias`` if set and not empty;
    None if neither. Both set and disagreeing (as ``parse`` reads them): a warning, ours wins."""
    mine = ours if ours and ours in env else None
    if alias is None or not env.get(alias):
        return mine
    if mine is None:
        return alias

    def parsed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError:
            return text

    if parsed(env[alias]) != parsed(env[mine]):
        warnings.append(f"{alias}={env[alias][:60]!r} (the upstream plugin's name) disagrees with "
                        f"{mine}={env[mine][:60]!r}; using {mine}")
    return mine
