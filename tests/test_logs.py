"""Logs: one line per event, text by default, JSON on request, a lasting state logged twice."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from harness import Daemon, Node, daemon, needs_root, scrape, value, wait_metric, wait_until
from support.waits import quiet

from hlplugin import __version__, config, logs
from hlplugin.deviceplugin.health.producer import Trigger
from hlplugin.metrics import RepairCause

TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) +[\w.-]+: ")


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A real logger writing through a formatter to a string, for one test."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("hlplugin.test-logs")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield logger, stream
    finally:
        logger.removeHandler(handler)


HOSTILE = "id\x1b[2J\x00\x07\x7f\x9b31m\u2028\u202e\ud800\tend"
ESCAPED = "id\\x1b[2J\\x00\\x07\\x7f\\x9b31m\\u2028\\u202e\\ud800\\tend"


def _raise(message: str = "boom\nsecond line") -> None:
    raise ValueError(message)


def test_json_formatter_fields_exception_and_escapes(
        captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    logger.handlers[0].setFormatter(logs.JsonFormatter())
    logger.info("repaired %s", "spec", extra={"cause": "missing", "path": Path("/x")})
    logger.warning("plain")
    try:
        _raise()
    except ValueError:
        logger.exception("failed\nbadly")
    try:
        _raise(f"bad {HOSTILE}")
    except ValueError:
        logger.exception("unknown device %s", HOSTILE, extra={"device": HOSTILE})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4
    first, second, third, hostile = (json.loads(line) for line in lines)
    assert list(first) == ["time", "level", "logger", "message", "fields"]
    assert first["level"] == "info" and first["logger"] == "hlplugin.test-logs"
    assert first["message"] == "repaired spec"
    assert first["fields"] == {"cause": "missing", "path": "/x"}
    assert datetime.fromisoformat(first["time"]).utcoffset() is not None
    assert "fields" not in second
    assert third["message"] == "failed\nbadly" and "ValueError: boom" in third["exception"]
    # Every control character escaped: the line is printable ASCII, and decodes to what was logged.
    assert lines[3].isascii() and lines[3].isprintable()
    assert hostile["message"] == f"unknown device {HOSTILE}"
    assert hostile["fields"]["device"] == HOSTILE
    assert f"ValueError: bad {HOSTILE}" in hostile["exception"]


def test_text_formatter_one_line_per_event_and_escapes(
        captured: tuple[logging.Logger, io.StringIO]) -> None:
    """Nothing reaches the line raw that could drive a terminal or split a line (a request's
    bytes in the message, a field and a traceback); printable text of any script stays as it is."""
    logger, stream = captured
    logger.handlers[0].setFormatter(logs.TextFormatter())
    logger.info("repaired %s", "spec", extra={"cause": "missing"})
    try:
        _raise()
    except ValueError:
        logger.exception("failed\nbadly", extra={"step": "open"})
    logger.warning("stack", stack_info=True)
    try:
        _raise(f"bad {HOSTILE}")
    except ValueError:
        logger.exception("unknown device %s (caf\u00e9, \u65e5\u672c)", HOSTILE,
                         extra={"device": HOSTILE})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4, lines
    assert all(TEXT_LINE.match(line) for line in lines), lines
    assert lines[0].endswith("hlplugin.test-logs: repaired spec cause='missing'")
    assert "failed\\nbadly step='open' | Traceback" in lines[1]
    assert "ValueError: boom\\nsecond line" in lines[1]
    assert "Stack (most recent call last)" in lines[2]
    assert lines[3].isprintable(), [c for c in lines[3] if not c.isprintable()]
    assert f"unknown device {ESCAPED} (caf\u00e9, \u65e5\u672c)" in lines[3]
    assert "device='id\\x1b[2J" in lines[3]  # the field, escaped by repr
    assert f"ValueError: bad {ESCAPED}" in lines[3]  # the traceback


def test_configure_replaces_handlers_and_sets_level() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.configure("json", "warning")
        assert len(root.handlers) == 1
        assert isinstance(root.handlers[0].formatter, logs.JsonFormatter)
        assert root.level == logging.WARNING
        logs.configure()
        assert isinstance(root.handlers[0].formatter, logs.TextFormatter)
        assert root.level == logging.INFO
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


def after_sigusr1(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The task dump, or the error it raised: either way a multi-line event."""
    return [line for line in lines if str(line["message"]).startswith("task ")
            or "dump_tasks" in str(line["message"])]


