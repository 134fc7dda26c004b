"""The fake API server (support.fakeapi) as the slice controller's tests need it: a Node to own
the slice, a server whose feature gate is off (it drops a device field from what it stores, as
the real one drops a field of a disabled gate), and a server brought back on the port a client
already points at (an API server that was unreachable, then is back)."""

from __future__ import annotations

import asyncio
from typing import Any

from hlplugin.kubeapi import NODES
from support.dracluster import NODE
from support.fakeapi import FakeApiServer, Seen

__all__ = ["NODE", "GateOffApiServer", "PortApiServer", "add_node"]


def add_node(server: FakeApiServer, name: str = NODE) -> str:
    """A Node as the kubelet registers it; its uid, for the slice's ownerReference."""
    return str(server.put(NODES.path(), {"metadata": {"name": name}})["metadata"]["uid"])


class GateOffApiServer(FakeApiServer):
    """Drops ``field`` from every device of a slice written, as a 1.36 server with the field's
    gate off does (DRADeviceTaints for ``taints``, DRAConsumableCapacity for
    ``allowMultipleAllocations``): silently, the write succeeding."""

    def __init__(self, field: str, **options: Any) -> None:
        super().__init__(**options)
        self.field = field

    def _answer(self, seen: Seen) -> tuple[int, dict[str, Any]]:
        if seen.verb in ("create", "update") and seen.body:
            for device in (seen.body.get("spec") or {}).get("devices") or []:
                device.pop(self.field, None)
        return super()._answer(seen)


class PortApiServer(FakeApiServer):
    """Listens on a given port: the API server back where the client was told it is."""

    def __init__(self, port: int, **options: Any) -> None:
        super().__init__(**options)
        self.port = port

    async def __aenter__(self) -> PortApiServer:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port, ssl=self.tls)
        return self
