"""The fault-injection matrix: the live validation table of the upstream Go plugin (pull request
#14 of hyperlight-dev/hyperlight-on-kubernetes, whose figures rows quote as `upstream_go=`), proved
on every run, plus faults that validation did not try (docs/benchmarks.md).

Every row runs the real `hlplugin serve` against the kubelet emulator, breaks the world (never our
code: files, mounts, mknod'd device nodes, a FUSE filesystem that stops answering, a kubelet) and
checks the daemon's answer, its recovery and a fresh allocation afterwards. The real /dev/kvm is
only ever opened. Recovery times are recorded, never asserted (guard timeouts only);
tests/faultreport.py checks preservation after every row and prints and writes the table.

Run: ``python -m pytest -m faults tests/test_faults.py``
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import faultreport
import grpc
import harness
import pytest
from faultreport import KVM, Row, scenario
from fusefs import HangingFs
from harness import (
    Node,
    Rig,
    needs_kvm,
    needs_root,
    on_kubelet,
    scrape,
    sh,
    spec_is_exact,
    temp_files,
    wait_metric,
    wait_until,
)
from support.waits import quiet, quiet_blocking

from hlplugin.cdi import DEFAULT_BUDGET
from hlplugin.cdi_spec import SPEC_FILE, render_spec
from hlplugin.settings import CdiSettings
from hlplugin.tools.emulator import AdmissionError, KubeletEmulator

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]

RESOURCE = "hyperlight.dev/hypervisor"
CDI_NAME = "hyperlight.dev/hypervisor=kvm"
SOCKET = "hyperlight.sock"
COUNT = 16
SERVE = ("--hypervisor", "kvm", "--device-count", str(COUNT))
GUARD = 20.0  # seconds; only ever reached when something is broken
KVM_RDEV = os.stat(KVM).st_rdev if KVM.exists() else os.makedev(10, 232)
NULL_RDEV = os.makedev(1, 3)  # /dev/null's numbers: a device that exists but is not KVM
STALE = render_spec("kvm", 1000, 1000)  # well-formed, another uid/gid
MALFORMED = b'{"cdiVersion": "0.3.0", "kind": "hyperlight.dev/hyperv'
SIBLING = b'{"cdiVersion": "0.5.0", "kind": "vendor.example/gpu", "devices": []}\n'
REASON = harness.REFUSAL
# The exact content every repair must produce: what `hlplugin cdi --hypervisor kvm` prints (its
# output is tested in tests/test_config.py), rendered in process, not by a command run at import.
DESIRED = render_spec("kvm", CdiSettings.device_uid, CdiSettings.device_gid)
STALE_IN_PLACE = DESIRED.replace(b"65534", b"65533", 1)  # same length: no new block


@pytest.fixture(scope="module", autouse=True)
def fault_report(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    faultreport.write(request)


def fresh_node(root: Path, *, dev: bool = False) -> Node:
    """A node root whose CDI dir holds a sibling spec; with ``dev`` its own dev and host-dev dirs
    holding mknod'd KVM nodes."""
    views = [root / "dev", root / "host-dev"] if dev else []
    for d in views:
        d.mkdir(parents=True)
        harness.mknod_char(d / "kvm", KVM_RDEV)
    node = Node.make(root, *views)
    node.cdi_dir.mkdir(parents=True, exist_ok=True)
    (node.cdi_dir / "vendor-gpu.json").write_bytes(SIBLING)
    return node


def replace(path: Path, content: bytes | int) -> None:
    """Put bytes (or a character device with these numbers) at ``path`` with one rename: the
    daemon sees the old or the new entry, never a gap."""
    temp = path.with_name(f".fault-{os.getpid()}-{random.randrange(1 << 30)}")
    if isinstance(content, bytes):
        temp.write_bytes(content)
    else:
        os.mknod(temp, stat.S_IFCHR | 0o600, content)
    os.rename(temp, path)


def obstruct(path: Path, make: Callable[[Path], None]) -> None:
    """Put something that is not a regular file where our spec is: made beside it and renamed over
    it in one step (a directory cannot replace a file so: the harness's races the repairs)."""
    if make is os.mkdir:
        harness.obstruct_with_directory(path)
    else:
        make(path.with_name(path.name + ".obstruction"))
        os.rename(path.with_name(path.name + ".obstruction"), path)


def remove_obstruction(path: Path) -> None:
    (os.rmdir if path.is_dir() and not path.is_symlink() else os.unlink)(path)


@contextlib.contextmanager
def mounted(target: Path, *argv: str) -> Iterator[None]:
    target.mkdir(parents=True, exist_ok=True)
    try:
        sh("mount", *argv, str(target))
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"mount {' '.join(argv)} failed: {exc.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False, capture_output=True, timeout=30)