async def test_lasting_faults_log_once_when_they_begin_and_once_when_they_end(tmp_path: Path) -> None:
    """The CDI path obstructed by a directory and a missing device, over many retries and checks:
    one warning each when they begin, one info when the CDI one ends, none in between; and every
    line, multi-line task stacks too, a complete JSON record."""

    dev = tmp_path / "dev"
    dev.mkdir()
    node = Node.make(tmp_path, dev_dir=dev, host_dev_dir=dev)
    node.cdi_dir.mkdir()
    spec = node.cdi_dir / "hyperlight.json"
    spec.mkdir()
    async with daemon(node.serve_args("--hypervisor", "kvm", "--cdi-interval", "1",
                                      "--health-interval", "1")) as proc:
        # Many failed passes and checks: proof that the fault lasted several periods.
        await wait_metric(proc, lambda m: value(
            m, "hyperlight_cdi_refusals_total", reason="not_regular") >= 5
            and value(m, "hyperlight_probe_failures_total", reason="open") >= 3, timeout=30)
        spec.rmdir()
        await wait_until(lambda: "condition cdi is healthy" in proc.messages())
        refusals = value(await scrape(proc), "hyperlight_cdi_refusals_total", reason="not_regular")
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGUSR1)  # every task, in multi-line stacks; it lives on
        await wait_until(lambda: any(m.startswith("task ") and " waits in: " in m for m in proc.messages()))
        assert (await proc.http("/healthz"))[0] == 200
        assert await proc.stop() == 0

    def count(text: str) -> int:
        return sum(text in m for m in proc.messages())

    assert count("condition cdi is unhealthy") == 1, proc.messages()
    assert count("condition cdi is healthy") == 1
    assert count("condition device is unhealthy") == 1
    assert count("condition host_identity is unhealthy") == 1
    dump = after_sigusr1(proc.lines)  # warnings asked for
    warnings = [line for line in proc.lines
                if line["level"] in ("warning", "error") and line not in dump]
    # No kubelet runs here: once the daemon lives past a recheck interval, the lifecycle's own
    # lasting fault (no kubelet.sock) is logged too, also once.
    registration = [w for w in warnings if "kubelet.sock" in str(w["message"])]
    assert len(registration) <= 1, registration
    # cdi, device, host_identity: not one per retry
    assert len(warnings) - len(registration) <= 3, warnings
    assert refusals >= 5
    assert proc.raw and len(proc.raw) == len(proc.lines), [
        line for line in proc.raw if not line.startswith("{")]
    start = proc.lines[0]  # in JSON the settings are fields, each once, not in the message too
    assert start["message"] == f"hlplugin serve {__version__} starting", start
    assert start["fields"]["settings"]["hypervisor"] == "kvm"
    assert start["fields"]["sources"]["hypervisor"] == "flag"
    for line in proc.lines:
        assert {"time", "level", "logger", "message"} <= set(line), line
        assert line["level"] in ("debug", "info", "warning", "error")
        assert line["logger"] and isinstance(line["logger"], str)
    device = next(line for line in proc.lines
                  if line["message"].startswith("condition device is unhealthy"))
    assert device["level"] == "warning"
    assert device["fields"]["condition"] == "device"
    assert str(dev / "kvm") in device["fields"]["reason"]


async def test_a_spec_overwritten_100_times_a_second_is_logged_once_and_counted_every_time(
        tmp_path: Path) -> None:
    """The daemon as deployed (the default interval of a minute): 2 s of garbage written over the
    spec every 10 ms is repaired each time and counted each time, and logged once."""
    dev = tmp_path / "dev"
    dev.mkdir()
    node = Node.make(tmp_path, dev_dir=dev, host_dev_dir=dev)
    spec = node.cdi_dir / "hyperlight.json"
    async with daemon(node.serve_args("--hypervisor", "kvm")) as proc:
        await wait_until(lambda: any("condition cdi is healthy" in m for m in proc.messages()), 15)
        for n in range(200):
            temp = node.cdi_dir / "tamper"
            temp.write_bytes(b"{not json %d" % n)
            os.replace(temp, spec)
            await quiet(0.01, "paces the flood; the daemon repairs meanwhile")
        await wait_metric(proc, lambda m: value(
            m, "hyperlight_cdi_repairs_total", cause="malformed") >= 50, timeout=30)
        assert await proc.stop() == 0
    repaired = [m for m in proc.messages() if m.startswith("repaired CDI spec")]
    malformed = [m for m in repaired if "cause: malformed" in m]
    assert len(malformed) == 1, malformed  # the first; the rest would come a minute later
    assert len(repaired) <= 2, repaired  # and the start's first write (cause: missing)


