"""`hlplugin doctor`: one-shot diagnosis of this node as the daemons would see it.

It reuses the daemons' own checks (hlplugin.probe, hlplugin.cdi_spec, detect.detect_hypervisor,
the lifecycle's plugin-dir and kubelet.sock checks in deviceplugin.kubelet.deviceplugin.kubeletsock), so
a verdict here means what the daemons would conclude, not what a separate tool guesses. Every
device step runs in a BoundedRunner: a hung ioctl costs a "timed out" row, never a hung doctor.
Nothing is changed: the CDI spec is only read, and the writability test writes a temp file of the
reconciler's own prefix and removes it at once (its row says so).

Where it runs matters. In the main daemon's pod the host's /dev is mounted at /host-dev; on the node
itself (no /host-dev with the default setting) /dev is the host's view, and the report says it used
it. A machine without the kubelet's device-plugins directory is not a node, and the verdict says so.
``--device-only`` checks the hypervisor and what a workload's runtime would do with the CDI spec,
nothing of the kubelet: the verdict `hlplugin demo` gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hlplugin import cdi_spec, probe
from hlplugin.detect import detect_hypervisor
from hlplugin.deviceplugin.files import char_device
from hlplugin.deviceplugin.health.bounded import BoundedRunner, CheckFailed
from hlplugin.deviceplugin.kubelet.deviceplugin.kubeletsock import (
    connect_error,
    dir_problem,
    kubelet_problem,
)
from hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle import KUBELET_SOCKET
from hlplugin.deviceplugin.kubelet.endpoint import socket_identity
from hlplugin.names import NO_HYPERVISOR_HINT, PLUGIN_DIR_FLAG
from hlplugin.settings import HealthSettings, ServeSettings
from hlplugin.tools import cdi_access
from hlplugin.tools.cdi_resolve import resolves_to

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    seconds: float = 0.0


@dataclass
class Report:
    checks: list[Check]
    hypervisor: str | None
    device_only: bool = False
    not_a_node: str = ""  # the plugin dir that does not exist, when it does not

    @property
    def ok(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    @property
    def reason(self) -> str:
        """The first failure, which is usually the cause of the ones after it."""
        failed = [c for c in self.checks if c.status == FAIL]
        if not failed:
            return ""
        more = f" (and {len(failed) - 1} more failing)" if len(failed) > 1 else ""
        return f"{failed[0].name}: {failed[0].detail}{more}"

    @property
    def verdict(self) -> str:
        if self.device_only:
            if self.ok:
                return (f"OK - this machine could run Hyperlight workloads ({self.hypervisor}): its "
                        "hypervisor works and a runtime could use the CDI device")
            return f"FAIL - this machine could not run Hyperlight workloads. {self.reason}"
        if self.ok:
            return f"OK - this node could serve Hyperlight workloads ({self.hypervisor})"
        if self.not_a_node:
            return (f"FAIL - this machine is not a Kubernetes node: there is no {self.not_a_node} "
                    "(the kubelet's device-plugins directory). `hlplugin doctor --device-only` "
                    f"checks the hypervisor and the CDI device alone. {self.reason}")
        return f"FAIL - this node could not serve Hyperlight workloads. {self.reason}"

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "verdict": self.verdict, "reason": self.reason,
                "hypervisor": self.hypervisor, "checks": [asdict(c) for c in self.checks]}


def doctor(settings: ServeSettings, *, as_json: bool = False, device_only: bool = False) -> int:
    """Print the report (a table, or JSON); 0 when the node could serve workloads (with
    ``device_only``: when the hypervisor and the CDI device work), else 1."""
    report = asyncio.run(diagnose(settings, device_only=device_only))
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(render(report))
    return 0 if report.ok else 1


def render(report: Report) -> str:
    width = max(len(c.name) for c in report.checks)
    lines = [f"{'CHECK':<{width}}  STATUS  DETAIL"]
    for c in report.checks:
        lines.append(f"{c.name:<{width}}  {c.status.upper():<6}  {c.detail}")
    lines.append("")
    lines.append(f"verdict: {report.verdict}")
    return "\n".join(lines)


def host_view(settings: ServeSettings) -> tuple[Path | None, str]:
    """The host /dev view, and why when it is not the setting's: outside the pod, no /host-dev."""
    host = settings.health.host_dev_dir
    if host == HealthSettings.host_dev_dir and host is not None and not host.exists():
        return settings.health.dev_dir, (f"{host} does not exist, so this is not the daemon's pod: "
                                  f"{settings.health.dev_dir} is the host's view")
    return host, ""