_WORKER = r"""
import json, os, sys, time
mode, path, stop, pause = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[5])
contents = {name: data.encode("latin-1") for name, data in json.loads(sys.argv[4]).items()}
label, counts, odd, n = {data: name for name, data in contents.items()}, {}, [], 0
temp = os.path.join(os.path.dirname(path), ".tamper-%d" % os.getpid())
while not os.path.exists(stop):
    if mode == "tamper":
        with open(temp, "wb") as f:
            f.write(contents["stale"])
        os.rename(temp, path)
        n += 1
        time.sleep(pause)  # the writer's pace: a process of the world
        continue
    for _ in range(1 if pause else 500):
        try:
            with open(path, "rb") as f:
                data = f.read()
            key = label.get(data, "torn")
            if key == "torn" and len(odd) < 5:
                odd.append(data[:120].decode(errors="replace"))
        except OSError as exc:
            key = "error " + (exc.strerror or str(exc))
        counts[key] = counts.get(key, 0) + 1
        if pause:
            time.sleep(pause)  # the reader's pace: a process of the world
print(json.dumps({"counts": counts, "odd": odd, "tampered": n}))
"""


@contextlib.contextmanager
def workers(root: Path, path: Path, contents: dict[str, bytes], readers: int, pause: float = 0.0,
            tamper: float | None = None) -> Iterator[dict[str, Any]]:
    """Reader processes that classify every read of ``path`` by ``contents``, pausing ``pause`` s
    between reads (and a tamperer writing ``contents["stale"]`` every ``tamper`` s); on a clean
    exit the yielded dict holds their merged counts."""
    stop = root / "workers.stop"
    known = json.dumps({name: data.decode("latin-1") for name, data in contents.items()})
    modes = [("read", pause)] * readers + ([] if tamper is None else [("tamper", tamper)])
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, mode, str(path), str(stop), known,
                               str(wait)], stdout=subprocess.PIPE) for mode, wait in modes]
    result: dict[str, Any] = {"counts": Counter(), "odd": [], "tampered": 0}
    try:
        yield result
        stop.touch()
        for proc in procs:
            out = json.loads(proc.communicate(timeout=30)[0])
            result["tampered"] += out["tampered"]
            result["odd"] += out["odd"]
            result["counts"].update(out["counts"])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def repairs(samples: harness.Samples) -> dict[str, float]:
    """CDI repairs by cause in one scrape (the one at the process's start included)."""
    return {dict(labels)["cause"]: v for (name, labels), v in samples.items()
            if name == "hyperlight_cdi_repairs_total"}


@contextlib.asynccontextmanager
async def matrix_row(name: str, node: Node, *extra: str,
                     keep: Sequence[str] = ("vendor-gpu.json",)) -> AsyncIterator[tuple[Row, Rig]]:
    """One row of the matrix: its scenario, which keeps ``keep`` in the CDI dir byte-identical,
    and the daemon registered and healthy on a kubelet; on failure the daemon's last log lines."""
    with scenario(name, [node.cdi_dir / kept for kept in keep]) as row:
        async with on_kubelet(node, node.serve_args(*SERVE, *extra)) as (kubelet, proc):
            try:
                r = Rig(node, kubelet, proc, COUNT, DESIRED, guard=GUARD)
                await r.healthy()
                yield row, r
            except BaseException:
                print(f"--- hlplugin serve (pid {proc.pid}, exit {proc.exited()}), last log lines:",
                      *proc.raw[-40:], sep="\n", file=sys.stderr)
                raise


TAMPER: dict[str, Callable[[Path], None]] = {
    "missing": os.unlink, "stale": lambda p: replace(p, STALE), "malformed": lambda p: replace(p, MALFORMED)}


async def exact(r: Rig) -> float:
    """Seconds until the spec is exact again (file state has no emulator event: polled)."""
    return await wait_until(lambda: spec_is_exact(r.spec, DESIRED), GUARD, "an exact spec", step=0.001)


@needs_kvm
@pytest.mark.parametrize("kind", list(TAMPER))
async def test_cdi_missing_stale_malformed_is_repaired_exactly(tmp_path: Path, kind: str) -> None:
    async with matrix_row(f"CDI {kind}", fresh_node(tmp_path)) as (row, r):
        assert r.spec.read_bytes() == DESIRED
        before = repairs(await scrape(r.proc))
        times = []
        for _ in range(5):
            TAMPER[kind](r.spec)
            times.append(await exact(r))
            await r.admit()

        def counted(samples: harness.Samples) -> dict[str, float]:
            return {c: n - before.get(c, 0) for c, n in repairs(samples).items() if n != before.get(c)}

        # The file is renamed into place a moment before the counter moves: wait for it.
        delta = counted(await wait_metric(r.proc, lambda s: sum(counted(s).values()) >= 5, GUARD))
        assert delta == {kind: 5}, delta  # each repair counted under its own cause
        assert temp_files(r.node.cdi_dir) == []
        assert r.kubelet.register_calls == 1  # repaired in place, no restart
        row.recovery_s = max(times)
        row.facts.update(median_ms=round(median(times) * 1000, 1), repairs=5,
                         cause_counted=kind, exact="byte-identical to `hlplugin cdi`")


