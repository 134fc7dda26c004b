"""The fault-injection matrix: the live validation table of the upstream Go plugin, proved on every run.

The upstream Go plugin is the design this project implements (pull request #14 of
hyperlight-dev/hyperlight-on-kubernetes); its validation on a real AKS KVM node listed these faults
and its figures, which rows quote as `upstream_go=` for comparison.

Every row runs the real `hlplugin serve` process against the kubelet emulator over real unix
sockets, breaks the world (files, mounts, device nodes, a kubelet, a filesystem) and checks the
daemon's answer, its recovery time and a fresh allocation afterwards. Fakes fake the world, never
our code: mknod'd nodes with /dev/kvm's or /dev/null's numbers, a read-only bind mount, a 16 KiB
tmpfs, a FUSE filesystem served from this process that stops answering, a kubelet that never
answers. The real /dev/kvm is only ever opened, and its mode, owner and numbers are compared after
every scenario, as is a sibling CDI spec.

Recovery times are recorded, never asserted (guard timeouts only). At the end of the module the
table is printed and written as JSON to $HLPLUGIN_FAULT_REPORT or ./fault-matrix.json.

Run: ``python -m pytest -m faults tests/test_faults.py``
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from fusefs import HangingDevFs
from harness import IS_ROOT, Daemon, Node, run

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc
from hlplugin.cdi import SPEC_FILE, TEMP_PREFIX, render_spec
from hlplugin.emulator import AdmissionError, KubeletEmulator

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]

RESOURCE = "hyperlight.dev/hypervisor"
CDI_NAME = "hyperlight.dev/hypervisor=kvm"
SOCKET = "hyperlight.sock"
COUNT = 16
GUARD = 20.0  # seconds; only ever reached when something is broken
KVM = Path("/dev/kvm")
HAVE_KVM = KVM.exists() and os.access(KVM, os.R_OK | os.W_OK)
KVM_RDEV = os.stat(KVM).st_rdev if KVM.exists() else os.makedev(10, 232)
NULL_RDEV = os.makedev(1, 3)  # /dev/null's numbers: a device that exists but is not KVM
STALE = render_spec("kvm", 1000, 1000)  # well-formed, another uid/gid
MALFORMED = b'{"cdiVersion": "0.3.0", "kind": "hyperlight.dev/hyperv'
SIBLING = b'{"cdiVersion": "0.5.0", "kind": "vendor.example/gpu", "devices": []}\n'
REASON = re.compile(r"is not usable on this node: .*\b(cdi|device|host_identity): \S")

needs_kvm = pytest.mark.skipif(not HAVE_KVM, reason="needs a usable /dev/kvm")
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root (mknod, mount)")


def desired_spec() -> bytes:
    """What `hlplugin cdi` prints: the exact content every repair must produce."""
    out = subprocess.run([sys.executable, "-m", "hlplugin", "cdi", "--hypervisor", "kvm"],
                         capture_output=True, check=True, timeout=60)
    return out.stdout


DESIRED = desired_spec()


# --- the table -----------------------------------------------------------------------------------

ROWS: list[dict[str, Any]] = []


@dataclass
class Row:
    scenario: str
    result: str = "pass"
    recovery_s: float | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    siblings: dict[Path, bytes] = field(default_factory=dict)

    def keep(self, path: Path) -> None:
        """A file that must be byte-identical when the scenario ends."""
        self.siblings[path] = path.read_bytes()

    def recovered(self, seconds: float) -> None:
        self.recovery_s = seconds if self.recovery_s is None else max(self.recovery_s, seconds)


def device_identity(path: Path = KVM) -> tuple[int, int, int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_mode, st.st_uid, st.st_gid, st.st_rdev


_CURRENT: list[str] = [""]


@pytest.fixture(autouse=True)
def _current_test(request: pytest.FixtureRequest) -> None:
    _CURRENT[0] = request.node.nodeid


@contextlib.contextmanager
def scenario(name: str) -> Iterator[Row]:
    """One row: FAIL with the error when the body raises; preservation checked on the way out."""
    row = Row(name)
    before = device_identity()
    try:
        yield row
        for path, content in row.siblings.items():
            assert path.read_bytes() == content, f"sibling {path} changed"
        assert device_identity() == before, f"{KVM} mode, owner or numbers changed"
        row.facts["preserved"] = f"{len(row.siblings)} sibling(s), {KVM}"
    except pytest.skip.Exception as exc:
        row.result = "skipped"
        row.facts["why"] = str(exc)
        raise
    except BaseException as exc:
        row.result = "FAIL"
        row.facts["error"] = f"{type(exc).__name__}: {exc}"[:300]
        raise
    finally:
        ROWS.append({"test": _CURRENT[0], "scenario": row.scenario, "result": row.result,
                     "recovery_s": None if row.recovery_s is None else round(row.recovery_s, 4),
                     "facts": row.facts})


def _format_table(rows: list[dict[str, Any]]) -> str:
    def recovery(row: dict[str, Any]) -> str:
        value = row["recovery_s"]
        if value is None:
            return "-"
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"

    def facts(row: dict[str, Any]) -> str:
        return "; ".join(f"{k}={v}" for k, v in row["facts"].items() if k != "preserved")

    header = ("scenario", "result", "recovery", "facts")
    lines = [(r["scenario"], r["result"], recovery(r), facts(r)) for r in rows]
    widths = [max(len(str(x[i])) for x in [header, *lines]) for i in range(3)]
    out = []
    for cells in [header, (*("-" * w for w in widths), "-----"), *lines]:
        out.append("  ".join(str(c).ljust(w) for c, w in zip(cells[:3], widths, strict=True))
                   + "  " + cells[3])
    return "\n".join(out)


@pytest.fixture(scope="module", autouse=True)
def fault_report(request: pytest.FixtureRequest) -> Iterator[None]:
    """Print the matrix and write it as JSON once every row of the module has run."""
    yield
    ran = {r["test"] for r in ROWS}
    for item in request.session.items:
        if item.path == Path(__file__) and item.nodeid not in ran:
            skip = item.get_closest_marker("skipif")
            reason = skip.kwargs.get("reason", "skipped") if skip else "not run (deselected or skipped)"
            ROWS.append({"test": item.nodeid, "scenario": item.name, "result": "skipped",
                         "recovery_s": None, "facts": {"why": reason}})
    if not ROWS:
        return
    failed = [r for r in ROWS if r["result"] == "FAIL"]
    checked = [r for r in ROWS if r["result"] != "skipped"]
    preserved = [r for r in checked if "preserved" in r["facts"]]
    summary = {"scenario": "Preservation (after every scenario above)",
               "result": "pass" if len(preserved) == len(checked) else "FAIL",
               "recovery_s": None,
               "facts": {"checked": f"{len(preserved)}/{len(checked)} scenarios",
                         "what": "sibling CDI spec bytes; /dev/kvm mode, uid, gid, rdev"}}
    rows = [*ROWS, summary]
    report = {
        "machine": {"nproc": os.cpu_count(), "kernel": os.uname().release,
                    "python": sys.version.split()[0], "root": IS_ROOT, "kvm": HAVE_KVM},
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "rows": rows,
        "failed": len(failed),
    }
    target = Path(os.environ.get("HLPLUGIN_FAULT_REPORT")
                  or Path(__file__).resolve().parents[1] / "fault-matrix.json")
    target.write_text(json.dumps(report, indent=2) + "\n")
    text = f"\n\nFault matrix ({len(rows)} rows, {len(failed)} failed; JSON: {target})\n"
    text += _format_table(rows) + "\n"
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(text, flush=True)


# --- the world -----------------------------------------------------------------------------------


def fresh_node(root: Path, *, dev: bool = False) -> Node:
    """A node root; with ``dev`` its own dev and host-dev dirs holding mknod'd KVM nodes."""
    if not dev:
        return Node.make(root)
    dev_dir, host_dir = root / "dev", root / "host-dev"
    for d in (dev_dir, host_dir):
        d.mkdir(parents=True)
        if os.statvfs(d).f_flag & os.ST_NODEV:
            pytest.skip(f"{d} is on a nodev filesystem")
        os.mknod(d / "kvm", stat.S_IFCHR | 0o600, KVM_RDEV)
    return Node.make(root, dev_dir, host_dir)


