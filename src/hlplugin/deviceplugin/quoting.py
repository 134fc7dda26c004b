"""What we were given, for a message or a log line: a bounded, escaped prefix, never all of it.

Any flag, environment value or request field may be huge (128 KiB per argument string, 4 MiB per
gRPC message) or hold control characters; a message that echoes it whole floods the log or drives
the operator's terminal. Standard library only: the settings and the path checks use it before
anything else is imported.
"""

from __future__ import annotations

# A refusal quotes this much of a request's input; a setting's value in a usage error too.
QUOTE_CHARS = 64


def size(text: str) -> str:
    """``text``'s size as a message states it, in bytes as the kernel or the wire counted them
    (an undecodable byte that Python kept as a surrogate counts one)."""
    return f"{len(text.encode(errors='replace'))} bytes"


def quote(text: str, limit: int = QUOTE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, then escaped (repr); a cut one ends in ``...`` and
    its whole size."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({size(text)})"


def clip(text: str, limit: int) -> str:
    """``text`` unquoted, cut to ``limit`` characters (``...`` and its size after a cut). Not
    escaped: for a log line, whose formatter escapes, or after an escape of one's own."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({size(text)})"