def fill_and_stale_in_place(r: Rig) -> None:
    """Fill the 16 KiB tmpfs to the last block, then make the spec stale in place: same length,
    so no new block (uid 65534 -> 65533), and the repair's temp file cannot be written."""
    with open(r.node.cdi_dir / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 1024)
    assert os.statvfs(r.node.cdi_dir).f_bavail == 0
    assert len(STALE_IN_PLACE) == len(DESIRED)
    with open(r.spec, "r+b", buffering=0) as f:  # in place: no truncation, no new inode
        f.write(STALE_IN_PLACE)


def read_only_store(r: Rig) -> None:
    """Our view of the CDI dir turns read-only; the spec is deleted through the writable store."""
    sh("mount", "-o", "remount,bind,ro", str(r.node.cdi_dir))
    (r.node.root / "cdi-store" / SPEC_FILE).unlink()


def both_views(r: Rig, rdev: int) -> None:
    replace(r.node.host_dev_dir / "kvm", rdev)
    replace(r.node.dev_dir / "kvm", rdev)


@dataclass(frozen=True)
class Fault:
    """A fault that withdraws every slot: readiness fails naming it, liveness holds, Allocate is
    refused naming it, and undoing it recovers without a restart."""

    name: str
    condition: str                    # the /readyz condition that fails
    reason: str                       # ... and is in its reason
    refusal: str                      # in Allocate's refusal, beside the condition's name
    inject: Callable[[Rig], None]
    undo: Callable[[Rig], None]
    facts: dict[str, Any]             # "refused": None is filled from the refusal
    still: Callable[[Rig], bool] = lambda r: True  # holds while failing, after ``watch`` seconds
    watch: float = 0.0
    ok: str = ""                      # a condition that stays ok
    dev: bool = False                 # own device views (mknod'd)
    mount: tuple[str, ...] = ()       # the CDI dir mounted so ("STORE": a dir beside it)
    root: bool = True


def obstruction(kind: str, make: Callable[[Path], None], described: str) -> Fault:
    return Fault(f"Non-regular CDI path: {kind}", "cdi", described, described,
                 inject=lambda r: obstruct(r.spec, make), undo=lambda r: remove_obstruction(r.spec),
                 root=False,
                 facts={"refused": f"FAILED_PRECONDITION ({described})", "readyz": 503,
                        "healthz": 200, "restarts": 0})


def host_identity(kind: str, fault: Callable[[Path], None], described: str) -> Fault:
    return Fault(f"Missing host identity: {kind}", "host_identity", described, described,
                 inject=lambda r: fault(r.node.host_dev_dir / "kvm"),
                 undo=lambda r: replace(r.node.host_dev_dir / "kvm", KVM_RDEV),
                 ok="device", dev=True,  # our own device still works
                 facts={"withdrawn": "allocatable 0", "refused": "FAILED_PRECONDITION", "restarts": 0})


BACKOFF = {"note": "recovery waits for the retry backoff"}
FAULTS = [
    obstruction("directory", os.mkdir, "a directory"),
    obstruction("symlink", lambda p: os.symlink("vendor-gpu.json", p), "a symlink"),
    obstruction("FIFO", os.mkfifo, "a FIFO"),
    Fault("Read-only CDI storage", "cdi", "Read-only file system", "Read-only file system",
          inject=read_only_store, mount=("--bind", "STORE"),
          undo=lambda r: sh("mount", "-o", "remount,bind,rw", str(r.node.cdi_dir)),
          facts={"refused": "FAILED_PRECONDITION (EROFS)", "readyz": 503, "healthz": 200,
                 "restarts": 0, **BACKOFF}),
    host_identity("removed", os.unlink, "is missing"),
    host_identity("regular file", lambda p: replace(p, b"not a device\n"), "a regular file"),
    host_identity("other numbers", lambda p: replace(p, NULL_RDEV), "is 1:3"),
    # /dev/null's numbers at the device path, and the host view agreeing: the node exists and the
    # identity matches, only the KVM check can tell.
    Fault("Existing unusable device", "device", "KVM_GET_API_VERSION", "KVM_GET_API_VERSION",
          inject=lambda r: both_views(r, NULL_RDEV), undo=lambda r: both_views(r, KVM_RDEV),
          ok="host_identity", dev=True, facts={"refused": None}),
    Fault("ENOSPC on CDI storage", "cdi", "No space left on device", "ENOSPC",
          inject=fill_and_stale_in_place, undo=lambda r: (r.node.cdi_dir / "filler").unlink(),
          watch=0.5, mount=("-t", "tmpfs", "-o", "size=16k,mode=0755", "tmpfs"),
          # no temp file left, the old spec never truncated
          still=lambda r: temp_files(r.node.cdi_dir) == [] and r.spec.read_bytes() == STALE_IN_PLACE,
          facts={"refused": "FAILED_PRECONDITION (ENOSPC)", "temp_left": 0, "old_spec_intact": True,
                 **BACKOFF}),
]


