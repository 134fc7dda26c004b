"""The fault-injection matrix: the live validation table of the upstream Go plugin (pull request
#14 of hyperlight-dev/hyperlight-on-kubernetes, whose figures rows quote as `upstream_go=`), proved
on every run, plus faults that validation did not try (docs/benchmarks.md).

Every row runs the real `hlplugin serve` against the kubelet emulator, breaks the world (never our
code: files, mounts, mknod'd device nodes, a FUSE filesystem that stops answering, a kubelet) and
checks the daemon's answer, its recovery and a fresh allocation afterwards. The real /dev/kvm is
only ever opened. Recovery times are recorded, never asserted (guard timeouts only);
tests/faultreport.py checks preservation after every row and prints and writes the table.

Its rows are in three files: CDI and allocation here, health (test_faults_health.py), the kubelet
(test_faults_kubelet.py). Run: ``python -m pytest -m faults tests/test_faults*.py``
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from statistics import median

import grpc
import harness
import pytest
from harness import (
    Rig,
    needs_kvm,
    needs_root,
    scrape,
    spec_is_exact,
    temp_files,
    wait_metric,
    wait_until,
)
from support.faults import (
    COUNT,
    DESIRED,
    GUARD,
    RESOURCE,
    SIBLING,
    fresh_node,
    matrix_row,
    obstruct,
    remove_obstruction,
    replace,
    workers,
)
from support.waits import quiet, quiet_blocking

from hlplugin.cdi_spec import SPEC_FILE, render_spec
from hlplugin.tools.emulator import AdmissionError

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180), pytest.mark.usefixtures("fault_report")]
CDI_NAME = "hyperlight.dev/hypervisor=kvm"
STALE = render_spec("kvm", 1000, 1000)  # well-formed, another uid/gid
MALFORMED = b'{"cdiVersion": "0.3.0", "kind": "hyperlight.dev/hyperv'
REASON = harness.REFUSAL


def repairs(samples: harness.Samples) -> dict[str, float]:
    """CDI repairs by cause in one scrape (the one at the process's start included)."""
    return {dict(labels)["cause"]: v for (name, labels), v in samples.items()
            if name == "hyperlight_cdi_repairs_total"}


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