async def diagnose(settings: ServeSettings, *, device_only: bool = False) -> Report:
    checks: list[Check] = []

    async def step(name: str, fn: Callable[[], str]) -> Check:
        """Run ``fn`` bounded; its return value is the detail of an ok row. A runner per step: a
        helper stuck in the kernel fails its own row, not the unrelated ones after it."""
        started = time.monotonic()
        runner = BoundedRunner(settings.health.probe_timeout, name=f"hlplugin-doctor-{name}")
        try:
            detail = await runner.run(fn)
            check = Check(name, OK, detail)
        except CheckFailed as exc:
            check = Check(name, FAIL, _with_hint(exc))
        except _Verdict as exc:
            check = Check(name, exc.status, exc.detail)
        except cdi_access.Exposed as exc:
            check = Check(name, WARN, str(exc))
        except OSError as exc:
            check = Check(name, FAIL, _os_error(exc))
        check.seconds = round(time.monotonic() - started, 6)
        checks.append(check)
        return check

    def skip(name: str, why: str) -> None:
        checks.append(Check(name, SKIP, why))

    hypervisor = detect_hypervisor(settings.health)
    if hypervisor is None:
        checks.append(Check("hypervisor", FAIL, f"no mshv or kvm device under "
                            f"{settings.health.dev_dir} (pass --dev-dir, or --hypervisor to name "
                            f"one); {NO_HYPERVISOR_HINT}"))
    else:
        how = "configured" if settings.health.hypervisor != "auto" else "detected"
        found = settings.health.dev_dir / hypervisor
        checks.append(Check("hypervisor", OK, f"{hypervisor} ({how}, {found})"))

    device_names = (["KVM API version", "VM creation", "guest run"] if hypervisor != "mshv"
                    else ["open read/write"])
    if hypervisor is None:
        skip("device node", "no hypervisor")
        for name in device_names:
            skip(name, "no hypervisor")
    else:
        path = settings.health.dev_dir / hypervisor
        node = await step("device node", lambda: _describe_node(path))
        if node.status != OK:
            for name in device_names:
                skip(name, "no usable device node")
        elif hypervisor == "kvm":
            await _kvm_steps(path, step, skip)
        else:
            await step("open read/write", lambda: _mshv(path))

    if device_only:
        if hypervisor is None:
            skip("CDI device", "no hypervisor")
        else:
            hv = hypervisor
            await step("CDI device", lambda: _cdi_device(settings, hv))
        return Report(checks, hypervisor, device_only=True)

    host_dev_dir, chosen = host_view(settings)
    if host_dev_dir is None:
        skip("host identity", "off (--host-dev-dir is empty)")
    elif hypervisor is None:
        skip("host identity", "no hypervisor")
    else:
        hv, host = hypervisor, host_dev_dir
        check = await step("host identity", lambda: _identity(settings.health.dev_dir / hv, host / hv))
        if chosen:
            check.detail = f"{check.detail} ({chosen})"

    await step("CDI dir", lambda: _cdi_dir_writable(settings.cdi.dir))
    await step("CDI dir access", lambda: cdi_access.check(settings.cdi.dir))
    if hypervisor is None:
        skip("CDI spec", "no hypervisor")
    else:
        desired = cdi_spec.render_spec(hypervisor, settings.cdi.device_uid, settings.cdi.device_gid)
        await step("CDI spec", lambda: _cdi_spec(settings.cdi.dir / cdi_spec.SPEC_FILE, desired))
    plugin_dir = await step("plugin dir", lambda: _plugin_dir(settings.kubelet.plugin_dir))
    not_a_node = ""
    if plugin_dir.status == FAIL and not settings.kubelet.plugin_dir.exists():
        not_a_node = str(settings.kubelet.plugin_dir)
        skip("kubelet socket", "not a Kubernetes node (no kubelet device-plugins directory)")
    else:
        await step("kubelet socket", lambda: _kubelet(settings.kubelet.plugin_dir / KUBELET_SOCKET))
    return Report(checks, hypervisor, not_a_node=not_a_node)