@needs_kvm
@pytest.mark.parametrize("fault", [pytest.param(f, id=f.name, marks=[needs_root] if f.root else [])
                                   for f in FAULTS])
async def test_fault_withdraws_every_slot_keeps_liveness_and_recovers_without_restart(
        tmp_path: Path, fault: Fault) -> None:
    with contextlib.ExitStack() as stack:
        if fault.mount:  # before the node: its sibling spec is written into the mount
            (tmp_path / "cdi-store").mkdir()
            stack.enter_context(mounted(tmp_path / "cdi", *(
                a.replace("STORE", str(tmp_path / "cdi-store")) for a in fault.mount)))
        async with matrix_row(fault.name, fresh_node(tmp_path, dev=fault.dev)) as (row, r):
            pid = r.proc.pid
            fault.inject(r)
            await r.withdrawn()
            conditions = await r.conditions(503)
            assert not conditions[fault.condition]["ok"], conditions
            assert fault.reason in conditions[fault.condition]["reason"], conditions
            assert not fault.ok or conditions[fault.ok]["ok"], conditions
            await r.live()
            details = await r.refused(fault.condition, fault.refusal)
            # For ENOSPC, a bounded watch that the retries write nothing meanwhile: the reconciler
            # retries 0.1 s after a failure, doubling (0.1, 0.3, 0.7 s ...), so 0.5 s begun after
            # the failure was seen spans at least two. (The other CDI rows' obstruction or storage
            # left alone while retried: test_cdi's hostile-path test, in process.)
            await quiet(fault.watch, "the retries the failure's backoff makes meanwhile")
            assert fault.still(r), f"{fault.name}: changed while failing"
            began = time.monotonic()
            fault.undo(r)
            await r.healthy()
            row.recovery_s = time.monotonic() - began
            await r.conditions(200)
            assert spec_is_exact(r.spec, DESIRED)
            await r.admit()
            assert r.proc.pid == pid and r.proc.exited() is None  # no restart
            reason = re.sub(r" on \S+", "", details.split(f"{fault.condition}: ", 1)[-1])
            row.facts.update({k: f"FAILED_PRECONDITION ({reason})" if v is None else v
                              for k, v in fault.facts.items()})


@pytest.mark.parametrize("kind, mode", [("no kubelet.sock", ""), ("never answers", "hang"),
                                        ("resets connections", "reset")], ids=lambda v: v or None)
async def test_registration_failure_is_bounded_then_recovers(tmp_path: Path, kind: str,
                                                              mode: str) -> None:
    timeout = 0.5
    node = fresh_node(tmp_path)
    kubelet = KubeletEmulator(node.plugin_dir, mode=mode or "normal")
    with scenario(f"Registration failure: {kind}") as row:
        try:
            if mode:
                await kubelet.start()
            began = time.monotonic()
            async with harness.daemon(node.serve_args(*SERVE, "--register-timeout", str(timeout))) as proc:
                # Several bounded attempts: each ends within the timeout (plus backoff); waiting
                # for a missing kubelet.sock counts as a failed attempt per backoff step.
                failures = harness.value(await wait_metric(proc, lambda s: harness.value(
                    s, "hyperlight_registrations_total", result="failure") >= 3, GUARD),
                    "hyperlight_registrations_total", result="failure")
                row.facts["attempts"] = f"{failures:.0f} failed in {time.monotonic() - began:.1f}s"
                # Why each attempt failed, logged once: test_lifecycle's registration failures.
                r = Rig(node, kubelet, proc, COUNT, DESIRED, guard=GUARD)
                assert not (await r.conditions(503))["registered"]["ok"]
                await r.live()
                await kubelet.stop(remove_socket=True)
                kubelet.mode = "normal"  # the kubelet comes back working
                began = time.monotonic()
                await kubelet.start()
                await r.healthy()
                row.recovery_s = time.monotonic() - began
                await r.conditions(200)
                await r.admit()
                row.facts.update(readyz=503, healthz=200, register_timeout=f"{timeout}s")
        finally:
            await kubelet.stop()


