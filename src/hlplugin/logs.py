"""One line per event: plain text by default, JSON with --log-format json.

A daemon's stderr carries only its own records: what gRPC's C core and the interpreter print
straight to fd 2 is read back through a pipe and re-emitted as records of the same format
(``capture_stderr``), and an uncaught exception is one record, not a bare traceback.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import logging
import os
import re
import sys
import threading
from datetime import UTC, datetime
from enum import Enum
from types import TracebackType
from typing import IO, Any

_STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}

_NOT_PLAIN = re.compile(r"[^\x20-\x7e]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(match: re.Match[str]) -> str:
    char = match.group()
    if char.isprintable():  # letters, marks, symbols of any script stay readable
        return char
    code = ord(char)
    if char in _NAMED:
        return _NAMED[char]
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def escape(text: str) -> str:
    """``text`` with every non-printable character (C0 and C1 controls, DEL, line and paragraph
    separators, format characters, lone surrogates) as a backslash escape: a value that came from
    a request can neither split a log line nor drive the operator's terminal."""
    return _NOT_PLAIN.sub(_escape_char, text)


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """The record's own fields; an enum member as its value (``cause='missing'``, not its repr)."""
    return {k: v.value if isinstance(v, Enum) else v for k, v in vars(record).items()
            if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """One JSON object per record; json.dumps escapes every control and non-ASCII character."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = _fields(record)
        if fields:
            entry["fields"] = fields
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, sort_keys=False)


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message key=value...``; a multi-line message or traceback is folded
    into the one line (newlines as ``\\n``), so a log collector never splits an event, and every
    other non-printable character is escaped too (see ``escape``)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        record.asctime = self.formatTime(record)
        line = self.formatMessage(record)
        fields = _fields(record)
        if fields:
            line += " " + " ".join(f"{k}={v!r}" for k, v in sorted(fields.items()))
        if record.exc_info:
            line += " | " + self.formatException(record.exc_info)
        if record.stack_info:
            line += " | " + self.formatStack(record.stack_info)
        return escape(line)


def configure(fmt: str = "text", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("grpc").setLevel(logging.WARNING)


# gRPC's C core (abseil format): "E1130 11:20:07.152595     339 add_port.cc:83] message".
_CORE_LINE = re.compile(r"([EWID])\d{4} [\d:.]+ +\d+ ([^\]\s]+)\] ?(.*)", re.DOTALL)
_CORE_LEVELS = {"E": logging.ERROR, "W": logging.WARNING, "I": logging.INFO, "D": logging.DEBUG}
_MAX_LINE = 16 * 1024  # a longer foreign "line" is cut into records of this size


def foreign_record(line: str) -> logging.LogRecord:
    """A record for one line something else printed on our stderr: gRPC's C core (logger
    "grpc", its level and source file kept), else the interpreter or a library (logger "stderr",
    level warning: nothing prints there on purpose in a healthy daemon)."""
    match = _CORE_LINE.fullmatch(line)
    if match:
        level, source, message = match.groups()
        return logging.makeLogRecord({"name": "grpc", "levelno": _CORE_LEVELS[level],
                                      "levelname": logging.getLevelName(_CORE_LEVELS[level]),
                                      "msg": message, "source": source})
    return logging.makeLogRecord({"name": "stderr", "levelno": logging.WARNING,
                                  "levelname": "WARNING", "msg": line})


class StderrCapture:
    """fd 2 becomes a pipe; a thread turns each line written to it into a record, written by the
    root handlers to the original stderr. Bytes written by C code in any thread are caught; a
    daemon's own records never pass through the pipe."""

    def __init__(self) -> None:
        self.real: IO[str] = open(  # noqa: SIM115 - lives as long as the process
            os.dup(2), "w", buffering=1, encoding="utf-8", errors="backslashreplace")
        read_end, write_end = os.pipe()
        sys.stderr.flush()
        os.dup2(write_end, 2)
        os.close(write_end)
        self._read_end = read_end
        self._thread = threading.Thread(target=self._pump, name="hlplugin-stderr", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self._read_end, 65536)
            except InterruptedError:  # pragma: no cover - PEP 475 retries reads
                continue
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            while len(pending) > _MAX_LINE:
                lines.append(pending[:_MAX_LINE])
                pending = pending[_MAX_LINE:]
            for line in lines:
                self._emit(line)
        if pending:
            self._emit(pending)
        os.close(self._read_end)

    def _emit(self, raw: bytes) -> None:
        text = raw.decode("utf-8", errors="backslashreplace").rstrip("\r")
        if not text.strip():
            return
        record = foreign_record(text)
        for handler in logging.getLogger().handlers:
            handler.handle(record)

    def close(self, timeout: float = 1.0) -> None:
        """Give fd 2 back to the real stderr and forward what is still in the pipe."""
        with contextlib.suppress(ValueError, OSError):
            sys.stderr.flush()
        os.dup2(self.real.fileno(), 2)  # closes the pipe's last write end: the pump sees EOF
        self._thread.join(timeout)


def capture_stderr() -> StderrCapture:
    """Route everything on fd 2 through the root handlers' format (call after ``configure``).

    Also logs uncaught exceptions (main thread, other threads, unraisable ones) as one record
    each, and points faulthandler, which writes from a signal handler and cannot wait for the
    pump, at the real stderr.
    """
    capture = StderrCapture()
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(capture.real)
    if faulthandler.is_enabled():
        faulthandler.enable(file=capture.real, all_threads=True)
    log = logging.getLogger("hlplugin")

    def excepthook(kind: type[BaseException], value: BaseException,
                   tb: TracebackType | None) -> None:
        log.error("uncaught %s: %s", kind.__name__, value, exc_info=(kind, value, tb))

    def thread_excepthook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        value = args.exc_value if args.exc_value is not None else args.exc_type()
        log.error("uncaught %s in thread %s: %s", args.exc_type.__name__, name, value,
                  exc_info=(args.exc_type, value, args.exc_traceback))

    def unraisablehook(args: Any) -> None:
        exc = args.exc_value
        info = (args.exc_type, exc, args.exc_traceback) if exc is not None else None
        log.error("%s: %r", args.err_msg or "exception ignored", args.object, exc_info=info)

    # Warnings as records written straight to the real stderr: some come at interpreter exit,
    # after the pipe is gone ("coroutine ... was never awaited" from a library's finalizer).
    logging.captureWarnings(True)
    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
    sys.unraisablehook = unraisablehook
    atexit.register(capture.close)
    return capture
