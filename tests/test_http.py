"""/healthz, /readyz and /metrics of both daemons, run as real processes, over real TCP.

No KVM or root needed: a daemon pointed at a dev dir without the device stays up, not ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
from pathlib import Path

import pytest
from harness import Node, daemon, parse_metrics, scrape, wait_until

from hlplugin import probe

KINDS = ["serve", "bootstrap"]
CONDITIONS = {"serve": {"registered", "listandwatch", "cdi", "device", "host_identity"},
              "bootstrap": {"registered", "listandwatch", "device"}}
# Below the server's 5 s whole-request deadline: an answer within it cannot have waited for a
# stalled client to be dropped.
ANSWER_WITHIN = 3.0


# Every value each labelled counter can take (README "Metrics"): all exported at 0 from the start.
COUNTER_LABELS = {
    "hyperlight_health_transitions_total": ("to", ("healthy", "unhealthy")),
    "hyperlight_probe_failures_total": ("reason", probe.REASONS),
    "hyperlight_cdi_repairs_total": ("cause", ("missing", "malformed", "stale", "metadata")),
    "hyperlight_cdi_refusals_total": ("reason", ("not_regular", "write_failed")),
    "hyperlight_allocations_total": ("result", ("success", "invalid", "refused")),
    "hyperlight_registrations_total": ("result", ("success", "failure")),
    "hyperlight_probe_duration_seconds_count": ("check", ("device", "host_identity")),
}
MAIN_ONLY = {"hyperlight_probe_failures_total", "hyperlight_cdi_repairs_total",
             "hyperlight_cdi_refusals_total", "hyperlight_probe_duration_seconds_count"}


def args(kind: str, node: Node) -> list[str]:
    if kind == "serve":
        return node.serve_args("--hypervisor", "auto", "--device-count", "2")
    return ["bootstrap", "--plugin-dir", str(node.plugin_dir), "--dev-dir", str(node.dev_dir),
            "--hypervisor", "auto"]


def raw_request(port: int, data: bytes, timeout: float = ANSWER_WITHIN) -> bytes:
    """Send ``data`` on a fresh connection and read the answer until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(data)
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def get(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    answer = raw_request(port, f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                         .encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), headers, body


def still_open(conn: socket.socket) -> bool:
    conn.setblocking(False)
    try:
        return conn.recv(1) != b""  # data would be a premature answer: count it as open
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        conn.setblocking(True)


def accepted(pid: int, port: int, clients: list[socket.socket]) -> bool:
    """The daemon holds the server end of every one of ``clients`` (connected to ``port``): each
    has its socket's inode (0 until accepted) in /proc/net/tcp and in the daemon's fd table."""
    want = {c.getsockname()[1] for c in clients}
    inodes = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, inode = int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16), fields[9]
        if local == port and remote in want:
            inodes[remote] = inode
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return set(inodes) == want and all(f"socket:[{i}]" in held for i in inodes.values())