@needs_kvm
@pytest.mark.parametrize("restart", ["SIGTERM", "SIGKILL", "kubelet"])
async def test_restart_re_registers_and_keeps_the_spec(tmp_path: Path, restart: str) -> None:
    """The plugin (by this signal) or the kubelet restarts again and again: the plugin registers
    anew each time, a fresh allocation works, and a reader never sees the spec other than exact."""
    kubelet = restart == "kubelet"
    async with matrix_row("Kubelet restart" if kubelet else f"Plugin restart: {restart}",
                          fresh_node(tmp_path)) as (row, r):
        times = []
        with workers(tmp_path, r.spec, {"desired": DESIRED}, readers=1, pause=0.001) as watch:
            for _ in range(5 if kubelet else 3):
                calls = r.kubelet.register_calls
                if kubelet:
                    began = time.monotonic()
                    await r.kubelet.restart()  # deletes every socket, serves kubelet.sock anew
                else:
                    await r.proc.signal(signal.Signals[restart])
                    await r.wait(lambda: r.kubelet.allocatable(RESOURCE) == 0)
                    assert spec_is_exact(r.spec, DESIRED)
                    if restart == "SIGKILL":
                        assert (r.node.plugin_dir / SOCKET).exists()  # stale, left behind
                    began = time.monotonic()
                    await r.proc.start()
                await r.wait(lambda c=calls: r.kubelet.register_calls > c  # type: ignore[misc]
                             and r.kubelet.allocatable(RESOURCE) == COUNT)
                times.append(time.monotonic() - began)
                await r.admit()
        reads = sum(watch["counts"].values())
        assert set(watch["counts"]) == {"desired"} and (kubelet or reads > 100), watch
        if kubelet:
            row.recovery_s = median(times)
            row.facts.update(restarts=5, re_registered_max_ms=round(max(times) * 1000, 1),
                             upstream_go="5.01 s")
        else:
            row.recovery_s = max(times)
            row.facts.update(restarts=3, start_to_registered_median_s=round(median(times), 3),
                             spec_reads_during=reads, spec_read_errors=0)


@needs_kvm
@pytest.mark.guard(120)
async def test_atomic_replacement_during_allocation(tmp_path: Path) -> None:
    """Readers in other processes read the spec non-stop while it is tampered with and Allocate
    repairs it: every read is a complete desired, stale or malformed file (the tamperer's own
    atomic writes), never torn, empty or missing."""
    async with matrix_row("Atomic replacement during allocation", fresh_node(tmp_path)) as (row, r):
        known = {"desired": DESIRED, "stale": STALE, "malformed": MALFORMED}
        times: list[float] = []
        with workers(tmp_path, r.spec, known, readers=2) as result:
            began = time.monotonic()
            while len(times) < 200 or time.monotonic() - began < 4.0:
                replace(r.spec, STALE if len(times) % 2 else MALFORMED)
                t0 = time.monotonic()
                response = await r.kubelet.allocate(RESOURCE, [[f"kvm-{len(times) % COUNT}"]])
                times.append(time.monotonic() - t0)
                assert response.container_responses[0].cdi_devices[0].name == CDI_NAME
                # Repaired before the answer: the runtime will read the exact spec.
                assert r.spec.read_bytes() == DESIRED
                await quiet(0.005, "pacing: the readers get the CPU in between")
        counts = result["counts"]
        reads = sum(counts.values())
        assert set(counts) <= {"desired", "stale", "malformed"}, result
        assert reads > 100_000, counts
        assert temp_files(r.node.cdi_dir) == []
        row.recovery_s = median(times)
        row.facts.update(reads=reads, complete=reads, torn=0, errors=0, allocations=len(times),
                         allocate_p_max_ms=round(max(times) * 1000, 1),
                         upstream_go="6,813 reads, repair after 2.93 s")


@needs_kvm
async def test_preservation_of_foreign_files_and_the_real_device(tmp_path: Path) -> None:
    """Everything in the CDI dir that is not ours stays byte-identical (and the same inode)
    through repairs, obstructions and restarts; the real /dev/kvm keeps its mode, owner, numbers."""
    node = fresh_node(tmp_path)
    cdi = node.cdi_dir
    (cdi / "hyperlight.json.bak").write_bytes(STALE)
    (cdi / "hyperlight.yaml").write_bytes(b"cdiVersion: 0.3.0\n")
    (cdi / "vendor-dir").mkdir()
    (cdi / "vendor-dir" / "nested.json").write_bytes(SIBLING)
    os.symlink("vendor-gpu.json", cdi / "vendor-link.json")
    before = {n: os.lstat(cdi / n) for n in os.listdir(cdi)}
    kept = ("vendor-gpu.json", "hyperlight.json.bak", "hyperlight.yaml", "vendor-dir/nested.json")
    async with matrix_row("Preservation: foreign CDI files, real device", node, keep=kept) as (row, r):
        for tamper in TAMPER.values():
            tamper(r.spec)
            await exact(r)
        obstruct(r.spec, os.mkdir)
        await r.withdrawn()
        remove_obstruction(r.spec)
        await r.healthy()
        for signum in (signal.SIGTERM, signal.SIGKILL):
            await r.proc.signal(signum)
            await r.proc.start()
            await r.healthy()
        await r.admit()
        await r.proc.stop()  # its shutdown must not touch them either
        for name, st in before.items():
            now = os.lstat(cdi / name)
            assert (now.st_ino, now.st_mode, now.st_mtime_ns) == (
                st.st_ino, st.st_mode, st.st_mtime_ns), name
        assert os.readlink(cdi / "vendor-link.json") == "vendor-gpu.json"
        assert sorted(os.listdir(cdi)) == sorted([*before, SPEC_FILE])
        row.facts.update(foreign_entries=len(before), unchanged="bytes, inode, mode, mtime",
                         faults="missing, stale, malformed, directory, SIGTERM, SIGKILL")


