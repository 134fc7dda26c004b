"""Proof that a hypervisor device is usable (the bounded way to ask for it is deviceplugin.health.bounded).

Standard library only (with the generic package's standard-library helpers, bounded and files):
the same checks run inside a workload container to check what it was given.

A KVM check lstats the node (a character device; a symlink is refused, never followed), opens it
with O_NOFOLLOW, asks for the API version, creates a VM and (with ``guest``) runs a
three-instruction real-mode guest to its ``hlt``: a node that merely exists, or a VM that cannot
run, is not a usable device. Without the guest it is the upstream plugin's check (0.2-0.45 ms),
the one every Allocate runs. MSHV is only checked for being a character device that opens
read/write (no VM is created: the upstream check, nothing here can verify more).
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import fcntl
import mmap
import os
import stat
import struct
import threading
from contextlib import ExitStack, suppress
from pathlib import Path

from hlplugin.deviceplugin.files import char_device, kind_of
from hlplugin.deviceplugin.health.bounded import CheckFailed

# Short, bounded failure reasons (metric labels): never paths, errnos or free text.
REASONS = ("open", "api_version", "create_vm", "guest", "not_char_device", "identity_missing",
           "identity_mismatch", "timeout", "budget", "error")


class ProbeError(CheckFailed):
    """A device check failed: which ``step``, on which ``path``, with the kernel's ``errno`` if any.

    ``reason`` is one of REASONS, for metrics; the message is what a person reads.
    """

    def __init__(self, message: str, *, step: str, path: Path | None = None,
                 errno: int | None = None, reason: str = "error") -> None:
        super().__init__(message, step=step, reason=reason)
        self.path = path
        self.errno = errno

    @classmethod
    def from_os_error(cls, exc: OSError, *, step: str, path: Path, reason: str) -> ProbeError:
        text = f"{step} on {path} failed: [Errno {exc.errno}] {exc.strerror}"
        return cls(text, step=step, path=path, errno=exc.errno, reason=reason)


# --- KVM ABI (linux/kvm.h, x86_64) --------------------------------------------------------------

_KVMIO = 0xAE


def _io(nr: int) -> int:
    return (_KVMIO << 8) | nr


def _iow(nr: int, size: int) -> int:
    return (1 << 30) | (size << 16) | (_KVMIO << 8) | nr


def _ior(nr: int, size: int) -> int:
    return (2 << 30) | (size << 16) | (_KVMIO << 8) | nr


_MEM_REGION = struct.Struct("=IIQQQ")  # slot, flags, guest_phys_addr, memory_size, userspace_addr
_REGS_SIZE = 18 * 8                    # struct kvm_regs: rax..r15, rip, rflags
_SREGS_SIZE = 8 * 24 + 2 * 16 + 7 * 8 + 4 * 8  # 8 segments, gdt/idt, cr0..apic_base, bitmap

KVM_API_VERSION = 12
KVM_GET_API_VERSION = _io(0x00)
KVM_CREATE_VM = _io(0x01)
KVM_GET_VCPU_MMAP_SIZE = _io(0x04)
KVM_CREATE_VCPU = _io(0x41)
KVM_SET_USER_MEMORY_REGION = _iow(0x46, _MEM_REGION.size)
KVM_RUN = _io(0x80)
KVM_SET_REGS = _iow(0x82, _REGS_SIZE)
KVM_GET_SREGS = _ior(0x83, _SREGS_SIZE)
KVM_SET_SREGS = _iow(0x84, _SREGS_SIZE)

KVM_EXIT_IO = 2
KVM_EXIT_HLT = 5
KVM_EXIT_IO_OUT = 1

_RUN_EXIT_REASON = 8   # offsetof(struct kvm_run, exit_reason)
_RUN_IO = 32           # offsetof(struct kvm_run, io): direction u8, size u8, port u16, count u32,
_IO = struct.Struct("=BBHIQ")  # data_offset u64

_GUEST_ADDR = 0x1000
_GUEST_PORT = 0x10
_GUEST_VALUE = 42
_GUEST_CODE = bytes((0xB0, _GUEST_VALUE, 0xE6, _GUEST_PORT, 0xF4))  # mov al,42; out 0x10,al; hlt
_PAGE = mmap.PAGESIZE

_EXIT_NAMES = {0: "UNKNOWN", 2: "IO", 5: "HLT", 6: "MMIO", 8: "SHUTDOWN", 9: "FAIL_ENTRY",
               17: "INTERNAL_ERROR"}


def _ioctl(fd: int, request: int, arg: int | bytes | bytearray, *, step: str, path: Path,
           reason: str) -> int:
    """fcntl.ioctl with the failure turned into a ProbeError naming the step; EINTR retried."""
    while True:
        try:
            if isinstance(arg, bytearray):
                return int(fcntl.ioctl(fd, request, arg, True))
            if isinstance(arg, bytes):
                fcntl.ioctl(fd, request, arg)  # the return value is a copy of arg
                return 0
            return fcntl.ioctl(fd, request, arg)
        except InterruptedError:
            continue
        except OSError as exc:
            raise ProbeError.from_os_error(exc, step=step, path=path, reason=reason) from exc


def _open(path: Path, stack: ExitStack) -> int:
    """Open the device node ``path`` read/write, as upstream does: lstat first (only a character
    device is opened; a symlink is refused, never followed), then O_NOFOLLOW, then fstat of what
    was opened must be the node that was lstat'd (nothing swapped in between)."""
    node = _lstat_char(path, "device", "open")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno_mod.ELOOP:  # a symlink put there after the lstat
            raise ProbeError(f"device {path} is not a character device (a symlink)", step="open",
                             path=path, reason="not_char_device") from exc
        raise ProbeError.from_os_error(exc, step="open", path=path, reason="open") from exc
    stack.callback(os.close, fd)
    opened = os.fstat(fd)
    if not stat.S_ISCHR(opened.st_mode) or opened.st_rdev != node.st_rdev:
        raise ProbeError(f"device {path} changed while it was opened (now {kind_of(opened.st_mode)}"
                         f" {_numbers(opened.st_rdev)}, was {_numbers(node.st_rdev)})",
                         step="open", path=path, reason="open")
    return fd