async def test_the_longest_path_setting_is_shown_bounded_and_crashes_nothing(tmp_path: Path) -> None:
    """--dev-dir as long as the kernel takes (4,095 bytes), with `auto`: its /dev/mshv is too
    long (ENAMETOOLONG), which is "no device there"; every line and /readyz show the path cut."""
    longest = ("/" + "/".join(["d" * 255] * 17))[:4095]
    node = Node.make(tmp_path)
    async with daemon(["bootstrap", "--plugin-dir", str(node.plugin_dir), "--dev-dir", longest],
                      graceful=True) as proc:
        await wait_until(lambda: any(m.startswith("no hypervisor device under")
                                     for m in proc.messages()), 15)
        status, body = await proc.http("/readyz")
        assert status == 503
        reason = json.loads(body)["conditions"]["hypervisor"]["reason"]
        assert reason.endswith("... (4095 bytes)") and len(reason) < 400, reason
    assert not any("uncaught" in m or "Traceback" in m for m in proc.raw)
    assert max(len(line) for line in proc.raw) < 3000, max(proc.raw, key=len)[:300]


def test_enum_fields_print_as_their_values_in_either_format(
        captured: tuple[logging.Logger, io.StringIO]) -> None:
    """The CDI repair line's fields are enum members: text printed their repr
    (``cause=<RepairCause.MISSING: 'missing'>``); both formats print the value."""
    logger, stream = captured
    for formatter in (logs.TextFormatter(), logs.JsonFormatter()):
        logger.handlers[0].setFormatter(formatter)
        logger.info("repaired CDI spec", extra={"cause": RepairCause.MISSING,
                                                "trigger": Trigger.WATCH, "signal": signal.SIGHUP})
    text, entry = stream.getvalue().splitlines()
    assert text.endswith("repaired CDI spec cause='missing' signal=1 trigger='watch'"), text
    assert json.loads(entry)["fields"] == {"cause": "missing", "trigger": "watch", "signal": 1}


async def test_text_is_the_default_one_line_per_event(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    node = Node.make(tmp_path, dev_dir=dev, host_dev_dir=dev)
    # DEVICE_COUNT: one warning about the environment, for good measure.
    proc = Daemon(node.serve_args("--hypervisor", "kvm"), {"DEVICE_COUNT": "-4"})
    assert proc.args[-2:] == ["--log-format", "json"]
    del proc.args[-2:]  # what the harness adds: without it (and its twin), text is the default
    proc.env.pop("HYPERLIGHT_LOG_FORMAT", None)
    await proc.start()
    try:
        await wait_until(lambda: any("condition device is unhealthy" in line for line in proc.raw), 15)
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGUSR1)
        await wait_until(lambda: any(": task " in line or "dump_tasks" in line for line in proc.raw), 15)
    finally:
        assert await proc.stop() == 0
    bad = [line for line in proc.raw if not TEXT_LINE.match(line)]
    assert not bad, bad
    # The first line states each setting once (it was three times, 1.3 KB).
    first = proc.raw[0]
    assert "hlplugin serve" in first and " starting; from flags: " in first, first
    for name in config.SERVE_OPTIONS:
        assert len(re.findall(rf"\b{name}=", first)) == 1, (name, first)
    assert len(first) < 700, len(first)
    assert any("DEVICE_COUNT" in line and "WARNING" in line for line in proc.raw)
    device = next(line for line in proc.raw if "condition device is unhealthy" in line)
    assert "condition='device'" in device and "reason=" in device


FOREIGN = r'''
import logging, os, sys, threading
from hlplugin import __version__, config, logs

logs.configure(sys.argv[1])
logs.capture_stderr()
logging.getLogger("hlplugin.test").info("our own record")
import grpc  # a real C-core failure: binding where no directory is
from concurrent import futures
try:
    grpc.server(futures.ThreadPoolExecutor(1)).add_insecure_port("unix:///no/such/dir/x.sock")
except RuntimeError:
    pass
os.write(2, b"W1130 11:20:07.152595     339 chttp2_transport.cc:1] a warning\n")
print("printed by the interpreter \x1b[31m red", file=sys.stderr, flush=True)
thread = threading.Thread(target=lambda: 1 / 0, name="doomed")
thread.start()
thread.join()
raise ValueError("boom\nsecond line")
'''


def _foreign(fmt: str) -> tuple[int, list[str]]:
    env = {**os.environ, "GRPC_VERBOSITY": "ERROR"}
    result = subprocess.run([sys.executable, "-c", FOREIGN, fmt], capture_output=True,
                            text=True, timeout=60, env=env)
    return result.returncode, result.stderr.splitlines()