# A view on a filesystem that stops answering (FUSE, served here): the row, the condition whose
# check meets the hang first (in the device view, the stat of host_identity's check), the budget
# of the pass, its interval and its flag. Hung CDI storage is issue 15's.
HANGS = {"device": ("Probe helper hangs (stuck filesystem)", "host_identity", 1.0, 3.0,
                    "--health-interval"),
         "cdi": ("Hung CDI storage", "cdi", DEFAULT_BUDGET, 1.0, "--cdi-interval")}
PROMPT = 1.0  # a guard for "at once": a CDI refusal that waited for the storage would take the budget


@needs_kvm
@needs_root
@pytest.mark.guard(120)
@pytest.mark.parametrize("condition", list(HANGS))
async def test_hung_filesystem_is_bounded(tmp_path: Path, condition: str) -> None:
    """The pass's helper thread blocks in the kernel on stat/open/read of our entry. The daemon
    stays live, the condition fails within the budget naming the timeout, no second helper is
    ever started, Allocate is refused naming why, the device check recovers once the filesystem
    answers, and SIGTERM stops the daemon at once with a helper stuck (the process is reaped when
    the kernel releases that thread: nothing in user space can kill it sooner)."""
    name, first, budget, interval, flag = HANGS[condition]
    device = condition == "device"
    node = fresh_node(tmp_path, dev=device)
    flags = (flag, str(interval), *(("--probe-timeout", str(budget)) if device else ()))
    if device:
        fs = HangingFs(tmp_path / "fuse-dev", "kvm", stat.S_IFCHR | 0o600, rdev=KVM_RDEV)
        node = dataclasses.replace(node, dev_dir=fs.mountpoint)
    else:  # the CDI dir is the filesystem: there is no sibling beside the spec to keep
        fs = HangingFs(node.cdi_dir, SPEC_FILE, stat.S_IFREG | 0o644, content=DESIRED)
    with fs:
        async with matrix_row(name, node, *flags, keep=("vendor-gpu.json",) * device) as (row, r):
            try:
                await r.admit()  # served from the filesystem: exact
                assert fs.requests > 0
                fs.hang()
                hung = time.monotonic()
                # The next periodic pass meets the hang and gives up after its budget; the guard
                # is that plus one interval and slack for a loaded machine.
                await wait_until(lambda: any(m.startswith(f"condition {first} is unhealthy")
                                             for m in r.proc.messages()), interval + budget + 10,
                                 f"condition {first} to fail")
                failed_after = time.monotonic() - hung
                assert failed_after >= budget * 0.9, failed_after  # it did wait its budget
                assert any("check timed out" in m for m in r.proc.messages()), "no timeout"
                await r.withdrawn()

                async def still_stuck() -> bool:
                    return "still stuck" in (await r.conditions(503))[condition]["reason"]

                if device:  # later checks find the helper still stuck and do not start another
                    await wait_until(still_stuck, GUARD, "a check finding the helper still stuck", 0.05)
                conditions = await r.conditions(503)
                why = conditions[condition]["reason"]
                assert not conditions[condition]["ok"], conditions
                assert f"timed out after {budget:.1f}s" in why or "still stuck" in why, why
                if not device:
                    assert str(r.spec) in why, why
                refusals = []
                for _ in range(4 if device else 1):
                    # Each Allocate asks for a device check that began after it (runs are
                    # numbered: no clock, no wait for health to age), which waits at most its
                    # budget for the stuck helper, then refuses.
                    t0 = time.monotonic()
                    await r.refused("still stuck" if device else "cdi: cannot check")
                    refusals.append(time.monotonic() - t0)
                    await r.live()
                if not device:  # a CDI refusal never waits for the storage
                    assert max(refusals) < PROMPT, refusals
                # Every helper ever started blocks in a request of ours: one in all, not one per pass.
                helpers = fs.pending
                assert helpers == 1, helpers
                stuck_for = time.monotonic() - hung
                if device:  # a filesystem answering again makes no event: the periodic check sees it
                    fs.release()
                    row.recovery_s = await r.healthy()
                    await r.admit()
                    fs.hang()
                    await r.withdrawn()
                # SIGTERM with a helper stuck: the daemon stops at once (its socket is gone); the
                # process can only be reaped once the kernel lets the stuck thread go (a FUSE
                # request already read by its server is waited out even by SIGKILL), so the
                # filesystem answers before we reap it.
                assert r.proc.proc is not None
                t0 = time.monotonic()
                r.proc.proc.send_signal(signal.SIGTERM)
                await wait_until(lambda: not (node.plugin_dir / SOCKET).exists(), 10, "stopped serving")
                stopping = time.monotonic() - t0
                assert "hlplugin serve stopping" in r.proc.messages()
                fs.release()
                assert await r.proc.stop() == 0
            finally:
                fs.release()
            row.facts.update(budget_s=budget, stuck_for_s=round(stuck_for, 1),
                             refusal_max_s=round(max(refusals), 2), stuck_helpers=helpers,
                             healthz=200, sigterm_to_socket_gone_s=round(stopping, 3))
            if device:
                row.facts["note"] = ("recovery found by the periodic check (--health-interval 3); a "
                                     "thread stuck in the kernel keeps the process from exiting "
                                     "until the filesystem answers")


