"""What each daemon runs with: plain frozen data, grouped by concern, at the bottom of the import
graph. Every default and every bound is written here once; the command line (hlplugin.config)
derives its flags, environment twins and ranges from these, and the chart's values and schema
are checked against them (tests/test_chart_settings.py).

No parsing and no detection here (``auto`` is resolved by hlplugin.detect); standard library and
the generic package's own settings only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hlplugin.deviceplugin import files
from hlplugin.deviceplugin.quoting import clip
from hlplugin.deviceplugin.settings import HttpSettings, KubeletSettings

UINT32_MAX = 4_294_967_295
HYPERVISORS = ("kvm", "mshv")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")

# The kubelet refuses a gRPC message over 4 MiB, so a device list larger than that makes its
# ListAndWatch fail and the node's capacity silently drop to 0. 50,000 IDs ("mshv-49999", all
# "Unhealthy", the longest form) serialize to 1.24 MB: 3.4x under the limit. The daemon's peak RSS
# at that count is in docs/security.md (it, not the message, is what a larger count would cost).
MAX_DEVICE_COUNT = 50_000
# The DRA driver's device shares the same bound (no message limit applies to a slice's capacity,
# but no node runs more containers than that): a node moved between the device plugin and the
# driver can be given the same count.
MAX_SLOTS = MAX_DEVICE_COUNT

# Durations: a tiny interval makes a periodic check a busy loop (a device check runs a VM, about
# 1.3 ms: at 1 s that is 0.1 % of a core); a timeout under 0.1 s fails checks on a loaded
# node; an interval over an hour, or a timeout over a minute, no longer bounds anything useful.
INTERVAL_RANGE = (1.0, 3600.0)
TIMEOUT_RANGE = (0.1, 60.0)


@dataclass(frozen=True)
class CdiSettings:
    """The CDI spec the main daemon keeps (hlplugin.cdi) and what its Allocate names."""

    dir: Path = Path("/var/run/cdi")
    """Directory of hyperlight.json: where containerd and podman look for specs."""
    interval: float = 10.0
    """Time between periodic checks of the spec; inotify covers local changes between them."""
    annotations: bool = False
    """Also name the CDI device in Allocate annotations, for kubelets older than 1.29."""
    device_uid: int = 65534
    """Owner of the device node inside workload containers (the default, nobody, lets any UID
    use it)."""
    device_gid: int = 65534
    """Group of the device node inside workload containers."""
    budget: float = 5.0
    """How long one pass (read, compare, write, two fsyncs) may take before condition cdi fails:
    storage that stops answering."""
    trust_quiet: float = 1.0
    """How long a right read answers Allocates while the directory's inotify watch is live and
    saw nothing: local changes always wake the watch; this bounds what it cannot see (a mount
    over the directory, a change on another host of a network file system)."""


@dataclass(frozen=True)
class HealthSettings:
    """Where the hypervisor is and how it is proved usable (hlplugin.health, bootstrap.node_watch)."""

    dev_dir: Path = Path("/dev")
    """Where the hypervisor's device node is seen and probed."""
    host_dev_dir: Path | None = Path("/host-dev")
    """The host's /dev, for the device identity check (None, an empty flag or variable: the check
    is off)."""
    hypervisor: str = "auto"
    """kvm, mshv, or auto (mshv over kvm, as upstream; by lstat, so a symlink does not count)."""
    interval: float = 10.0
    """Time between periodic device checks."""
    probe_timeout: float = 2.0
    """Budget of one device check: a hung kernel fails the check instead of hanging the daemon."""
    guest_check: bool = True
    """Run a tiny guest on KVM in each periodic device check, not only an empty VM."""


@dataclass(frozen=True)
class LogSettings:
    format: str = "text"
    """text, or json (one object a line, for log pipelines)."""
    level: str = "info"
    """The least level logged: debug, info, warning or error."""


@dataclass(frozen=True)
class ServeSettings:
    """`hlplugin serve`, the main daemon (also what `hlplugin cdi` and `doctor` read)."""

    kubelet: KubeletSettings = field(default_factory=KubeletSettings)
    cdi: CdiSettings = field(default_factory=CdiSettings)
    health: HealthSettings = field(default_factory=HealthSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    logging: LogSettings = field(default_factory=LogSettings)
    device_count: int = 2000
    """Shareable slots of the one device advertised: how many containers may hold it at once."""
    frame_guard: bool = False
    """Put the frame guard in front of each gRPC socket: it closes a connection whose HTTP/2 header
    block passes 64 KiB (the CONTINUATION flood, which grows gRPC to an OOM kill), at about 0.1 ms
    an Allocate (docs/security.md)."""


@dataclass(frozen=True)
class BootstrapSettings:
    """`hlplugin bootstrap`: one device-access slot, beside the main daemon on its own port."""

    kubelet: KubeletSettings = field(default_factory=KubeletSettings)
    health: HealthSettings = field(default_factory=HealthSettings)
    http: HttpSettings = field(default_factory=lambda: HttpSettings(address=("0.0.0.0", 8081)))
    logging: LogSettings = field(default_factory=LogSettings)
    frame_guard: bool = False
    """As for serve."""


@dataclass(frozen=True)
class DraPluginSettings:
    """How the DRA driver meets the kubelet (hlplugin.dra): the plugin watcher and the DRA service."""

    registry_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    """The kubelet's plugin watcher directory: the driver's registration socket is there."""
    plugin_dir: Path = Path("/var/lib/kubelet/plugins/hyperlight.dev")
    """The driver's own directory: its DRA service socket and its checkpoint of prepared claims."""
    pod_uid: str = ""
    """This pod's UID (the downward API's metadata.uid): it names both sockets, so the old and the
    new pod of a surging upgrade serve side by side. Empty (run by hand): one fixed name each."""
    node_name: str = ""
    """This node's name (the downward API's spec.nodeName): the device pool every answer names.
    Empty: the host name."""
    slots: int = 2000
    """Shareable slots of the one device in the node's ResourceSlice (its capacity, slots; a
    claim consumes one): how many containers may hold it at once, as --device-count for serve."""


# Letters, digits and hyphens (a UID is 36 of them): it goes into two socket names.
MAX_POD_UID = 63


@dataclass(frozen=True)
class DraSettings:
    """`hlplugin dra`, the DRA driver hyperlight.dev: opt-in, in place of the main daemon on a node."""

    dra: DraPluginSettings = field(default_factory=DraPluginSettings)
    cdi: CdiSettings = field(default_factory=CdiSettings)
    health: HealthSettings = field(default_factory=HealthSettings)
    http: HttpSettings = field(default_factory=lambda: HttpSettings(address=("0.0.0.0", 8082)))
    logging: LogSettings = field(default_factory=LogSettings)
    frame_guard: bool = False
    """As for serve (both the service and the registration socket)."""


DaemonSettings = ServeSettings | BootstrapSettings | DraSettings


def show(value: object) -> str:
    """A setting as an operator would type it (a path cut after files.PATH_CHARS characters)."""
    if isinstance(value, tuple):
        return f"{value[0]}:{value[1]}"
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "(empty)"
    return clip(str(value), files.PATH_CHARS)
