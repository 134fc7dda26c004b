"""Which API resource a call names, and the paths the API server serves it under.

Objects are plain dicts, never generated models: a model of a newer release (1.37) parsing what
a 1.36 server sent, or the reverse, must not drop or refuse a field neither side of our code
reads, so the client passes the JSON through as the server wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# One object as the API server writes it (JSON decoded), and as we send it.
Object = dict[str, Any]


@dataclass(frozen=True)
class Resource:
    """A resource type: its API group ("" for the core group), version and plural name."""

    group: str
    version: str
    plural: str
    namespaced: bool

    @property
    def name(self) -> str:
        """The name RBAC and the API server's messages use: ``resourceslices.resource.k8s.io``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def path(self, namespace: str | None = None, name: str | None = None) -> str:
        """The collection's path, or one object's when ``name`` is given."""
        root = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced:
            if not namespace:
                raise ValueError(f"{self.name} is namespaced: name the namespace")
            root += f"/namespaces/{namespace}"
        elif namespace:
            raise ValueError(f"{self.name} is not namespaced (namespace {namespace!r} given)")
        return f"{root}/{self.plural}" + (f"/{name}" if name else "")


# What the DRA driver reads and writes (docs/dra.md).
RESOURCE_SLICES = Resource("resource.k8s.io", "v1", "resourceslices", namespaced=False)
RESOURCE_CLAIMS = Resource("resource.k8s.io", "v1", "resourceclaims", namespaced=True)
NODES = Resource("", "v1", "nodes", namespaced=False)


def metadata(obj: Object) -> dict[str, Any]:
    """``obj["metadata"]``, or an empty dict where the object has none."""
    found = obj.get("metadata")
    return found if isinstance(found, dict) else {}