@needs_kvm
@pytest.mark.guard(150)
async def test_sigkill_in_the_middle_of_repairs_leaves_no_temp_file_nor_torn_spec(
        tmp_path: Path) -> None:
    """A tamperer rewrites the spec stale every millisecond, so the daemon is always repairing;
    it is SIGKILLed again and again. Readers never see anything but a complete file; temp files a
    kill leaves behind are removed by the next start."""
    async with matrix_row("SIGKILL in the middle of CDI repairs", fresh_node(tmp_path)) as (row, r):
        kills = leftovers = 0
        with workers(tmp_path, r.spec, {"desired": DESIRED, "stale": STALE}, readers=1,
                     tamper=0.001) as result:
            for _ in range(12):
                # Killed while busy: after it has repaired the tamperer's writes a few times.
                await wait_metric(r.proc, lambda s: sum(repairs(s).values()) >= 4, GUARD)
                await quiet(random.uniform(0, 0.02), "a random point in a repair")
                await r.proc.signal(signal.SIGKILL)
                kills += 1
                leftovers += len(temp_files(r.node.cdi_dir))
                await r.proc.start()
        began = time.monotonic()
        await r.healthy()
        await exact(r)
        row.recovery_s = time.monotonic() - began
        assert temp_files(r.node.cdi_dir) == []
        await r.admit()
        counts = result["counts"]
        assert set(counts) <= {"desired", "stale"}, result
        assert counts["desired"] > 0 and counts["stale"] > 0, result  # it read both: a real race
        row.facts.update(kills=kills, temp_files_left_by_kills=leftovers,
                         temp_files_after_restart=0, reads=sum(counts.values()),
                         torn=0, tampered=result["tampered"])


@needs_kvm
@needs_root
async def test_inotify_flood_costs_nothing_wrong(tmp_path: Path) -> None:
    """10,000 events across every watched directory (foreign names, our spec's attributes, the
    kubelet's checkpoint): no re-registration, no health flap, no rewrite, Allocate keeps working,
    and a real tamper afterwards is still repaired at once."""
    async with matrix_row("inotify flood (10,000 events)", fresh_node(tmp_path, dev=True)) as (row, r):
        resource = r.kubelet.resources[RESOURCE]
        lists, calls = resource.lists_received, r.kubelet.register_calls
        inode = os.stat(r.spec).st_ino
        before = repairs(await scrape(r.proc))
        cpu = harness.cpu_seconds(r.proc.pid)

        def flood() -> int:
            events = 0
            for i in range(1000):
                for d in (r.node.cdi_dir, r.node.dev_dir):
                    (d / f"foreign-{i}").touch()  # CREATE (a new file: no ATTRIB)
                    (d / f"foreign-{i}").unlink()  # DELETE
                    events += 2
                os.utime(r.spec)  # ATTRIB on our own file
                temp = r.node.plugin_dir / f".checkpoint-{i}"
                temp.write_bytes(b"{}")  # CREATE, MODIFY, CLOSE_WRITE
                os.rename(temp, r.node.plugin_dir / "kubelet_internal_checkpoint")  # MOVED_FROM, _TO
                events += 6
            return events

        job = asyncio.create_task(asyncio.to_thread(flood))
        allocations = 0
        while not job.done():
            await r.kubelet.allocate(RESOURCE, [["kvm-1"]])
            allocations += 1
            await quiet(0.01, "pacing: an Allocate every 10 ms during the flood")
        events = await job
        # A bounded watch for a late reaction to the flood's tail: every event was queued
        # before the flood returned, and the daemon reacts to an event within a few ms (a
        # repair takes 1-6 ms in the CDI rows), so 0.5 s is a hundred times that.
        await quiet(0.5, "a bounded watch for a late reaction to the flood's tail")
        used = harness.cpu_seconds(r.proc.pid) - cpu
        assert events >= 10_000
        assert r.kubelet.register_calls == calls and r.kubelet.registered(RESOURCE)
        assert resource.lists_received == lists  # health never flapped
        assert os.stat(r.spec).st_ino == inode and repairs(await scrape(r.proc)) == before
        await r.live()
        os.unlink(r.spec)
        row.recovery_s = await exact(r)
        await r.admit()
        row.facts.update(events=events, daemon_cpu_s=round(used, 2),
                         allocations_during=allocations, re_registrations=0,
                         health_flaps=0, rewrites=0)


