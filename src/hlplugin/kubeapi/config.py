"""Where the API server is and how to prove who we are: in-cluster, or named by a test.

In a pod the API server is the ``kubernetes`` service (KUBERNETES_SERVICE_HOST and _PORT, set by
the kubelet in every container), verified against the service account's CA, and we are the
bearer of the service account's token. That token is projected and expires: the kubelet
rewrites the file (at 80% of its life, one hour by default), so it is never read once and kept.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from hlplugin.kubeapi.errors import ConfigError

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# A bound token is about 1 KiB; a file far bigger is not a token, and is not read whole.
MAX_TOKEN = 64 * 1024


class TokenFile:
    """A bearer token read from a file, and read again when the file changes.

    Each request stats the file (it follows the kubelet's ``..data`` symlink, which it swaps to
    rotate the token) and reads it only when its inode, size or mtime moved; a 401 reads it
    again whatever the stat says (a token replaced within one mtime tick). Both are small reads
    on the kubelet's tmpfs, done on the event loop.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._token = ""

    def current(self) -> str:
        try:
            info = os.stat(self.path)
        except OSError as exc:
            raise ConfigError(f"cannot read the token at {self.path}: {exc.strerror}") from exc
        if (info.st_ino, info.st_size, info.st_mtime_ns) != self._seen:
            self._read()
        return self._token

    def reread(self) -> str:
        self._read()
        return self._token

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as handle:
                info = os.fstat(handle.fileno())
                data = handle.read(MAX_TOKEN + 1)
        except OSError as exc:
            raise ConfigError(f"cannot read the token at {self.path}: {exc.strerror}") from exc
        if len(data) > MAX_TOKEN:
            raise ConfigError(f"{self.path} holds over {MAX_TOKEN} bytes: not a token")
        self._token = data.decode("ascii", "replace").strip()
        self._seen = (info.st_ino, info.st_size, info.st_mtime_ns)


@dataclass(frozen=True)
class Config:
    """One API server: its address, TLS (None for plain HTTP, which only tests use), the token,
    and the client's bounds on time and size (transport.py says why these)."""

    host: str
    port: int
    tls: ssl.SSLContext | None
    token: TokenFile | None
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    max_body: int = 4 * 1024 * 1024

    @classmethod
    def from_url(cls, url: str, *, token_path: Path | None = None, ca_file: Path | None = None,
                 tls: ssl.SSLContext | None = None, connect_timeout: float = 5.0,
                 read_timeout: float = 30.0, max_body: int = 4 * 1024 * 1024) -> Config:
        """An explicit server (tests, a kubectl proxy): ``http://127.0.0.1:8001`` or
        ``https://host:6443`` verified against ``ca_file`` (or the given TLS context)."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"not an http(s) URL: {url!r}")
        if parts.scheme == "https" and tls is None:
            tls = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        token = TokenFile(token_path) if token_path else None
        return cls(parts.hostname, port, tls if parts.scheme == "https" else None, token,
                   connect_timeout, read_timeout, max_body)

    @classmethod
    def in_cluster(cls, environ: Mapping[str, str] = os.environ,
                   account: Path = SERVICE_ACCOUNT) -> Config:
        """The ``kubernetes`` service, the service account's CA and its token, as a pod has them."""
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise ConfigError("KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set "
                              "(not running in a pod?)")
        ca, token = account / "ca.crt", account / "token"
        for needed in (ca, token):
            if not needed.is_file():
                raise ConfigError(f"{needed} is missing (is the service account token mounted?)")
        try:
            tls = ssl.create_default_context(cafile=str(ca))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load the CA {ca}: {exc}") from exc
        if not port.isdigit():
            raise ConfigError(f"KUBERNETES_SERVICE_PORT is not a port: {port!r}")
        bearer = TokenFile(token)
        bearer.current()  # fail now, not at the first call
        return cls(host, int(port), tls, bearer)
