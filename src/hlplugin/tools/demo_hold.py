"""`hlplugin demo --hold`: the demo's node kept running until Ctrl-C, to poke at.

The same kubelet emulator and the same two daemon processes as `hlplugin demo`, in a temporary
node root, registered and left up: it prints their URLs, the plugin directory and a few commands
to try (curl /readyz and /metrics, break the CDI spec, allocate). Allocations go through the
emulator, as the kubelet would make them, on request: a line ``allocate`` (or ``allocate
device-access``) typed at the held demo, or sent to its control socket, which
``hlplugin demo --allocate SOCKET`` does. SIGINT or SIGTERM stops both daemons with SIGTERM, the
emulator, and removes the node root: nothing is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from hlplugin.names import DEVICE_ACCESS_RESOURCE, HYPERVISOR_RESOURCE
from hlplugin.tools.demo_steps import DemoDaemon, make_root
from hlplugin.tools.emulator import AdmissionError, KubeletEmulator

CONTROL_SOCKET = "demo.sock"
RESOURCES = {"": HYPERVISOR_RESOURCE, "hypervisor": HYPERVISOR_RESOURCE,
             "device-access": DEVICE_ACCESS_RESOURCE}
HOLDING = "holding: press Ctrl-C to stop everything and remove the node root"
_WAIT = 20.0  # guard for registration; a healthy start needs about a second


def hold(*, dev_dir: Path = Path("/dev"), out: TextIO | None = None) -> int:
    """Run the held demo until SIGINT or SIGTERM; 0 when both daemons then exit 0."""
    return asyncio.run(Held(dev_dir, out or sys.stdout).run())


def allocate(control: Path, what: str = "") -> int:
    """`hlplugin demo --allocate SOCKET [RESOURCE]`: ask a held demo to allocate, print its answer;
    0 when the allocation was made."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        try:
            sock.connect(str(control))
        except OSError as exc:
            print(f"hlplugin demo: cannot reach a held demo at {control}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 1
        sock.sendall(f"allocate {what}".strip().encode() + b"\n")
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    text = answer.decode(errors="replace")
    print(text, end="" if text.endswith("\n") else "\n")
    return 0 if text.startswith("ok") else 1


class Held:
    def __init__(self, dev_dir: Path, out: TextIO) -> None:
        self.dev_dir = dev_dir
        self.out = out
        self.daemons: list[DemoDaemon] = []
        self.kubelet: KubeletEmulator | None = None
        self.stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self.stopping.set)
        root = make_root()
        codes: list[int] = []
        try:
            control = await self._start(root)
            if control is not None:
                async with control:
                    self._read_stdin(loop)
                    await self.stopping.wait()
                    self.say("\nstopping: SIGTERM to both daemons")
        finally:
            codes = list(await asyncio.gather(*(d.stop() for d in self.daemons)))
            if self.kubelet is not None:
                await self.kubelet.stop(remove_socket=True)
            shutil.rmtree(root, ignore_errors=True)
        for daemon, code in zip(self.daemons, codes, strict=True):
            self.say(f"   {daemon.name:<19} exited {code}")
        self.say(f"removed {root}")
        return 0 if codes and not any(codes) else 1

    async def _start(self, root: Path) -> asyncio.Server | None:
        plugin_dir, cdi_dir = root / "device-plugins", root / "cdi"
        hypervisor = "mshv" if (self.dev_dir / "mshv").exists() else "kvm"
        self.kubelet = KubeletEmulator(plugin_dir)
        await self.kubelet.start()
        serve, boot = DemoDaemon.pair(plugin_dir, cdi_dir, self.dev_dir, hypervisor)
        for daemon in (serve, boot):
            self.daemons.append(daemon)
            await daemon.start()
        kubelet = self.kubelet
        deadline = time.monotonic() + _WAIT
        while not (kubelet.capacity(HYPERVISOR_RESOURCE) and kubelet.capacity(DEVICE_ACCESS_RESOURCE)):
            dead = [d for d in self.daemons if d.exited() is not None]
            if dead or time.monotonic() > deadline or self.stopping.is_set():
                for daemon in dead:
                    self.say(f"{daemon.name} exited {daemon.exited()}:\n" + "\n".join(daemon.raw[-15:]))
                self.say("hlplugin demo --hold: the daemons did not register; stopping")
                return None
            await asyncio.sleep(0.02)
        control_path = root / CONTROL_SOCKET
        server = await asyncio.start_unix_server(self._serve_control, path=str(control_path))
        me = [sys.executable, "-m", "hlplugin"]
        self.say("hlplugin demo --hold: both daemons against the kubelet emulator, until Ctrl-C")
        self.say(f"   node root    {root} (removed when you stop)")
        self.say(f"   plugin dir   {plugin_dir} (kubelet.sock is the emulator's)")
        self.say(f"   CDI spec     {cdi_dir / 'hyperlight.json'}")
        for daemon in self.daemons:
            self.say(f"   {daemon.name:<19} pid {daemon.pid}, http://127.0.0.1:{daemon.port}/readyz")
        for name in (HYPERVISOR_RESOURCE, DEVICE_ACCESS_RESOURCE):
            self.say(f"   {name:<29} capacity {kubelet.capacity(name):>4}   allocatable "
                     f"{kubelet.allocatable(name):>4}")
        spec = shlex.quote(str(cdi_dir / "hyperlight.json"))
        self.say("\ntry, from another shell:")
        self.say(f"   curl -s http://127.0.0.1:{serve.port}/readyz")
        self.say(f"   curl -s http://127.0.0.1:{serve.port}/metrics | grep '^hyperlight_devices'")
        self.say(f"   echo garbage > {spec}; sleep 0.1; head -3 {spec}     # repaired at once")
        self.say(f"   {shlex.join([*me, 'demo', '--allocate', str(control_path)])}")
        self.say(f"   {shlex.join([*me, 'demo', '--allocate', str(control_path), 'device-access'])}")
        self.say('or type "allocate" (or "allocate device-access") and Enter here.')
        self.say(HOLDING)
        return server

    def _read_stdin(self, loop: asyncio.AbstractEventLoop) -> None:
        """Lines typed at the held demo, from a daemon thread (a blocked read never holds up the
        exit); end of input only ends the reading (a demo run in the background has none)."""

        def typed(text: str) -> None:  # on the loop
            task = loop.create_task(self._typed(text))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        def read() -> None:
            with contextlib.suppress(OSError, ValueError):
                for line in sys.stdin:
                    if line.strip():
                        loop.call_soon_threadsafe(typed, line)

        threading.Thread(target=read, name="hlplugin-demo-stdin", daemon=True).start()

    async def _typed(self, line: str) -> None:
        self.say(await self._command(line))

    async def _serve_control(self, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 10)
            answer = await self._command(line.decode(errors="replace"))
            self.say(f"[control socket] {line.decode(errors='replace').strip()}: {answer}")
            writer.write(answer.encode() + b"\n")
            await writer.drain()
        except (TimeoutError, OSError):
            pass
        finally:
            writer.close()

    async def _command(self, line: str) -> str:
        words = line.split()
        if not words or words[0] != "allocate" or len(words) > 2:
            return 'error: the commands are "allocate" and "allocate device-access"'
        resource = RESOURCES.get(words[1] if len(words) > 1 else "")
        if resource is None or self.kubelet is None:
            return f"error: no resource {words[1]!r}; try hypervisor or device-access"
        before = set(self.kubelet.resources[resource].allocated) \
            if resource in self.kubelet.resources else set()
        try:
            response = await self.kubelet.admit(resource)
        except AdmissionError as exc:
            return f"refused: {exc}"
        picked = ", ".join(sorted(self.kubelet.resources[resource].allocated - before))
        (container,) = response.container_responses
        if container.cdi_devices:
            return (f"ok: Allocate({picked}) answered cdi_devices: "
                    + ", ".join(d.name for d in container.cdi_devices))
        return (f"ok: Allocate({picked}) answered devices: "
                + ", ".join(f"{d.container_path} ({d.permissions})" for d in container.devices))