def _api_version(kvm: int, path: Path) -> int:
    version = _ioctl(kvm, KVM_GET_API_VERSION, 0, step="KVM_GET_API_VERSION", path=path,
                     reason="api_version")
    if version != KVM_API_VERSION:
        raise ProbeError(
            f"KVM_GET_API_VERSION on {path} returned {version}, expected {KVM_API_VERSION}",
            step="KVM_GET_API_VERSION", path=path, reason="api_version")
    return version


def kvm_api_version(path: Path) -> int:
    """probe_kvm's first step alone: open ``path`` and check its KVM API version."""
    with ExitStack() as stack:
        return _api_version(_open(path, stack), path)


def probe_kvm(path: Path, guest: bool = True, *, close_later: bool = False) -> None:
    """Raise ProbeError unless ``path`` is a KVM that creates a VM (with ``guest``: and runs it).

    With ``close_later`` (and no guest) the VM and the node stay open until close_deferred() in
    the same thread: closing them is half the check's time, so a helper can hand the answer out
    first and close after."""
    with ExitStack() as stack:
        kvm = _open(path, stack)
        _api_version(kvm, path)
        vm = _ioctl(kvm, KVM_CREATE_VM, 0, step="KVM_CREATE_VM", path=path, reason="create_vm")
        stack.callback(os.close, vm)
        if guest:
            _run_guest(kvm, vm, path, stack)
        elif close_later:
            close_deferred()  # at most one left open per thread, whoever runs this
            _DEFERRED.stack = stack.pop_all()


_DEFERRED = threading.local()  # per helper thread: the ExitStack of the VM a check left open


def close_deferred() -> None:
    """Close the VM that a ``close_later`` check left open in this thread (if any): its helper
    calls this once the check's result is out (BoundedRunner.after)."""
    stack: ExitStack | None = getattr(_DEFERRED, "stack", None)
    _DEFERRED.stack = None
    if stack is not None:
        with suppress(OSError):  # a failed close of a check's own descriptor
            stack.close()