def add_sibling(cdi_dir: Path, row: Row) -> Path:
    cdi_dir.mkdir(parents=True, exist_ok=True)
    sibling = cdi_dir / "vendor-gpu.json"
    sibling.write_bytes(SIBLING)
    row.keep(sibling)
    return sibling


def replace_atomically(path: Path, make: Callable[[Path], None]) -> None:
    """Put a new entry at ``path`` with one rename: the daemon sees the old or the new, never a gap."""
    temp = path.with_name(f".fault-{os.getpid()}-{random.randrange(1 << 30)}")
    make(temp)
    os.rename(temp, path)


def write_atomically(path: Path, content: bytes) -> None:
    replace_atomically(path, lambda p: p.write_bytes(content))


def mknod_atomically(path: Path, rdev: int) -> None:
    replace_atomically(path, lambda p: os.mknod(p, stat.S_IFCHR | 0o600, rdev))


def obstruct(path: Path, make: Callable[[Path], None]) -> None:
    """Replace our file by something that is not a regular file, racing the daemon's repairs."""
    deadline = time.monotonic() + GUARD
    while True:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        try:
            make(path)
            return
        except FileExistsError:  # the daemon repaired in between: again
            assert time.monotonic() < deadline, "could not obstruct"


def remove_obstruction(path: Path) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        os.rmdir(path)
    else:
        os.unlink(path)


def temp_files(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(TEMP_PREFIX))


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def mounted(target: Path, *argv: str) -> Iterator[Path]:
    target.mkdir(parents=True, exist_ok=True)
    try:
        sh("mount", *argv, str(target))
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"mount {' '.join(argv)} failed: {exc.stderr.decode().strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False, capture_output=True, timeout=30)


def fill(path: Path) -> None:
    """Write zeros to ``path`` until the filesystem has no block left."""
    with open(path, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 1024)


def overwrite(path: Path, content: bytes) -> None:
    """Rewrite ``path`` in place from offset 0 (no truncation, no new inode)."""
    with open(path, "r+b", buffering=0) as f:
        f.write(content)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- readers and tamperers in their own processes ------------------------------------------------

_WORKER = r"""
import json, os, sys, time
mode, path, stop = sys.argv[1], sys.argv[2], sys.argv[3]
contents = {name: open(os.path.join(sys.argv[4], name), "rb").read() for name in os.listdir(sys.argv[4])}
if mode == "read":
    label = {data: name for name, data in contents.items()}
    counts, odd = {}, []
    while not os.path.exists(stop):
        for _ in range(500):
            try:
                with open(path, "rb") as f:
                    data = f.read()
                key = label.get(data, "torn")
                if key == "torn" and len(odd) < 5:
                    odd.append(data[:120].decode(errors="replace"))
            except OSError as exc:
                key = "error " + (exc.strerror or str(exc))
            counts[key] = counts.get(key, 0) + 1
    print(json.dumps({"counts": counts, "odd": odd}))
else:
    stale, n = contents["stale"], 0
    temp = os.path.join(os.path.dirname(path), ".tamper-%d" % os.getpid())
    while not os.path.exists(stop):
        with open(temp, "wb") as f:
            f.write(stale)
        os.rename(temp, path)
        n += 1
        time.sleep(float(sys.argv[5]))
    print(json.dumps({"tampered": n}))
"""


