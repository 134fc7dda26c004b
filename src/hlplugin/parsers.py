"""What a flag's or an environment variable's text must be: each parser turns it into a setting
or raises ValueError with a reason an operator can act on (config names the flag or variable).
The ranges come from hlplugin.settings."""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable
from pathlib import Path

from hlplugin import durations
from hlplugin.deviceplugin import files
from hlplugin.deviceplugin.quoting import quote
from hlplugin.settings import (
    INTERVAL_RANGE,
    MAX_DEVICE_COUNT,
    MAX_POD_UID,
    MAX_SLOTS,
    TIMEOUT_RANGE,
    UINT32_MAX,
)

# ASCII only: int() also takes Arabic-Indic and full-width digits, and "1_000".
DIGITS = re.compile(r"[0-9]{1,20}")


def ascii_int(text: str) -> int:
    stripped = text.strip()
    if not DIGITS.fullmatch(stripped):
        raise ValueError(f"must be a whole number in ASCII digits, got {text[:40]!r}")
    return int(stripped, 10)


def int_range(low: int, high: int, why: str = "") -> Callable[[str], int]:
    return durations.within(ascii_int, low, high, f"a whole number from {low} to {high}{why}")


device_count = int_range(1, MAX_DEVICE_COUNT,
                           " (a longer device list nears the kubelet's 4 MiB message limit)")
slots = int_range(1, MAX_SLOTS, " (more containers than a node runs)")
uint32 = int_range(0, UINT32_MAX, " (the CDI uint32 range)")


interval = durations.seconds_range(*INTERVAL_RANGE)
timeout = durations.seconds_range(*TIMEOUT_RANGE)


def choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {quote(text)}")
        return value

    return parse


def path(text: str) -> Path:
    """An absolute path the kernel takes (PATH_MAX, NAME_MAX): one it would refuse with
    ENAMETOOLONG is refused here, not met as an OSError wherever it is first used."""
    if not text:
        raise ValueError("must not be empty")
    problem = files.path_problem(text)
    absolute = os.path.abspath(text)  # a unix:// socket address needs an absolute path
    if not problem and absolute != text:  # the working directory counts too
        problem = files.path_problem(absolute)
    if problem:
        raise ValueError(problem)
    return Path(absolute)


def optional_path(text: str) -> Path | None:
    return path(text) if text else None


def address(text: str) -> tuple[str, int]:
    """HOST:PORT, [IPV6]:PORT (``[::]`` is every address, IPv4 too where the kernel allows) or
    :PORT (every IPv4 address). A host that is neither an IP address nor a DNS name is refused
    here; one that does not resolve is found when the daemon binds, which then exits 1."""
    text = text.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ValueError(f"must be [IPV6]:PORT, got {text[:60]!r}")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host[:60]!r} is not an IPv6 address") from None
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise ValueError(f"must be HOST:PORT, got {text[:60]!r}")
        if ":" in host:
            raise ValueError(f"an IPv6 address goes in brackets, as in [::]:8080, got {text[:60]!r}")
        host = host or "0.0.0.0"
        # A DNS name (letters, digits, hyphens; labels of 1-63) or a dotted IPv4 address.
        label = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
        if len(host) > 253 or not re.fullmatch(rf"{label}(\.{label})*\.?", host):
            raise ValueError(f"{host[:60]!r} is not an IP address or a host name")
    number = int(port, 10) if DIGITS.fullmatch(port) else -1
    if not 0 <= number <= 65535:
        raise ValueError(f"port must be 0-65535, got {port[:40]!r}")
    return host, number


def pod_uid(text: str) -> str:
    """Letters, digits and hyphens: the UID goes into socket names."""
    value = text.strip()
    if not re.fullmatch(rf"[A-Za-z0-9-]{{0,{MAX_POD_UID}}}", value):
        raise ValueError(f"must be a pod UID (letters, digits, hyphens, at most {MAX_POD_UID}), "
                         f"got {quote(text)}")
    return value


def node_name(text: str) -> str:
    """A DNS subdomain (a node's name), or empty."""
    value = text.strip()
    label = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
    if value and (len(value) > 253 or not re.fullmatch(rf"{label}(\.{label})*", value)):
        raise ValueError(f"must be a node name (a lowercase DNS subdomain), got {quote(text)}")
    return value


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"must be true or false, got {quote(text)}")