@contextlib.contextmanager
def flapping(path: Path, hold: tuple[float, float]) -> Iterator[dict[bool, list[tuple[float, float]]]]:
    """A thread that puts a directory at ``path`` and takes it away, recording the windows when
    the path was certainly clear (True: [cleared, next)) and certainly obstructed (False: [placed,
    lifting))."""
    windows: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    stop = threading.Event()

    def flap() -> None:  # the sleeps hold each state a random time: the world, not a wait
        cleared = time.monotonic()
        while not stop.is_set():
            quiet_blocking(random.uniform(*hold), "each health state held a random time: the world")
            windows[True].append((cleared, time.monotonic()))
            obstruct(path, os.mkdir)
            placed = time.monotonic()
            quiet_blocking(random.uniform(*hold), "each health state held a random time: the world")
            windows[False].append((placed, time.monotonic()))
            os.rmdir(path)
            cleared = time.monotonic()

    thread = threading.Thread(target=flap, daemon=True)
    thread.start()
    try:
        yield windows
    finally:
        stop.set()
        thread.join(10)


@needs_kvm
@pytest.mark.guard(150)
async def test_thousand_concurrent_allocates_while_health_flaps(tmp_path: Path) -> None:
    """1,000 Allocate calls in flight at once, six times, while a directory comes and goes at
    the CDI path. No wrong answer: no success lies wholly inside a time the path was obstructed,
    no refusal wholly inside a time it was clear, and every refusal names its reason."""
    name = "1,000 concurrent Allocates while health flaps"
    async with matrix_row(name, fresh_node(tmp_path)) as (row, r):
        lists = r.kubelet.resources[RESOURCE].lists_received

        async def allocate(i: int) -> tuple[float, float, AdmissionError | None]:
            """Straight to the plugin (the kubelet would not even try): sent, answered, refusal."""
            sent = time.monotonic()
            try:
                response = await r.kubelet.allocate(RESOURCE, [[f"kvm-{i % COUNT}"]], timeout=60)
            except AdmissionError as exc:
                return sent, time.monotonic(), exc
            assert response.container_responses[0].cdi_devices[0].name == CDI_NAME
            return sent, time.monotonic(), None

        # Windows of 0.05-0.6 s against bursts that take about half a second: many calls lie
        # wholly inside one window, so the check below decides them.
        with flapping(r.spec, (0.05, 0.6)) as windows:
            calls = [c for _ in range(6) for c in await asyncio.gather(*map(allocate, range(1000)))]
        await r.healthy()

        def within(call: tuple[float, float, AdmissionError | None], clear: bool) -> bool:
            return any(start <= call[0] and call[1] <= end for start, end in windows[clear])

        refused = [error for *_, error in calls if error]
        other = [str(e) for e in refused
                 if e.code != grpc.StatusCode.FAILED_PRECONDITION or not REASON.search(e.details)]
        wrong = [c for c in calls if within(c, clear=c[2] is not None)]  # a success while obstructed ...
        decisive = sum(within(c, clear=c[2] is None) for c in calls)
        assert len(calls) == 6 * 1000
        assert other == [], other[:5]
        assert wrong == [], (len(wrong), wrong[:5])
        assert 0 < len(refused) < len(calls), "health did not flap during the calls"
        assert decisive > 0, "no call lay wholly inside one window: nothing was decided"
        flaps = r.kubelet.resources[RESOURCE].lists_received - lists
        await r.admit()
        latency = sorted(answered - sent for sent, answered, _ in calls)
        row.facts.update(calls=len(calls), succeeded=len(calls) - len(refused),
                         refused_with_reason=len(refused), decided_by_windows=decisive, wrong=0,
                         flaps=len(windows[False]), transitions_seen_by_kubelet=flaps,
                         latency_p50_ms=round(latency[len(latency) // 2] * 1000, 1))
