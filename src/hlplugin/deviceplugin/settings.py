"""The generic device plugin's settings: plain frozen data, every knob of the lifecycle and the
process in one place, with its default and why it is what it is.

No parsing here: a daemon's command line turns flags and environment into these;
tests build them directly. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KubeletSettings:
    """How a plugin meets the kubelet (kubelet/deviceplugin/lifecycle.py; its rules: docs/kubelet.md)."""

    plugin_dir: Path = Path("/var/lib/kubelet/device-plugins")
    """The kubelet's device-plugin directory: kubelet.sock and our socket live there."""
    register_timeout: float = 5.0
    """Bound of one Register call: the kubelet dials us back inside it, so a kubelet that hangs
    there must not hang us."""
    min_backoff: float = 0.1
    """First wait after a failed attempt to serve or register; doubled per failure."""
    max_backoff: float = 5.0
    """Longest wait between attempts: a kubelet that comes back is met within it (a new
    kubelet.sock cuts any wait short)."""
    recheck_interval: float = 1.0
    """How often the sockets are looked at while the directory can only be polled, and the first
    wait for a kubelet.sock (a restarting kubelet deletes ours before it serves anew)."""
    live_recheck_interval: float = 10.0
    """How often the sockets are looked at while inotify is live: only a mount over the
    directory escapes it."""
    stream_grace: float = 3.0
    """A registered instance with no ListAndWatch stream this long is registered anew (the
    kubelet ended its stream and stayed up)."""
    kubelet_wait: float = 30.0
    """From the stream's end, how long a dead kubelet.sock is awaited to be replaced (a kubelet
    restart) before its failures count."""


@dataclass(frozen=True)
class HttpSettings:
    """The probes and metrics port (process/http.py) and the liveness self-check behind it."""

    address: tuple[str, int] = ("0.0.0.0", 8080)
    """Where /healthz, /readyz and /metrics are served."""
    self_check_fresh_for: float = 9.0
    """A passing gRPC self-check stands this long: under the kubelet's 5 s probes every other
    probe starts the check the next one reads, and a hung server still restarts within 26 s."""
    self_check_timeout: float = 1.0
    """Bound of the self-check's one call to our own socket."""