def test_everything_on_stderr_is_one_record_per_line_in_either_format() -> None:
    """gRPC's C core, the interpreter's own prints and uncaught exceptions (main thread and
    another) all come out as records of the chosen format, one per line, nothing raw."""
    code, lines = _foreign("json")
    assert code == 1  # an uncaught exception still fails the process
    entries = [json.loads(line) for line in lines]  # raises on any line that is not JSON
    by_logger: dict[str, list[dict[str, object]]] = {}
    for entry in entries:
        by_logger.setdefault(str(entry["logger"]), []).append(entry)
    assert [e["message"] for e in by_logger["hlplugin.test"]] == ["our own record"]
    core = by_logger["grpc"]
    add_port = [e for e in core if "add_port" in str(e.get("fields"))]
    assert add_port and add_port[0]["level"] == "error", core
    assert "Failed to add port" in str(add_port[0]["message"])
    assert any(e["level"] == "warning" and e["message"] == "a warning" for e in core), core
    (printed,) = by_logger["stderr"]
    assert printed["message"] == "printed by the interpreter \x1b[31m red"
    uncaught = by_logger["hlplugin"]
    assert len(uncaught) == 2, uncaught
    assert uncaught[0]["message"] == "uncaught ZeroDivisionError in thread doomed: division by zero"
    assert uncaught[1]["message"] == "uncaught ValueError: boom\nsecond line"
    assert "Traceback" in str(uncaught[1]["exception"])

    code, lines = _foreign("text")
    assert code == 1
    bad = [line for line in lines if not TEXT_LINE.match(line)]
    assert not bad, bad
    assert any(" ERROR   grpc: Failed to add port" in line and "add_port.cc" in line
               for line in lines), lines
    assert any("stderr: printed by the interpreter \\x1b[31m red" in line for line in lines)
    assert sum("uncaught" in line for line in lines) == 2


@needs_root
@pytest.mark.parametrize("guard", [False, True])
async def test_daemon_json_stderr_includes_grpc_bind_failures(tmp_path: Path, guard: bool) -> None:
    """A daemon whose socket cannot be bound (a plugin directory on read-only storage) in JSON
    mode: the failure is a JSON record like the rest (gRPC's own add_port lines; with the frame
    guard, whose socket it is there while gRPC listens on an abstract address, our warning naming
    the socket and the system's reason), and the start-up line says where each setting came
    from."""
    missing = Path(tempfile.mkdtemp(prefix="hlp-ro-", dir="/tmp"))  # short: a socket path
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(missing)], check=True)  # noqa: ASYNC221 (the loop runs nothing else here)

    try:
        env = {"HYPERLIGHT_REGISTER_TIMEOUT": "2.5", "HYPERLIGHT_HTTP_ADDRESS": "garbage"}
        proc = await Daemon(["bootstrap", "--plugin-dir", str(missing), "--dev-dir", "/dev",
                             "--hypervisor", "kvm", "--frame-guard", str(guard).lower()],
                            env).start()
        try:
            socket = missing / "hyperlight-device-access.sock"
            await wait_until(lambda: any(
                line["level"] == "warning" and line["logger"].startswith("hlplugin.")
                and f"cannot serve on {socket}: " in line["message"]
                and "Read-only file system" in line["message"]
                for line in proc.lines) if guard else sum(
                line["logger"] == "grpc" and "add_port" in str(line.get("fields"))
                for line in proc.lines) >= 2, timeout=20)
        finally:
            assert await proc.stop() == 0
        assert proc.raw and len(proc.raw) == len(proc.lines), [
            line for line in proc.raw if not line.startswith("{")]
        start = proc.lines[0]
        assert start["message"] == f"hlplugin bootstrap {__version__} starting"  # values: fields
        assert start["fields"]["version"] == __version__
        assert start["fields"]["sources"] == {
            "plugin_dir": "flag", "dev_dir": "flag", "hypervisor": "flag",
            "http_address": "flag",  # the harness passes it, so the environment's is unused
            "log_format": "flag", "log_level": "default", "register_timeout": "environment",
            "frame_guard": "flag"}
        assert start["fields"]["settings"]["register_timeout"] == "2.5"
        assert start["fields"]["settings"]["plugin_dir"] == str(missing)
    finally:
        subprocess.run(["umount", str(missing)], check=True)  # noqa: ASYNC221 (the loop runs nothing else here)
        missing.rmdir()  # noqa: ASYNC240 (the loop runs nothing else here)
