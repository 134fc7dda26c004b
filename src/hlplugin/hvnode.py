"""Which hypervisor node is there, and whether a node is the hypervisor, from the kernel's own
names. Standard library only: the bootstrap checks its node with this without loading the prober
or the CDI code, and settings detect the hypervisor with it.

Both hypervisors are misc devices (kvm is 10:232; mshv gets a dynamic minor), so the kernel names
each one's numbers in sysfs, ``/sys/class/misc/<name>/dev`` ("10:232"), and in ``/proc/misc``
("232 kvm"). A character device with other numbers (``/dev/null``'s, say) at the device path is
not the hypervisor, however usable it looks to a stat.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hlplugin.deviceplugin.files import char_device

HYPERVISORS = ("mshv", "kvm")  # auto's order of preference, as upstream
SYS_DIR = Path("/sys")
PROC_MISC = Path("/proc/misc")
MISC_MAJOR = 10


def detect(dev_dir: Path) -> str | None:
    """The hypervisor whose node is in ``dev_dir`` (mshv over kvm), by lstat: a symlink at either
    name does not count (it is never followed), whatever it points at."""
    for name in HYPERVISORS:
        try:
            st = os.lstat(dev_dir / name)
        except OSError:
            continue
        if not stat.S_ISLNK(st.st_mode):
            return name
    return None


def skipped(dev_dir: Path) -> list[str]:
    """Why detect() passed over a name that is there: one phrase per symlink, for the log."""
    found = []
    for name in HYPERVISORS:
        try:
            st = os.lstat(dev_dir / name)
        except OSError:
            continue  # missing, or a path the kernel refuses (ENAMETOOLONG): nothing to say
        if stat.S_ISLNK(st.st_mode):
            found.append(f"{name} is a symlink (not followed)")
    return found


def misc_numbers(name: str, sys_dir: Path = SYS_DIR, proc_misc: Path = PROC_MISC) -> int:
    """The device number the kernel gave the misc device ``name``: from sysfs, or from /proc/misc
    where sysfs has no misc class (not mounted). Raises LookupError saying why it is unknown."""
    misc = sys_dir / "class" / "misc"
    if misc.is_dir():
        source = misc / name / "dev"
        try:
            text = source.read_text(encoding="ascii", errors="replace")
        except OSError as exc:
            raise LookupError(f"the kernel has no misc device {name} ({source}: "
                              f"{exc.strerror})") from exc
        major, _, minor = text.strip().partition(":")
        if major.isdigit() and minor.isdigit():
            return os.makedev(int(major), int(minor))
        raise LookupError(f"{source} holds {text.strip()[:40]!r}, not MAJOR:MINOR")
    try:
        lines = proc_misc.read_text(encoding="ascii", errors="replace").splitlines()
    except OSError as exc:
        raise LookupError(f"cannot read {misc} or {proc_misc}: {exc.strerror}") from exc
    for line in lines:
        minor, _, named = line.strip().partition(" ")
        if named.strip() == name and minor.isdigit():
            return os.makedev(MISC_MAJOR, int(minor))
    raise LookupError(f"the kernel has no misc device {name} ({proc_misc} does not list it)")


def node_problem(path: Path, hypervisor: str, sys_dir: Path = SYS_DIR,
                 proc_misc: Path = PROC_MISC) -> str:
    """Why ``path`` is not ``hypervisor``'s device node, or "" when it is: a character device
    (lstat: a symlink is refused) with the numbers the kernel gave the hypervisor."""
    try:
        st, kind = char_device(path)
    except OSError as exc:
        return f"{path}: {exc.strerror} (errno {exc.errno})"
    if kind:
        return f"{path} is not a character device ({kind})"
    try:
        want = misc_numbers(hypervisor, sys_dir, proc_misc)
    except LookupError as exc:
        return f"cannot tell whether {path} is {hypervisor}: {exc}"
    if st.st_rdev != want:
        return (f"{path} is device {_numbers(st.st_rdev)}, not {hypervisor} "
                f"({_numbers(want)})")
    return ""


def _numbers(rdev: int) -> str:
    return f"{os.major(rdev)}:{os.minor(rdev)}"