Step = Callable[[str, Callable[[], str]], Any]


async def _kvm_steps(path: Path, step: Step, skip: Callable[[str, str], None]) -> None:
    """API version, then VM creation, then the guest: each only when the one before worked."""
    version = await step("KVM API version", lambda: _api_version(path))
    if version.status != OK:
        skip("VM creation", "KVM API version failed")
        skip("guest run", "KVM API version failed")
        return
    vm = await step("VM creation", lambda: _create_vm(path))
    if vm.status != OK:
        skip("guest run", "VM creation failed")
        return
    await step("guest run", lambda: _guest(path))


class _Verdict(Exception):
    """A non-ok row that is not a probe failure (a warning, or a failure with our own words)."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


# --- the steps (run in the helper thread) ---------------------------------------------------------


def _describe_node(path: Path) -> str:
    try:
        st, kind = char_device(path)
    except OSError as exc:
        raise _Verdict(FAIL, f"{path}: {_os_error(exc)}") from None
    if kind:
        raise _Verdict(FAIL, f"{path} is not a character device (mode {st.st_mode:o})")
    return (f"{path}: character device {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}, "
            f"mode {stat.S_IMODE(st.st_mode):04o}, owner {st.st_uid}:{st.st_gid}")


def _api_version(path: Path) -> str:
    return str(probe.kvm_api_version(path))


def _create_vm(path: Path) -> str:
    probe.probe_kvm(path, guest=False)
    return "KVM_CREATE_VM succeeded"


def _guest(path: Path) -> str:
    started = time.monotonic()
    probe.probe_kvm(path, guest=True)
    took = (time.monotonic() - started) * 1000
    return f"a real-mode guest ran to HLT (out 0x10 = 42) in {took:.1f} ms"


def _mshv(path: Path) -> str:
    probe.probe_mshv(path)
    return f"{path} opens read/write (no VM is created for mshv)"


def _identity(dev_path: Path, host_path: Path) -> str:
    if not host_path.parent.is_dir():
        raise _Verdict(FAIL, f"the host /dev view {host_path.parent} does not exist (outside the "
                             "daemon's pod pass --host-dev-dir /dev; an empty value turns the "
                             "check off)")
    probe.check_host_identity(dev_path, host_path)
    rdev = os.stat(host_path).st_rdev
    return f"{host_path} has the device number of {dev_path} ({os.major(rdev)}:{os.minor(rdev)})"


def _cdi_dir_writable(directory: Path) -> str:
    """Write, fsync and remove a spec-sized temp file: catches read-only and full storage."""
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        ancestor = directory.parent
        while not ancestor.exists() and ancestor != ancestor.parent:
            ancestor = ancestor.parent
        if ancestor.is_dir() and os.access(ancestor, os.W_OK | os.X_OK):
            return f"{directory} does not exist yet; the daemon creates it ({ancestor} is writable)"
        raise _Verdict(FAIL, f"{directory} does not exist and {ancestor} is not writable") from None
    if not stat.S_ISDIR(st.st_mode):
        raise _Verdict(FAIL, f"{directory} is not a directory")
    temp = directory / (cdi_spec.TEMP_PREFIX + "doctor-" + secrets.token_hex(4))
    try:
        fd = os.open(temp, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_WRONLY | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, b" " * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _Verdict(FAIL, f"cannot write in {directory}: {_os_error(exc)} (tried a 4 KiB "
                             f"temp file, {temp.name})") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp)
    return f"{directory} is writable (wrote, synced and removed a 4 KiB temp file, {temp.name})"


def _cdi_device(settings: ServeSettings, hypervisor: str) -> str:
    spec = cdi_spec.render_spec(hypervisor, settings.cdi.device_uid, settings.cdi.device_gid)
    try:
        return resolves_to(spec, cdi_spec.qualified_name(hypervisor), settings.health.dev_dir)
    except ValueError as exc:
        raise _Verdict(FAIL, str(exc)) from None


def _cdi_spec(path: Path, desired: bytes) -> str:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise _Verdict(WARN, f"{path} is missing; the daemon writes it at start") from None
    if not stat.S_ISREG(st.st_mode):
        raise _Verdict(FAIL, f"{path} is not a regular file (mode {st.st_mode:o}); the daemon "
                             "refuses to replace it and stays unready until it is removed")
    same, difference = cdi_spec.check_file(path, desired)
    if not same:
        first = next((line for line in difference.splitlines()
                      if line[:1] in "+-" and line[:3] not in ("+++", "---")), difference)
        raise _Verdict(WARN, f"{path} differs from the desired spec ({first.strip()}); "
                             "the daemon rewrites it")
    if stat.S_IMODE(st.st_mode) != cdi_spec.MODE:
        raise _Verdict(WARN, f"{path} is up to date but mode {stat.S_IMODE(st.st_mode):04o}; "
                             "the daemon resets it to 0644")
    return f"{path} is up to date"


def _plugin_dir(directory: Path) -> str:
    problem = dir_problem(directory, PLUGIN_DIR_FLAG)  # the daemons' words for it
    if problem:
        raise _Verdict(FAIL, problem)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise _Verdict(FAIL, f"{directory} is not writable; the daemons create their sockets there")
    return f"{directory} is writable"


def _kubelet(path: Path) -> str:
    if socket_identity(path) is None:
        raise _Verdict(FAIL, kubelet_problem(path, PLUGIN_DIR_FLAG))  # the daemons' words for it
    error = connect_error(path)
    if error is not None:
        stale = " (a stale socket: a crashed kubelet leaves it behind)" \
            if error.errno == errno.ECONNREFUSED else ""
        raise _Verdict(FAIL, f"{path} does not accept connections: {_os_error(error)}{stale}")
    return f"{path} accepts connections"


# --- wording ------------------------------------------------------------------------------------


def _os_error(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "")
    return f"{exc.strerror or exc} ({name})" if name else str(exc.strerror or exc)


def _with_hint(exc: CheckFailed) -> str:
    """The probe's message, plus what an operator can do about the commonest causes."""
    hint = ""
    if not isinstance(exc, probe.ProbeError):
        pass  # the runner gave up: its message says why
    elif exc.errno == errno.EACCES:
        hint = f"; run as root or as a member of {_group_of(exc.path)}"
    elif exc.errno == errno.ENOTTY:
        hint = "; the node exists but is not a KVM device"
    elif exc.errno in (errno.ENOENT, errno.ENXIO, errno.ENODEV) or exc.reason in ("create_vm", "guest"):
        hint = f"; {NO_HYPERVISOR_HINT}"
    return f"{exc}{hint}"


def _group_of(path: Path | None) -> str:
    if path is None:
        return "the device's group"
    try:
        import grp

        return f"group {grp.getgrgid(os.stat(path).st_gid).gr_name}"
    except (OSError, KeyError):
        return "the device's group"