def _run_guest(kvm: int, vm: int, path: Path, stack: ExitStack) -> None:
    """Run ``mov al,42; out 0x10,al; hlt`` in real mode; expect the OUT exit, then HLT."""

    def ioctl(fd: int, request: int, arg: int | bytes | bytearray, step: str) -> int:
        return _ioctl(fd, request, arg, step=step, path=path, reason="guest")

    # Unmapped before the VM fd closes (ExitStack unwinds in reverse), once the vCPU is gone;
    # KVM follows the unmap, so that order is safe.
    memory = mmap.mmap(-1, _PAGE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                       mmap.PROT_READ | mmap.PROT_WRITE)
    stack.callback(memory.close)
    memory[: len(_GUEST_CODE)] = _GUEST_CODE
    view = (ctypes.c_char * _PAGE).from_buffer(memory)
    address = ctypes.addressof(view)
    del view  # an exported buffer would make memory.close() fail
    ioctl(vm, KVM_SET_USER_MEMORY_REGION, _MEM_REGION.pack(0, 0, _GUEST_ADDR, _PAGE, address),
          "KVM_SET_USER_MEMORY_REGION")

    vcpu = ioctl(vm, KVM_CREATE_VCPU, 0, "KVM_CREATE_VCPU")
    stack.callback(os.close, vcpu)
    run_size = ioctl(kvm, KVM_GET_VCPU_MMAP_SIZE, 0, "KVM_GET_VCPU_MMAP_SIZE")
    try:
        run = mmap.mmap(vcpu, run_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise ProbeError.from_os_error(exc, step="mmap kvm_run", path=path, reason="guest") from exc
    stack.callback(run.close)

    sregs = bytearray(_SREGS_SIZE)
    ioctl(vcpu, KVM_GET_SREGS, sregs, "KVM_GET_SREGS")
    struct.pack_into("=Q", sregs, 0, 0)   # cs.base
    struct.pack_into("=H", sregs, 12, 0)  # cs.selector
    ioctl(vcpu, KVM_SET_SREGS, bytes(sregs), "KVM_SET_SREGS")
    regs = [0] * 18
    regs[16] = _GUEST_ADDR  # rip
    regs[17] = 0x2          # rflags: the reserved bit that must be set
    ioctl(vcpu, KVM_SET_REGS, struct.pack("=18Q", *regs), "KVM_SET_REGS")

    def enter() -> int:
        ioctl(vcpu, KVM_RUN, 0, "KVM_RUN")
        return int(struct.unpack_from("=I", run, _RUN_EXIT_REASON)[0])

    def unexpected(got: int, wanted: str, detail: str = "") -> ProbeError:
        name = _EXIT_NAMES.get(got, str(got))
        return ProbeError(f"guest on {path}: expected exit {wanted}, got {name}{detail}",
                          step="guest exit", path=path, reason="guest")

    exit_reason = enter()
    if exit_reason != KVM_EXIT_IO:
        raise unexpected(exit_reason, "IO")
    direction, size, port, count, data_offset = _IO.unpack_from(run, _RUN_IO)
    value = run[data_offset] if 0 <= data_offset < run_size else -1
    if (direction, size, port, count, value) != (KVM_EXIT_IO_OUT, 1, _GUEST_PORT, 1, _GUEST_VALUE):
        raise unexpected(exit_reason, f"IO out port {_GUEST_PORT:#x} value {_GUEST_VALUE}",
                         f" direction {direction} port {port:#x} size {size} value {value}")
    exit_reason = enter()
    if exit_reason != KVM_EXIT_HLT:
        raise unexpected(exit_reason, "HLT")


def _lstat_char(path: Path, what: str, missing_reason: str) -> os.stat_result:
    """lstat ``path`` and insist on a character device (a symlink or a regular file is refused)."""
    try:
        st, kind = char_device(path)
    except OSError as exc:
        reason = missing_reason if exc.errno == errno_mod.ENOENT else "open"
        raise ProbeError(f"{what} {path} is missing: [Errno {exc.errno}] {exc.strerror}"
                         if exc.errno == errno_mod.ENOENT else
                         f"lstat on {path} failed: [Errno {exc.errno}] {exc.strerror}",
                         step="lstat", path=path, errno=exc.errno, reason=reason) from exc
    if kind:
        raise ProbeError(f"{what} {path} is not a character device ({kind})",
                         step="lstat", path=path, reason="not_char_device")
    return st


def probe_mshv(path: Path) -> None:
    """Raise ProbeError unless ``path`` is a character device (no symlink) that opens read/write."""
    with ExitStack() as stack:
        _open(path, stack)


def check_host_identity(dev_path: Path, host_path: Path) -> None:
    """Raise ProbeError unless the host's node is a character device with ``dev_path``'s numbers.

    The device we were given (``dev_path``) keeps working after the host node is deleted or
    replaced, so only the host view tells whether new containers can still get it (CDI injects the
    host path).
    """
    dev = _lstat_char(dev_path, "device", "identity_missing")  # a symlink is refused, not followed
    host = _lstat_char(host_path, "host device node", "identity_missing")
    if host.st_rdev != dev.st_rdev:
        raise ProbeError(
            f"host device node {host_path} is {_numbers(host.st_rdev)}, but {dev_path} is "
            f"{_numbers(dev.st_rdev)}", step="identity", path=host_path, reason="identity_mismatch")


def _numbers(rdev: int) -> str:
    return f"{os.major(rdev)}:{os.minor(rdev)}"


def probe_device(hypervisor: str, dev_dir: Path, guest: bool = True, *,
                 close_later: bool = False) -> None:
    """Check ``dev_dir/<hypervisor>`` with the hypervisor's prober."""
    path = dev_dir / hypervisor
    if hypervisor == "kvm":
        probe_kvm(path, guest, close_later=close_later)
    elif hypervisor == "mshv":
        probe_mshv(path)
    else:
        raise ValueError(f"unknown hypervisor {hypervisor!r}")