@pytest.mark.parametrize("kind", KINDS)
async def test_without_a_device_every_series_is_there_readyz_explains_and_bad_requests_block_nothing(
        tmp_path: Path, kind: str) -> None:
    """--hypervisor auto (what the manifests deploy), no kubelet, no device node: nothing has
    happened, yet every counter series is there at 0, the health conditions the daemon has are 0
    ("not checked yet"), the process's own resource use is exported, and no `_created` series
    is. /readyz names the search, and drops it once a node of that name appears. Then the
    endpoints answer, bad and stalled requests block nothing."""
    dev = tmp_path / "dev"
    dev.mkdir()
    node = Node.make(tmp_path, dev_dir=dev, host_dev_dir=dev)
    async with daemon(args(kind, node)) as proc:
        m = await scrape(proc)
        for name, (label, values) in COUNTER_LABELS.items():
            if kind == "bootstrap" and name in MAIN_ONLY:  # it has neither a CDI spec nor a prober
                assert not [k for k in m if k[0] == name], name
                continue
            for v in values:
                assert m.get((name, frozenset({(label, v)}))) == 0, f"{name}{{{label}={v!r}}}"
        for condition in CONDITIONS[kind] - {"registered", "listandwatch"}:
            assert m[("hyperlight_health_condition", frozenset({("condition", condition)}))] == 0
        assert m[("hyperlight_ready", frozenset())] == 0
        assert not [k for k in m if k[0].endswith("_created")]
        assert m[("process_resident_memory_bytes", frozenset())] > 1 << 20
        assert m[("process_open_fds", frozenset())] > 3
        assert ("process_cpu_seconds_total", frozenset()) in m

        ready = json.loads(await proc.wait_http("/readyz", 503))
        assert ready["conditions"]["hypervisor"] == {
            "ok": False, "reason": f"no mshv or kvm device under {dev}"}
        (dev / "kvm").write_text("not a device")  # found by name; then checked as a node
        await wait_until(lambda: "hypervisor device" in " ".join(proc.messages()))
        condition, want = (
            ("host_identity", f"device {dev / 'kvm'} is not a character device (a regular file)")
            if kind == "serve" else ("device", f"{dev / 'kvm'} is not a character device (a regular file)"))

        async def explained() -> bool:  # the readiness this answers is set just after that line
            status, body = await proc.get("/readyz")  # 0: no answer in time (a busy machine)
            return status == 503 and bool(
                json.loads(body)["conditions"][condition] == {"ok": False, "reason": want})

        await wait_until(explained)
        ready = json.loads(await proc.wait_http("/readyz", 503))
        assert ready["conditions"][condition] == {"ok": False, "reason": want}
        assert "hypervisor" not in ready["conditions"]

        async def checked() -> bool:  # the first check runs after HTTP is up
            status, body = await proc.get("/readyz")
            return status == 503 and "not checked yet" not in [
                c["reason"] for c in json.loads(body)["conditions"].values()]

        await wait_until(checked, 15, "every condition checked")
        port = proc.port
        # Half-open connections (the server drops them at its whole-request deadline) hold
        # nothing another client needs: every answer in this block comes while they are connected.
        stalled = [b""] * 6 + [b"GET /hea"] * 3 + [b"GET /healthz HTTP/1.1\r\nHost: x\r\n"] * 3
        with contextlib.ExitStack() as stack:  # silent, half a request line, half the headers
            conns = [stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=5))
                     for _ in stalled]
            for conn, payload in zip(conns, stalled, strict=True):
                conn.sendall(payload)
            await wait_until(lambda: accepted(proc.pid, port, conns), 10,
                             "the server accepting every stalled client")
            status, headers, raw = await asyncio.to_thread(get, port, "/readyz")
            assert (status, headers["content-type"]) == (503, "application/json")
            ready = json.loads(raw)
            assert ready["status"] == "not ready"
            conditions = ready["conditions"]
            assert set(conditions) == CONDITIONS[kind]
            for name, condition in conditions.items():
                assert set(condition) == {"ok", "reason"}, name
                assert condition["ok"] or condition["reason"], f"{name} fails without a reason"
            # Before its first recheck (5 s) without a kubelet, then naming what it looked for.
            assert conditions["registered"] in ({"ok": False, "reason": reason} for reason in (
                "not registered with the kubelet",
                f"no kubelet.sock at {node.plugin_dir / 'kubelet.sock'} (is the kubelet running, "
                "and is --plugin-dir its device-plugins directory?)")), conditions["registered"]
            assert not conditions["device"]["ok"]
            assert str(node.dev_dir / "kvm") in conditions["device"]["reason"]
            status, headers, raw = await asyncio.to_thread(get, port, "/healthz")
            assert status == 200 and json.loads(raw) == {"status": "ok", "reason": ""}
            status, headers, raw = await asyncio.to_thread(get, port, "/metrics")
            assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
            names = {name for name, _ in parse_metrics(raw.decode())}
            assert "hyperlight_build_info" in names and "hyperlight_health_condition" in names
            status, headers, raw = await asyncio.to_thread(get, port, "/no-such-path")
            assert status == 404 and b"/healthz" in raw
            status, headers, raw = await asyncio.to_thread(get, port, "/healthz", "POST")
            assert status == 405 and headers["allow"] == "GET"
            # Answered while every stalled client was still connected, so not after it.
            assert all(still_open(c) for c in conns)
            await wait_until(lambda: not any(still_open(c) for c in conns), 20,
                             "the stalled clients being dropped")

        # Malformed requests get a 4xx (or 505) and the daemon lives.
        cases = [
            (b"NOT A VALID REQUEST LINE\r\n\r\n", 400),
            (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),  # a TLS hello
            (b"GET\r\n\r\n", 400),
            (b"GET /healthz HTTP/9.9\r\n\r\n", 505),
            (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),
            (b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        ]
        for data, status in cases:
            answer = await asyncio.to_thread(raw_request, port, data)
            assert answer.split(b" ", 2)[:2] == [b"HTTP/1.1", str(status).encode()], \
                (data[:30], answer[:80])
        # A client that resets mid-request.
        conn = socket.create_connection(("127.0.0.1", port))
        conn.sendall(b"GET /heal")
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
        assert (await asyncio.to_thread(get, port, "/healthz"))[0] == 200
        assert proc.proc is not None and proc.proc.returncode is None
        assert await proc.stop() == 0
    # Client errors are the client's: no traceback, and every line is still a JSON record.
    assert not [line for line in proc.raw if not line.startswith("{")], proc.raw
    assert not any("Traceback" in line for line in proc.raw)
