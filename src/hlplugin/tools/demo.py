"""`hlplugin demo`: the whole system on one Linux machine, no cluster needed.

In a temporary node root it runs the built-in kubelet emulator (the one the tests use) in this
process and both daemons as real processes, then walks through what a node does: registration,
capacity, one allocation, the CDI spec a runtime would read, the device opened as a workload would
(and a guest run on KVM), a broken spec repaired, and the bootstrap's device grant. It is written
for someone who has never seen a device plugin: each step says in one line why it happens, and the
daemons' command lines are printed so that they can be run by hand. ``--keep`` keeps the node root
and the daemons' logs.

Exit status: 0 when every step worked; 1 when something could not be done (no usable /dev/kvm
or /dev/mshv, or a step failed), after showing everything else and saying what was missing. That
is the same verdict `hlplugin doctor` gives: a script learns whether this machine can run
Hyperlight workloads, a person reads why.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from hlplugin import cdi_spec, hvnode, probe
from hlplugin.deviceplugin.health.bounded import BoundedRunner, CheckFailed
from hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle import KUBELET_SOCKET
from hlplugin.names import DEVICE_ACCESS_RESOURCE as ACCESS_RESOURCE
from hlplugin.names import HYPERVISOR_RESOURCE, NO_HYPERVISOR_HINT
from hlplugin.settings import CdiSettings
from hlplugin.tools.demo_steps import (
    DemoDaemon,
    DemoError,
    Narration,
    command_line,
    duration,
    make_root,
    resolve,
)
from hlplugin.tools.emulator import CHECKPOINT, AdmissionError, KubeletEmulator

_GARBAGE = b"{ this is not a CDI spec\n"
_WAIT = 20.0  # guard for every wait; a healthy run needs a fraction of it
LOG_DIR = "logs"  # under the node root: each daemon's stderr, kept with --keep


def demo(keep: bool = False, *, dev_dir: Path = Path("/dev"), out: TextIO | None = None) -> int:
    """Run the demo; ``dev_dir`` is where the daemons look for the hypervisor (tests point it at a
    directory without one to see the machine-without-KVM path)."""
    return asyncio.run(Demo(keep, dev_dir, out or sys.stdout).run())


class Demo(Narration):
    def __init__(self, keep: bool, dev_dir: Path, out: TextIO) -> None:
        super().__init__(out)
        self.keep = keep
        self.dev_dir = dev_dir
        self.daemons: list[DemoDaemon] = []
        self.kubelet: KubeletEmulator | None = None

    # -- the run -------------------------------------------------------------------------------

    async def run(self) -> int:
        began = time.monotonic()
        root = make_root()
        found = hvnode.detect(self.dev_dir)
        self.say("hlplugin demo: both daemons against a built-in kubelet emulator")
        self.why("intro")
        kept = ("kept, with the daemons' logs in " + str(root / LOG_DIR) if self.keep
                else "removed at the end; --keep keeps it and the daemons' logs")
        self.say(f"   node root   {root} ({kept})")
        if found is not None:
            self.say(f"   hypervisor  {found} ({self.dev_dir / found})")
        else:
            self.say(f"   hypervisor  none: no kvm or mshv under {self.dev_dir}; the daemons run "
                     "with --hypervisor kvm to show what such a node tells the kubelet")
        hypervisor = found or "kvm"
        failed = False
        try:
            try:
                await self._walk(root, hypervisor)
            except DemoError as exc:
                failed = True
                self.say(f"\ndemo failed: {exc}")
                for daemon in self.daemons:
                    if daemon.raw:
                        self.say(f"--- last lines of {daemon.name} ---")
                        self.say("\n".join(daemon.raw[-15:]))
            finally:
                await self._stop_all()
            if not failed:
                self._summary(time.monotonic() - began)
        finally:
            if self.keep:
                logs = self._write_logs(root / LOG_DIR)
                self.say(f"\nkept the node root: {root}")
                for path in logs:
                    self.say(f"kept the log of hlplugin {path.stem}: {path}")
            else:
                shutil.rmtree(root, ignore_errors=True)
        return 1 if failed or self.missing else 0

    async def _walk(self, root: Path, hypervisor: str) -> None:
        plugin_dir = root / "device-plugins"
        cdi_dir = root / "cdi"

        self.step("start a kubelet emulator and both daemons")
        self.why("start")
        self.kubelet = kubelet = KubeletEmulator(plugin_dir)
        await kubelet.start()
        self.item(f"kubelet emulator    serving {kubelet.socket_path}")
        serve, boot = DemoDaemon.pair(plugin_dir, cdi_dir, self.dev_dir, hypervisor)
        started = time.monotonic()
        for daemon in (serve, boot):
            self.daemons.append(daemon)
            await daemon.start()
            self.item(f"{daemon.name:<19} pid {daemon.pid}, http://127.0.0.1:{daemon.port}/readyz")
            self.say(command_line(daemon.args, "      $ "))

        self.step("registration and advertised capacity")
        self.why("capacity")
        self.why("bootstrap")
        # Both daemons check their device before they register, so the first list is already
        # the truth: no need to wait for health to settle.
        await self._until(lambda: kubelet.capacity(HYPERVISOR_RESOURCE) > 0
                          and kubelet.capacity(ACCESS_RESOURCE) > 0, "both daemons to register")
        self.timings.append(("start to both registered", time.monotonic() - started))
        for name in (HYPERVISOR_RESOURCE, ACCESS_RESOURCE):
            endpoint = kubelet.resources[name].endpoint
            self.item(f"{name:<29} capacity {kubelet.capacity(name):>4}   allocatable "
                      f"{kubelet.allocatable(name):>4}   (endpoint {endpoint})")
        for daemon, resource in ((serve, HYPERVISOR_RESOURCE), (boot, ACCESS_RESOURCE)):
            code, body = await daemon.readyz()
            deadline = time.monotonic() + 3
            # Registered a moment ago: readiness may trail the kubelet's view by a few ms.
            while code != 200 and kubelet.allocatable(resource) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
                code, body = await daemon.readyz()
            failing = {k: v.get("reason", "") for k, v in body.get("conditions", {}).items()
                       if not v.get("ok")}
            self.item(f"{daemon.name:<19} /readyz {code} {body.get('status', '?')}"
                      + "".join(f"\n      {k}: {why}" for k, why in sorted(failing.items())))

        self.step(f"allocate one {HYPERVISOR_RESOURCE} slot, as the kubelet admits a pod")
        self.why("allocate")
        qualified = await self._allocate_slot(kubelet)

        self.step("resolve the CDI device and open it as a workload would")
        self.why("use")
        desired = cdi_spec.render_spec(hypervisor, CdiSettings.device_uid, CdiSettings.device_gid)
        if qualified is None:
            self.item("skipped: no allocation, so no workload would start here")
        else:
            await self._use_device(cdi_dir, qualified, hypervisor)

        self.step("break the CDI spec and watch the daemon repair it")
        self.why("repair")
        await self._break_and_repair(serve, cdi_dir / cdi_spec.SPEC_FILE, desired)

        self.step(f"allocate {ACCESS_RESOURCE} from the bootstrap daemon (what the main pod gets)")
        self.why("grant")
        await self._allocate_access(kubelet)

        self.step("stop: SIGTERM to both daemons, as at pod deletion")
        self.why("stop")
        stopped = time.monotonic()
        codes = await asyncio.gather(*(d.stop() for d in self.daemons))
        self.timings.append(("stop both daemons", time.monotonic() - stopped))
        for daemon, code in zip(self.daemons, codes, strict=True):
            self.item(f"{daemon.name:<19} exited {code}")
        left = sorted(p.name for p in plugin_dir.iterdir() if p.name not in (KUBELET_SOCKET, CHECKPOINT))
        spec_kept = (cdi_dir / cdi_spec.SPEC_FILE).exists()
        self.item(f"plugin sockets left: {', '.join(left) or 'none'}; CDI spec "
                  f"{'kept for containers already running' if spec_kept else 'missing'}")
        if any(codes):
            raise DemoError(f"a daemon exited with {codes} on SIGTERM")

    async def _allocate_slot(self, kubelet: KubeletEmulator) -> str | None:
        if kubelet.allocatable(HYPERVISOR_RESOURCE) == 0:
            await self._refused(kubelet, HYPERVISOR_RESOURCE, "allocate a hypervisor slot")
            return None
        before = set(kubelet.resources[HYPERVISOR_RESOURCE].allocated)
        try:
            response = await self.timed("Allocate hypervisor slot", kubelet.admit(HYPERVISOR_RESOURCE))
        except AdmissionError as exc:
            self.cannot("allocate a hypervisor slot", str(exc))
            return None
        picked = sorted(kubelet.resources[HYPERVISOR_RESOURCE].allocated - before)
        (container,) = response.container_responses
        names = [d.name for d in container.cdi_devices]
        self.item(f"Allocate({', '.join(picked)}) answered cdi_devices: {', '.join(names)}")
        self.item("the container runtime resolves that CDI name; nothing else is in the answer")
        return names[0] if names else None

    async def _refused(self, kubelet: KubeletEmulator, resource: str, what: str) -> None:
        """Nothing allocatable: the kubelet would refuse the pod itself. Call Allocate anyway, as
        happens when health fails during admission, to show the plugin's own refusal."""
        self.item(f"the kubelet would not admit a pod: {resource} allocatable is 0")
        device = sorted(kubelet.resources[resource].devices)[0]
        try:
            await kubelet.allocate(resource, [[device]])
        except AdmissionError as exc:
            self.cannot(what, f"Allocate({device}) anyway: {exc.code.name if exc.code else ''} "
                              f"{exc.details}")
        else:
            raise DemoError(f"Allocate({device}) of {resource} succeeded while not allocatable")

    async def _use_device(self, cdi_dir: Path, qualified: str, hypervisor: str) -> None:
        spec_path, device = resolve(cdi_dir, qualified)
        edits = device.get("containerEdits", {})
        self.item(f"{qualified} -> {spec_path}, device \"{device.get('name')}\"")
        nodes = edits.get("deviceNodes", [])
        if not nodes:
            raise DemoError(f"{qualified} in {spec_path} has no deviceNodes")
        for node in nodes:
            self.item(f"deviceNode {node.get('path')} (type {node.get('type')}, "
                      f"{node.get('permissions')}, uid {node.get('uid')}, gid {node.get('gid')})")
        self.item(f"env {' '.join(edits.get('env', []))}")
        host_path = Path(str(nodes[0].get("hostPath") or nodes[0].get("path")))
        runner = BoundedRunner(5.0, name="hlplugin-demo-workload")
        if hypervisor == "kvm":
            label = f"open {host_path}, create a VM, run a guest"
            try:
                await self.timed(label, runner.run(lambda: probe.probe_kvm(host_path, guest=True)))
            except CheckFailed as exc:
                self.cannot("run a guest", str(exc))
                return
            self.item(f"opened {host_path} read/write, KVM API {probe.KVM_API_VERSION}, created a "
                      "VM and ran a guest (mov al,42; out 0x10,al; hlt) to HLT")
        else:
            try:
                await self.timed(f"open {host_path}", runner.run(lambda: probe.probe_mshv(host_path)))
            except CheckFailed as exc:
                self.cannot(f"open {host_path}", str(exc))
                return
            self.item(f"opened {host_path} read/write (no guest is run on mshv)")
        self.item("(in a pod the runtime creates the node owned by uid/gid 65534, so a non-root "
                  "workload can open it)")

    async def _break_and_repair(self, serve: DemoDaemon, path: Path, desired: bytes) -> None:
        await self._until(lambda: cdi_spec.check_file(path, desired)[0], f"{path} to be written")
        before = await serve.metric("hyperlight_cdi_repairs_total", cause="malformed") or 0.0
        # In place, as an editor or a broken tool would.
        await asyncio.to_thread(path.write_bytes, _GARBAGE)
        broke = time.monotonic()
        self.item(f"overwrote {path.name} with {len(_GARBAGE)} bytes of garbage")
        await self._until(lambda: cdi_spec.check_file(path, desired)[0], "the CDI spec to be repaired")
        took = time.monotonic() - broke
        self.timings.append(("CDI spec broken to repaired", took))
        self.item(f"repaired in {took * 1000:.0f} ms: byte-identical again, replaced atomically")
        line = None
        deadline = time.monotonic() + 2
        while line is None and time.monotonic() < deadline:
            line = serve.logged(lambda e: "repaired CDI spec" in str(e.get("message"))
                                and e.get("fields", {}).get("cause") == "malformed")
            await asyncio.sleep(0.02)
        if line is not None:
            self.item(f"serve logged: {line['message']}")
        after = await serve.metric("hyperlight_cdi_repairs_total", cause="malformed") or 0.0
        self.item(f"metric: hyperlight_cdi_repairs_total{{cause=\"malformed\"}} {before:g} -> "
                  f"{after:g}")

    async def _allocate_access(self, kubelet: KubeletEmulator) -> None:
        if kubelet.allocatable(ACCESS_RESOURCE) == 0:
            await self._refused(kubelet, ACCESS_RESOURCE, "grant device access")
            return
        try:
            response = await self.timed("Allocate device-access", kubelet.admit(ACCESS_RESOURCE))
        except AdmissionError as exc:
            self.cannot("grant device access", str(exc))
            return
        for spec in response.container_responses[0].devices:
            self.item(f"DeviceSpec container_path={spec.container_path} host_path={spec.host_path} "
                      f"permissions={spec.permissions} (no CDI, no mounts, no env)")

    async def _until(self, predicate: Callable[[], bool], what: str) -> None:
        """Wait for ``predicate``; fail early, with the reason, if a daemon dies meanwhile."""
        deadline = time.monotonic() + _WAIT
        while not predicate():
            for daemon in self.daemons:
                if daemon.exited() is not None:
                    raise DemoError(f"{daemon.name} exited with {daemon.exited()} while waiting "
                                    f"for {what}")
            if time.monotonic() > deadline:
                raise DemoError(f"timed out after {_WAIT:.0f}s waiting for {what}")
            await asyncio.sleep(0.005)

    async def _stop_all(self) -> None:
        await asyncio.gather(*(d.stop() for d in self.daemons), return_exceptions=True)
        if self.kubelet is not None:
            await self.kubelet.stop(remove_socket=True)

    def _summary(self, total: float) -> None:
        self.say("\nsummary")
        for label, seconds in self.timings:
            self.say(f"   {label:<44} {duration(seconds):>9}")
        self.say(f"   {'total':<44} {duration(total):>9}")
        if self.missing:
            self.say(f"\nresult: this machine cannot run Hyperlight workloads: could not "
                     f"{', '.join(self.missing)}. Everything else above worked. "
                     f"Run `hlplugin doctor --device-only --dev-dir {self.dev_dir}` for the reason "
                     f"step by step; {NO_HYPERVISOR_HINT}")
        elif self.keep:
            self.say("\nresult: OK, both daemons served a Hyperlight workload end to end and stopped "
                     "cleanly; the node root and the daemons' logs are kept (--keep)")
        else:
            self.say("\nresult: OK, both daemons served a Hyperlight workload end to end; "
                     "nothing was left behind")

    def _write_logs(self, directory: Path) -> list[Path]:
        """Each daemon's stderr (JSON lines, as --log-format json writes them) to its own file."""
        written = []
        with contextlib.suppress(OSError):
            directory.mkdir(exist_ok=True)
            for daemon in self.daemons:
                path = directory / f"{daemon.name.removeprefix('hlplugin ')}.log"
                path.write_text("".join(f"{line}\n" for line in daemon.raw))
                written.append(path)
        return written