class Workers:
    """Reader processes that classify every read of a file, and optionally a tamperer."""

    def __init__(self, root: Path, path: Path, contents: dict[str, bytes]) -> None:
        self.path = path
        self.stop_file = root / "workers.stop"
        self.known = root / "workers.known"
        self.known.mkdir()
        for name, data in contents.items():
            (self.known / name).write_bytes(data)
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, mode: str, count: int = 1, pause: float = 0.0) -> None:
        for _ in range(count):
            argv = [sys.executable, "-c", _WORKER, mode, str(self.path), str(self.stop_file),
                    str(self.known), str(pause)]
            self.procs.append((mode, subprocess.Popen(argv, stdout=subprocess.PIPE)))

    def finish(self) -> dict[str, Any]:
        self.stop_file.touch()
        counts: dict[str, int] = {}
        odd: list[str] = []
        tampered = 0
        for _mode, proc in self.procs:
            out, _ = proc.communicate(timeout=30)
            result = json.loads(out)
            tampered += result.get("tampered", 0)
            odd += result.get("odd", [])
            for key, value in result.get("counts", {}).items():
                counts[key] = counts.get(key, 0) + value
        return {"counts": counts, "odd": odd, "tampered": tampered}

    def kill(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# --- the rig: a kubelet emulator and the daemon as a process -------------------------------------


class Rig:
    def __init__(self, node: Node, *extra: str, count: int = COUNT,
                 kubelet: KubeletEmulator | None = None) -> None:
        self.node = node
        self.extra = ("--hypervisor", "kvm", "--device-count", str(count), *extra)
        self.count = count
        self.kubelet = kubelet or KubeletEmulator(node.plugin_dir)
        self.proc: Daemon | None = None

    @property
    def spec(self) -> Path:
        return self.node.cdi_dir / SPEC_FILE

    @property
    def pid(self) -> int:
        assert self.proc is not None and self.proc.proc is not None
        return self.proc.proc.pid

    async def start(self, *, kubelet: bool = True) -> Rig:
        if kubelet:
            await self.kubelet.start()
        await self.start_daemon()
        return self

    async def start_daemon(self) -> Daemon:
        self.proc = await Daemon(self.node.serve_args(*self.extra)).start()
        return self.proc

    def dump(self) -> None:
        """On failure: the daemon's last log lines and exit status, for whoever reads the report."""
        if self.proc is not None and self.proc.proc is not None:
            print(f"--- hlplugin serve (pid {self.proc.proc.pid}, exit {self.proc.proc.returncode}), "
                  "last log lines:", *self.proc.raw[-40:], sep="\n", file=sys.stderr)

    async def close(self) -> None:
        if self.proc is not None and self.proc.proc is not None and self.proc.proc.returncode is None:
            try:
                await self.proc.stop()
            finally:
                if self.proc.proc.returncode is None:
                    self.proc.proc.kill()
                    await self.proc.proc.wait()
        await self.kubelet.stop()

    async def wait(self, predicate: Callable[[], bool], timeout: float = GUARD) -> float:
        """Seconds until ``predicate`` held (woken by the emulator, else every 50 ms)."""
        began = time.monotonic()
        await self.kubelet.wait_for(predicate, timeout)
        return time.monotonic() - began

    async def healthy(self, timeout: float = GUARD) -> float:
        return await self.wait(lambda: self.kubelet.allocatable(RESOURCE) == self.count, timeout)

    async def withdrawn(self, timeout: float = GUARD) -> float:
        return await self.wait(lambda: self.kubelet.capacity(RESOURCE) == self.count
                               and self.kubelet.allocatable(RESOURCE) == 0, timeout)

    async def admit(self) -> None:
        """A fresh allocation: admitted with the CDI reference, and the spec on disk is exact."""
        response = await self.kubelet.admit(RESOURCE)
        assert [d.name for d in response.container_responses[0].cdi_devices] == [CDI_NAME]
        assert self.spec.read_bytes() == DESIRED

    async def refused(self, *names: str) -> str:
        """A raw Allocate (the kubelet would not even try) is refused, naming why."""
        with pytest.raises(AdmissionError) as refused:
            await self.kubelet.allocate(RESOURCE, [["kvm-0"]])
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION, refused.value
        details = refused.value.details
        assert REASON.search(details), details
        for name in names:
            assert name in details, (name, details)
        return details

    async def readiness(self, status: int) -> dict[str, Any]:
        assert self.proc is not None
        body: dict[str, Any] = json.loads(await self.proc.wait_http("/readyz", status))
        return body

    async def metric(self, sample: str) -> float:
        """One sample of /metrics, e.g. 'hyperlight_registrations_total{result="failure"}'."""
        assert self.proc is not None
        code, body = await self.proc.http("/metrics")
        if code != 200:
            return 0.0  # not serving yet
        for line in body.decode().splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
        return 0.0

    async def live(self) -> None:
        assert self.proc is not None
        code, body = await self.proc.http("/healthz")
        assert code == 200, body

    async def repairs(self) -> dict[str, float]:
        """CDI repairs by cause, from this process's /metrics (the one at its start included)."""
        assert self.proc is not None
        code, body = await self.proc.http("/metrics")
        if code != 200:
            return {}  # not serving yet
        prefix = 'hyperlight_cdi_repairs_total{cause="'
        return {line[len(prefix):].split('"', 1)[0]: float(line.split()[-1])
                for line in body.decode().splitlines() if line.startswith(prefix)}


@contextlib.asynccontextmanager
async def rig(node: Node, *extra: str, count: int = COUNT, start: bool = True,
              kubelet: KubeletEmulator | None = None) -> AsyncIterator[Rig]:
    r = Rig(node, *extra, count=count, kubelet=kubelet)
    try:
        if start:
            await r.start()
            await r.healthy()
        yield r
    except BaseException:
        r.dump()
        raise
    finally:
        await r.close()


async def until(predicate: Callable[[], bool], timeout: float = GUARD, step: float = 0.001) -> float:
    """Seconds until ``predicate`` held, polled every ``step`` (file state has no emulator event)."""
    began = time.monotonic()
    while not predicate():
        assert time.monotonic() - began < timeout, "guard timeout"
        await asyncio.sleep(step)
    return time.monotonic() - began


def spec_is_exact(path: Path) -> bool:
    try:
        st = os.lstat(path)
        return stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644 \
            and path.read_bytes() == DESIRED
    except OSError:
        return False


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


# --- CDI content ---------------------------------------------------------------------------------

TAMPER: dict[str, Callable[[Path], None]] = {
    "missing": os.unlink,
    "stale": lambda p: write_atomically(p, STALE),
    "malformed": lambda p: write_atomically(p, MALFORMED),
}


@needs_kvm
@pytest.mark.parametrize("kind", list(TAMPER))
def test_cdi_missing_stale_malformed_is_repaired_exactly(tmp_path: Path, kind: str) -> None:
    async def body() -> None:
        with scenario(f"CDI {kind}") as row:
            node = fresh_node(tmp_path)
            add_sibling(node.cdi_dir, row)
            async with rig(node) as r:
                assert r.spec.read_bytes() == DESIRED
                before = await r.repairs()
                times = []
                for _ in range(5):
                    TAMPER[kind](r.spec)
                    times.append(await until(lambda: spec_is_exact(r.spec)))
                    await r.admit()
                # The file is renamed into place a moment before the counter moves: poll it.
                began = time.monotonic()
                while True:
                    after = await r.repairs()
                    delta = {c: after[c] - before.get(c, 0) for c in after
                             if after[c] != before.get(c)}
                    if sum(delta.values()) >= 5 or time.monotonic() - began > GUARD:
                        break
                    await asyncio.sleep(0.01)
                assert delta == {kind: 5}, delta  # each repair counted under its own cause
                assert temp_files(node.cdi_dir) == []
                assert r.kubelet.register_calls == 1  # repaired in place, no restart
                row.recovered(max(times))
                row.facts.update(median_ms=round(median(times) * 1000, 1), repairs=5,
                                 cause_counted=kind, exact="byte-identical to `hlplugin cdi`")

    run(body())


# --- non-regular CDI path ------------------------------------------------------------------------

OBSTRUCTIONS: dict[str, tuple[Callable[[Path], None], str]] = {
    "directory": (os.mkdir, "a directory"),
    "symlink": (lambda p: os.symlink("vendor-gpu.json", p), "a symlink"),
    "FIFO": (os.mkfifo, "a FIFO"),
}


@needs_kvm
@pytest.mark.parametrize("kind", list(OBSTRUCTIONS))
def test_non_regular_cdi_path_withdraws_and_recovers_without_restart(tmp_path: Path,
                                                                     kind: str) -> None:
    make, described = OBSTRUCTIONS[kind]

    async def body() -> None:
        with scenario(f"Non-regular CDI path: {kind}") as row:
            node = fresh_node(tmp_path)
            add_sibling(node.cdi_dir, row)  # the symlink points here: never written through
            async with rig(node) as r:
                pid = r.pid
                obstruct(r.spec, make)
                await r.withdrawn()
                ready = await r.readiness(503)
                assert not ready["conditions"]["cdi"]["ok"]
                assert described in ready["conditions"]["cdi"]["reason"]
                await r.live()
                await r.refused("cdi", described)
                assert os.lstat(r.spec).st_mode != 0 and not spec_is_exact(r.spec)  # untouched
                await asyncio.sleep(0.3)  # retries with backoff meanwhile, still refusing
                assert not stat.S_ISREG(os.lstat(r.spec).st_mode)
                remove_obstruction(r.spec)
                row.recovered(await r.healthy())
                await r.readiness(200)
                await r.admit()
                assert r.pid == pid and r.proc is not None and r.proc.proc is not None
                assert r.proc.proc.returncode is None  # no restart
                row.facts.update(refused=f"FAILED_PRECONDITION ({described})", readyz=503,
                                 healthz=200, restarts=0)

    run(body())


# --- read-only CDI storage -----------------------------------------------------------------------


@needs_kvm
@needs_root
def test_read_only_cdi_storage_fails_readiness_keeps_liveness_and_recovers(tmp_path: Path) -> None:
    """Our view of the CDI dir is a bind mount that turns read-only; someone deletes the spec
    through the writable host path. Repair fails; writable again recovers without a restart."""

    async def body() -> None:
        node = fresh_node(tmp_path)
        store = tmp_path / "cdi-store"
        store.mkdir()
        with mounted(node.cdi_dir, "--bind", str(store)), scenario("Read-only CDI storage") as row:
            add_sibling(node.cdi_dir, row)
            async with rig(node) as r:
                pid = r.pid
                sh("mount", "-o", "remount,bind,ro", str(node.cdi_dir))
                (store / SPEC_FILE).unlink()
                await r.withdrawn()
                ready = await r.readiness(503)
                assert "Read-only file system" in ready["conditions"]["cdi"]["reason"]
                await r.live()
                await r.refused("cdi", "Read-only file system")
                await asyncio.sleep(1.0)  # it keeps retrying and failing
                assert not (store / SPEC_FILE).exists() and temp_files(store) == []
                sh("mount", "-o", "remount,bind,rw", str(node.cdi_dir))
                row.recovered(await r.healthy())
                assert spec_is_exact(r.spec)
                await r.readiness(200)
                await r.admit()
                assert r.pid == pid
                row.facts.update(refused="FAILED_PRECONDITION (EROFS)", readyz=503, healthz=200,
                                 restarts=0, note="recovery waits for the retry backoff")

    run(body())


# --- host identity -------------------------------------------------------------------------------

IDENTITY_FAULTS: dict[str, tuple[Callable[[Path], None], str]] = {
    "removed": (os.unlink, "is missing"),
    "regular file": (lambda p: write_atomically(p, b"not a device\n"), "a regular file"),
    "other numbers": (lambda p: mknod_atomically(p, NULL_RDEV), "is 1:3"),
}


@needs_kvm
@needs_root
@pytest.mark.parametrize("kind", list(IDENTITY_FAULTS))
def test_missing_host_identity_withdraws_capacity_and_recovers(tmp_path: Path, kind: str) -> None:
    fault, described = IDENTITY_FAULTS[kind]

    async def body() -> None:
        with scenario(f"Missing host identity: {kind}") as row:
            node = fresh_node(tmp_path, dev=True)
            add_sibling(node.cdi_dir, row)
            host = node.host_dev_dir / "kvm"
            async with rig(node) as r:
                pid = r.pid
                fault(host)
                await r.withdrawn()
                ready = await r.readiness(503)
                assert described in ready["conditions"]["host_identity"]["reason"]
                assert ready["conditions"]["device"]["ok"]  # our own device still works
                await r.refused("host_identity", described)
                mknod_atomically(host, KVM_RDEV)
                row.recovered(await r.healthy())
                await r.admit()
                assert r.pid == pid
                row.facts.update(withdrawn="allocatable 0", refused="FAILED_PRECONDITION",
                                 restarts=0)

    run(body())


# --- existing unusable device --------------------------------------------------------------------


@needs_kvm
@needs_root
def test_existing_unusable_device_is_refused_and_recovers(tmp_path: Path) -> None:
    """/dev/null's numbers at the device path, and the host view agreeing: the node exists and
    the identity matches, only the KVM check can tell."""

    async def body() -> None:
        with scenario("Existing unusable device") as row:
            node = fresh_node(tmp_path, dev=True)
            add_sibling(node.cdi_dir, row)
            dev, host = node.dev_dir / "kvm", node.host_dev_dir / "kvm"
            async with rig(node) as r:
                mknod_atomically(host, NULL_RDEV)
                mknod_atomically(dev, NULL_RDEV)
                await r.withdrawn()
                ready = await r.readiness(503)
                assert ready["conditions"]["host_identity"]["ok"]
                assert "KVM_GET_API_VERSION" in ready["conditions"]["device"]["reason"]
                details = await r.refused("device", "KVM_GET_API_VERSION")
                mknod_atomically(dev, KVM_RDEV)
                began = time.monotonic()
                mknod_atomically(host, KVM_RDEV)
                await r.healthy()
                row.recovered(time.monotonic() - began)
                await r.admit()
                reason = re.sub(r" on \S+", "", details.split("device: ", 1)[-1])
                row.facts.update(refused=f"FAILED_PRECONDITION ({reason})")

    run(body())


# --- registration failures -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["no kubelet.sock", "never answers", "resets connections"])
def test_registration_failure_is_bounded_then_recovers(tmp_path: Path, kind: str) -> None:
    mode = {"no kubelet.sock": None, "never answers": "hang", "resets connections": "reset"}[kind]
    timeout = 0.5

    async def body() -> None:
        with scenario(f"Registration failure: {kind}") as row:
            node = fresh_node(tmp_path)
            broken = KubeletEmulator(node.plugin_dir, mode=mode) if mode else None
            if broken is not None:
                await broken.start()
            r = Rig(node, "--register-timeout", str(timeout))
            try:
                began = time.monotonic()
                await r.start_daemon()
                assert r.proc is not None
                if broken is not None:
                    # Several bounded attempts: each ends within the timeout (plus backoff).
                    failed = 'hyperlight_registrations_total{result="failure"}'
                    while (failures := await r.metric(failed)) < 3:
                        assert time.monotonic() - began < GUARD, f"{failures} failed attempts"
                        await asyncio.sleep(0.05)
                    attempts = time.monotonic() - began
                    row.facts["attempts"] = f"{failures:.0f} failed in {attempts:.1f}s"
                    logged = [m for m in r.proc.messages() if "registration of" in m]
                    assert logged, "the failure was not logged"
                    if mode == "hang":
                        assert "DEADLINE_EXCEEDED" in logged[0], logged
                        assert broken.register_calls >= 3
                else:
                    await until(lambda: (node.plugin_dir / SOCKET).exists(), step=0.01)
                    await asyncio.sleep(1.0)
                ready = await r.readiness(503)
                assert not ready["conditions"]["registered"]["ok"]
                await r.live()
                if broken is not None:
                    await broken.stop(remove_socket=True)
                began = time.monotonic()
                await r.kubelet.start()
                await r.healthy()
                row.recovered(time.monotonic() - began)
                await r.readiness(200)
                await r.admit()
                row.facts.update(readyz=503, healthz=200, register_timeout=f"{timeout}s")
            except BaseException:
                r.dump()
                raise
            finally:
                if broken is not None:
                    await broken.stop(remove_socket=False)
                await r.close()

    run(body())


# --- restarts ------------------------------------------------------------------------------------


class SpecWatch:
    """A thread that reads the spec every millisecond and counts anything but the exact bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reads = 0
        self.bad: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.path.read_bytes()
                if data != DESIRED:
                    self.bad.append(f"content {data[:40]!r}")
            except OSError as exc:
                self.bad.append(str(exc))
            self.reads += 1
            time.sleep(0.001)

    def __enter__(self) -> SpecWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


@needs_kvm
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_plugin_restart_re_registers_and_keeps_the_spec(tmp_path: Path, signum: int) -> None:
    name = signal.Signals(signum).name

    async def body() -> None:
        with scenario(f"Plugin restart: {name}") as row:
            node = fresh_node(tmp_path)
            add_sibling(node.cdi_dir, row)
            async with rig(node) as r:
                times = []
                with SpecWatch(r.spec) as watch:
                    for _ in range(3):
                        assert r.proc is not None
                        await r.proc.signal(signum)
                        await r.wait(lambda: r.kubelet.allocatable(RESOURCE) == 0)
                        assert spec_is_exact(r.spec)
                        if signum == signal.SIGKILL:
                            assert (node.plugin_dir / SOCKET).exists()  # stale, left behind
                        began = time.monotonic()
                        await r.start_daemon()
                        await r.healthy()
                        times.append(time.monotonic() - began)
                        await r.admit()
                assert watch.bad == [] and watch.reads > 100
                row.recovered(max(times))
                row.facts.update(restarts=3, start_to_registered_median_s=round(median(times), 3),
                                 spec_reads_during=watch.reads, spec_read_errors=0)

    run(body())


@needs_kvm
def test_kubelet_restart_re_registers_quickly(tmp_path: Path) -> None:
    async def body() -> None:
        with scenario("Kubelet restart") as row:
            node = fresh_node(tmp_path)
            add_sibling(node.cdi_dir, row)
            async with rig(node) as r:
                times = []
                for _ in range(5):
                    calls = r.kubelet.register_calls
                    began = time.monotonic()
                    await r.kubelet.restart()  # deletes every socket, serves kubelet.sock anew
                    await r.wait(lambda c=calls: r.kubelet.register_calls > c
                                 and r.kubelet.allocatable(RESOURCE) == r.count)
                    times.append(time.monotonic() - began)
                    await r.admit()
                row.recovered(median(times))
                row.facts.update(restarts=5, re_registered_max_ms=round(max(times) * 1000, 1),
                                 upstream_go="5.01 s")

    run(body())


# --- atomic replacement during allocation ---------------------------------------------------------


@needs_kvm
def test_atomic_replacement_during_allocation(tmp_path: Path) -> None:
    """Readers in other processes read the spec non-stop while it is tampered with and Allocate
    repairs it: every read is a complete desired, stale or malformed file (the tamperer's own
    atomic writes), never torn, empty or missing."""

    async def body() -> None:
        with scenario("Atomic replacement during allocation") as row:
            node = fresh_node(tmp_path)
            add_sibling(node.cdi_dir, row)
            async with rig(node) as r:
                workers = Workers(tmp_path, r.spec, {"desired": DESIRED, "stale": STALE,
                                                     "malformed": MALFORMED})
                try:
                    workers.start("read", count=2)
                    await asyncio.sleep(0.3)
                    times = []
                    began = time.monotonic()
                    cycles = 0
                    while cycles < 200 or time.monotonic() - began < 4.0:
                        write_atomically(r.spec, STALE if cycles % 2 else MALFORMED)
                        t0 = time.monotonic()
                        response = await r.kubelet.allocate(RESOURCE, [[f"kvm-{cycles % COUNT}"]])
                        times.append(time.monotonic() - t0)
                        assert response.container_responses[0].cdi_devices[0].name == CDI_NAME
                        # Repaired before the answer: the runtime will read the exact spec.
                        assert r.spec.read_bytes() == DESIRED
                        cycles += 1
                        await asyncio.sleep(0.005)
                    result = workers.finish()
                finally:
                    workers.kill()
                counts = result["counts"]
                reads = sum(counts.values())
                assert set(counts) <= {"desired", "stale", "malformed"}, result
                assert reads > 100_000, counts
                assert temp_files(node.cdi_dir) == []
                row.recovered(median(times))
                row.facts.update(reads=reads, complete=reads, torn=0, errors=0,
                                 allocations=cycles, allocate_p_max_ms=round(max(times) * 1000, 1),
                                 upstream_go="6,813 reads, repair after 2.93 s")

    run(body(), timeout=120)


# --- preservation --------------------------------------------------------------------------------


@needs_kvm
def test_preservation_of_foreign_files_and_the_real_device(tmp_path: Path) -> None:
    """Everything in the CDI dir that is not ours stays byte-identical (and the same inode)
    through repairs, obstructions and restarts; the real /dev/kvm keeps its mode, owner, numbers."""

    async def body() -> None:
        with scenario("Preservation: foreign CDI files, real device") as row:
            node = fresh_node(tmp_path)
            cdi = node.cdi_dir
            sibling = add_sibling(cdi, row)
            (cdi / "hyperlight.json.bak").write_bytes(STALE)
            (cdi / "hyperlight.yaml").write_bytes(b"cdiVersion: 0.3.0\n")
            (cdi / "vendor-dir").mkdir()
            (cdi / "vendor-dir" / "nested.json").write_bytes(SIBLING)
            os.symlink(sibling.name, cdi / "vendor-link.json")
            for name in ("hyperlight.json.bak", "hyperlight.yaml", "vendor-dir/nested.json"):
                row.keep(cdi / name)
            before = {n: os.lstat(cdi / n) for n in os.listdir(cdi)}
            async with rig(node) as r:
                for kind in TAMPER:
                    TAMPER[kind](r.spec)
                    await until(lambda: spec_is_exact(r.spec))
                obstruct(r.spec, os.mkdir)
                await r.withdrawn()
                remove_obstruction(r.spec)
                await r.healthy()
                for signum in (signal.SIGTERM, signal.SIGKILL):
                    assert r.proc is not None
                    await r.proc.signal(signum)
                    await r.start_daemon()
                    await r.healthy()
                await r.admit()
            for name, st in before.items():
                now = os.lstat(cdi / name)
                assert (now.st_ino, now.st_mode, now.st_mtime_ns) == (
                    st.st_ino, st.st_mode, st.st_mtime_ns), name
            assert os.readlink(cdi / "vendor-link.json") == sibling.name
            assert sorted(os.listdir(cdi)) == sorted([*before, SPEC_FILE])
            row.facts.update(foreign_entries=len(before), unchanged="bytes, inode, mode, mtime",
                             faults="missing, stale, malformed, directory, SIGTERM, SIGKILL")

    run(body())


# --- beyond the upstream Go plugin's validation --------------------------------------------------


@needs_kvm
@needs_root
def test_enospc_on_cdi_storage_fails_cleanly_and_recovers(tmp_path: Path) -> None:
    """A 16 KiB tmpfs filled to the last block: the repair's temp file cannot be written. No
    temp file is left, the old spec is never truncated, and freeing space recovers."""

    async def body() -> None:
        node = fresh_node(tmp_path)
        with mounted(node.cdi_dir, "-t", "tmpfs", "-o", "size=16k,mode=0755", "tmpfs"), \
                scenario("ENOSPC on CDI storage") as row:
            add_sibling(node.cdi_dir, row)
            async with rig(node) as r:
                filler = node.cdi_dir / "filler"
                fill(filler)
                assert os.statvfs(node.cdi_dir).f_bavail == 0
                # Stale in place: same length, so no new block (uid 65534 -> 65533).
                stale = DESIRED.replace(b"65534", b"65533", 1)
                assert len(stale) == len(DESIRED)
                overwrite(r.spec, stale)
                await r.withdrawn()
                ready = await r.readiness(503)
                assert "No space left on device" in ready["conditions"]["cdi"]["reason"]
                await r.live()
                await r.refused("cdi", "ENOSPC")
                await asyncio.sleep(0.5)
                assert temp_files(node.cdi_dir) == []
                assert r.spec.read_bytes() == stale  # never truncated
                filler.unlink()
                row.recovered(await r.healthy())
                assert spec_is_exact(r.spec)
                await r.admit()
                row.facts.update(refused="FAILED_PRECONDITION (ENOSPC)", temp_left=0,
                                 old_spec_intact=True, note="recovery waits for the retry backoff")

    run(body())


@needs_kvm
@needs_root
def test_probe_helper_that_hangs_is_bounded(tmp_path: Path) -> None:
    """The device view sits on a filesystem that stops answering (FUSE, served here): the check's
    helper thread blocks in the kernel on stat/open of the node. The daemon stays live, refuses
    within its budget naming the timeout, never runs a second helper, recovers once the
    filesystem answers, and reacts to SIGTERM at once with a helper stuck (the process is reaped
    when the kernel releases that thread: nothing in user space can kill it sooner)."""
    budget = 1.0

    async def body() -> None:
        node = fresh_node(tmp_path, dev=True)
        with HangingDevFs(tmp_path / "fuse-dev", KVM_RDEV) as fs, \
                scenario("Probe helper hangs (stuck filesystem)") as row:
            add_sibling(node.cdi_dir, row)
            node = Node(node.root, node.plugin_dir, node.cdi_dir, fs.mountpoint, node.host_dev_dir)
            async with rig(node, "--probe-timeout", str(budget), "--health-interval", "3") as r:
                try:
                    await r.admit()
                    fs.hang()
                    await r.withdrawn()
                    # The next checks find the helper still stuck and do not start another.
                    hung = time.monotonic()
                    while True:
                        ready = await r.readiness(503)
                        if "still stuck" in ready["conditions"]["device"]["reason"]:
                            break
                        assert time.monotonic() - hung < GUARD
                        await asyncio.sleep(0.05)
                    assert any("check timed out" in m for m in r.proc.messages()), "no timeout"
                    refusals = []
                    for _ in range(4):
                        # Health older than 1 s: this Allocate asks for a check of its own, which
                        # waits at most its budget for the stuck helper, then refuses.
                        await asyncio.sleep(1.1)
                        t0 = time.monotonic()
                        await r.refused("still stuck")
                        refusals.append(time.monotonic() - t0)
                        await r.live()
                    # Every helper ever started blocks in a request of ours: one in all, not one
                    # per check.
                    helpers = fs.pending
                    assert helpers == 1, helpers
                    stuck_for = time.monotonic() - hung
                    fs.release()
                    row.recovered(await r.healthy())
                    await r.admit()
                    # Stuck again, then SIGTERM: the daemon stops at once; the process itself can
                    # only be reaped when the kernel lets the stuck thread go.
                    fs.hang()
                    await r.withdrawn()
                    assert r.proc is not None and r.proc.proc is not None
                    t0 = time.monotonic()
                    r.proc.proc.send_signal(signal.SIGTERM)
                    # Stopped serving: its socket is gone (the process itself lingers, see above).
                    await until(lambda: not (node.plugin_dir / SOCKET).exists(), step=0.005)
                    stopping = time.monotonic() - t0
                    fs.release()
                    assert await r.proc.stop() == 0
                finally:
                    fs.release()
                row.facts.update(budget_s=budget, stuck_for_s=round(stuck_for, 1),
                                 refusal_max_s=round(max(refusals), 2), stuck_helpers=helpers,
                                 healthz=200, sigterm_to_socket_gone_s=round(stopping, 3),
                                 note="recovery found by the periodic check (--health-interval 3); "
                                      "a thread stuck in the kernel keeps the process from exiting "
                                      "until the filesystem answers")

    run(body(), timeout=120)


@needs_kvm
def test_sigkill_in_the_middle_of_repairs_leaves_no_temp_file_nor_torn_spec(tmp_path: Path) -> None:
    """A tamperer rewrites the spec stale every millisecond, so the daemon is always repairing;
    it is SIGKILLed again and again. Readers never see anything but a complete file; temp files a
    kill leaves behind are removed by the next start."""

    async def body() -> None:
        with scenario("SIGKILL in the middle of CDI repairs") as row:
            node = fresh_node(tmp_path)
            add_sibling(node.cdi_dir, row)
            node.cdi_dir.mkdir(exist_ok=True)
            async with rig(node) as r:
                workers = Workers(tmp_path, r.spec, {"desired": DESIRED, "stale": STALE})
                kills = leftovers = 0
                try:
                    workers.start("read", count=1)
                    workers.start("tamper", pause=0.001)
                    for _ in range(12):
                        assert r.proc is not None
                        # Killed while busy: after it has repaired the tamperer's writes a few times.
                        deadline = time.monotonic() + GUARD
                        while sum((await r.repairs()).values()) < 4:
                            assert time.monotonic() < deadline, "no repairs"
                            await asyncio.sleep(0.005)
                        await asyncio.sleep(random.uniform(0, 0.02))
                        await r.proc.signal(signal.SIGKILL)
                        kills += 1
                        leftovers += len(temp_files(node.cdi_dir))
                        await r.start_daemon()
                    result = workers.finish()
                finally:
                    workers.kill()
                began = time.monotonic()
                await r.healthy()
                await until(lambda: spec_is_exact(r.spec))
                row.recovered(time.monotonic() - began)
                assert temp_files(node.cdi_dir) == []
                await r.admit()
                counts = result["counts"]
                assert set(counts) <= {"desired", "stale"}, result
                row.facts.update(kills=kills, temp_files_left_by_kills=leftovers,
                                 temp_files_after_restart=0, reads=sum(counts.values()),
                                 torn=0, tampered=result["tampered"])

    run(body(), timeout=150)


@needs_kvm
@needs_root
def test_inotify_flood_costs_nothing_wrong(tmp_path: Path) -> None:
    """10,000 events across every watched directory (foreign names, our spec's attributes, the
    kubelet's checkpoint): no re-registration, no health flap, no rewrite, Allocate keeps working,
    and a real tamper afterwards is still repaired at once."""

    async def body() -> None:
        with scenario("inotify flood (10,000 events)") as row:
            node = fresh_node(tmp_path, dev=True)
            add_sibling(node.cdi_dir, row)
            async with rig(node) as r:
                resource = r.kubelet.resources[RESOURCE]
                lists, calls = resource.lists_received, r.kubelet.register_calls
                inode = os.stat(r.spec).st_ino
                repairs = await r.repairs()
                cpu = cpu_seconds(r.pid)

                def flood() -> int:
                    events = 0
                    for i in range(1000):  # cdi dir: 4,000 events on foreign names
                        for d in (node.cdi_dir, node.dev_dir):
                            f = d / f"foreign-{i}"
                            f.touch()          # CREATE (+ ATTRIB-free: new file)
                            f.unlink()         # DELETE
                            events += 2
                        os.utime(r.spec)       # ATTRIB on our own file
                        checkpoint = node.plugin_dir / "kubelet_internal_checkpoint"
                        temp = node.plugin_dir / f".checkpoint-{i}"
                        temp.write_bytes(b"{}")  # CREATE, MODIFY, CLOSE_WRITE
                        os.rename(temp, checkpoint)  # MOVED_FROM, MOVED_TO
                        events += 6
                    return events

                job = asyncio.create_task(asyncio.to_thread(flood))
                allocations = 0
                while not job.done():
                    await r.kubelet.allocate(RESOURCE, [["kvm-1"]])
                    allocations += 1
                    await asyncio.sleep(0.01)
                events = await job
                await asyncio.sleep(0.5)
                used = cpu_seconds(r.pid) - cpu
                assert events >= 10_000
                assert r.kubelet.register_calls == calls and r.kubelet.registered(RESOURCE)
                assert resource.lists_received == lists  # health never flapped
                assert os.stat(r.spec).st_ino == inode and await r.repairs() == repairs
                await r.live()
                os.unlink(r.spec)
                row.recovered(await until(lambda: spec_is_exact(r.spec)))
                await r.admit()
                row.facts.update(events=events, daemon_cpu_s=round(used, 2),
                                 allocations_during=allocations, re_registrations=0,
                                 health_flaps=0, rewrites=0)

    run(body())


@dataclass
class Call:
    sent: float
    received: float = 0.0
    ok: bool = False
    code: str = ""
    details: str = ""


class Flapper:
    """A thread that puts a directory at the CDI path and takes it away, recording when the
    obstruction was certainly there ([placed, lifting)) and certainly not ([cleared, next))."""

    def __init__(self, path: Path, hold: tuple[float, float]) -> None:
        self.path = path
        self.hold = hold
        self.obstructed: list[tuple[float, float]] = []
        self.clear: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        cleared = time.monotonic()
        while not self._stop.is_set():
            time.sleep(random.uniform(*self.hold))
            self.clear.append((cleared, time.monotonic()))
            obstruct(self.path, os.mkdir)
            placed = time.monotonic()
            time.sleep(random.uniform(*self.hold))
            lifting = time.monotonic()
            os.rmdir(self.path)
            self.obstructed.append((placed, lifting))
            cleared = time.monotonic()

    def __enter__(self) -> Flapper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def within(call: Call, windows: list[tuple[float, float]]) -> bool:
    return any(start <= call.sent and call.received <= end for start, end in windows)


BURSTS = 6


@needs_kvm
def test_thousand_concurrent_allocates_while_health_flaps(tmp_path: Path) -> None:
    """1,000 Allocate calls in flight at once, six times, while a directory comes and goes at
    the CDI path. No wrong answer: no success lies wholly inside a time the path was obstructed,
    no refusal wholly inside a time it was clear, and every refusal names its reason."""

    async def body() -> None:
        with scenario("1,000 concurrent Allocates while health flaps") as row:
            node = fresh_node(tmp_path)
            add_sibling(node.cdi_dir, row)
            async with rig(node) as r:
                calls: list[Call] = []
                other: list[str] = []
                lists = r.kubelet.resources[RESOURCE].lists_received
                async with grpc.aio.insecure_channel(f"unix://{node.plugin_dir / SOCKET}") as ch:
                    stub = pb_grpc.DevicePluginStub(ch)

                    async def allocate(i: int) -> None:
                        call = Call(time.monotonic())
                        request = pb.AllocateRequest(container_requests=[
                            pb.ContainerAllocateRequest(devices_ids=[f"kvm-{i % COUNT}"])])
                        try:
                            response = await stub.Allocate(request, timeout=60)
                            call.ok = response.container_responses[0].cdi_devices[0].name == CDI_NAME
                        except grpc.aio.AioRpcError as exc:
                            call.code, call.details = exc.code().name, exc.details() or ""
                        call.received = time.monotonic()
                        calls.append(call)

                    # Windows of 0.05-0.6 s against bursts that take about half a second: many
                    # calls lie wholly inside one window, so the check below decides them.
                    with Flapper(r.spec, (0.05, 0.6)) as flapper:
                        for _ in range(BURSTS):
                            await asyncio.gather(*(allocate(i) for i in range(1000)))
                    await r.healthy()
                ok = [c for c in calls if c.ok]
                refused = [c for c in calls if not c.ok]
                for c in refused:
                    if c.code != "FAILED_PRECONDITION" or not REASON.search(c.details):
                        other.append(f"{c.code}: {c.details}")
                wrong_ok = [c for c in ok if within(c, flapper.obstructed)]
                wrong_refusal = [c for c in refused if within(c, flapper.clear)]
                decisive = sum(within(c, flapper.clear) for c in ok) + sum(
                    within(c, flapper.obstructed) for c in refused)
                assert len(calls) == BURSTS * 1000
                assert other == [], other[:5]
                assert wrong_ok == [] and wrong_refusal == [], (len(wrong_ok), len(wrong_refusal))
                assert ok and refused, "health did not flap during the calls"
                assert decisive > 0, "no call lay wholly inside one window: nothing was decided"
                flaps = r.kubelet.resources[RESOURCE].lists_received - lists
                await r.admit()
                latency = sorted(c.received - c.sent for c in calls)
                row.facts.update(calls=len(calls), succeeded=len(ok), refused_with_reason=len(refused),
                                 decided_by_windows=decisive, wrong=0, flaps=len(flapper.obstructed),
                                 transitions_seen_by_kubelet=flaps,
                                 latency_p50_ms=round(latency[len(latency) // 2] * 1000, 1))

    run(body(), timeout=150)
