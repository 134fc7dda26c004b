"""A workload that holds one KVM VM for its whole life and runs its guest again and again.

Run inside a workload container (tests/test_node_workload.py): it opens /dev/kvm once, creates
one VM with one vCPU, then re-enters the guest (``mov al,42; out 0x10,al; hlt``) from its first
instruction every 20 ms, printing ``guest runs: N`` about twice a second. Any failure (a lost
device, a guest that misbehaves) prints FAILED and exits 1, so the container stops.
"""

import ctypes
import fcntl
import mmap
import os
import signal
import struct
import sys
import time

from hlplugin import probe as kvm_abi  # the ioctl numbers and the guest, as the probe uses them


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    kvm = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    vm = fcntl.ioctl(kvm, kvm_abi.KVM_CREATE_VM, 0)
    page = kvm_abi._PAGE
    memory = mmap.mmap(-1, page, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                       mmap.PROT_READ | mmap.PROT_WRITE)
    memory[: len(kvm_abi._GUEST_CODE)] = kvm_abi._GUEST_CODE
    view = (ctypes.c_char * page).from_buffer(memory)
    address = ctypes.addressof(view)
    del view
    fcntl.ioctl(vm, kvm_abi.KVM_SET_USER_MEMORY_REGION,
                kvm_abi._MEM_REGION.pack(0, 0, kvm_abi._GUEST_ADDR, page, address))
    vcpu = fcntl.ioctl(vm, kvm_abi.KVM_CREATE_VCPU, 0)
    size = fcntl.ioctl(kvm, kvm_abi.KVM_GET_VCPU_MMAP_SIZE, 0)
    run = mmap.mmap(vcpu, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    sregs = bytearray(kvm_abi._SREGS_SIZE)
    fcntl.ioctl(vcpu, kvm_abi.KVM_GET_SREGS, sregs, True)
    struct.pack_into("=Q", sregs, 0, 0)   # cs.base
    struct.pack_into("=H", sregs, 12, 0)  # cs.selector
    fcntl.ioctl(vcpu, kvm_abi.KVM_SET_SREGS, bytes(sregs))
    print(f"holding VM fd {vm} (pid {os.getpid()})", flush=True)
    runs, shown = 0, 0.0
    while True:
        regs = [0] * 18
        regs[16], regs[17] = kvm_abi._GUEST_ADDR, 0x2  # rip, rflags
        fcntl.ioctl(vcpu, kvm_abi.KVM_SET_REGS, struct.pack("=18Q", *regs))
        exits = []
        for _ in range(2):
            fcntl.ioctl(vcpu, kvm_abi.KVM_RUN, 0)
            exits.append(struct.unpack_from("=I", run, kvm_abi._RUN_EXIT_REASON)[0])
        if exits != [kvm_abi.KVM_EXIT_IO, kvm_abi.KVM_EXIT_HLT]:
            print(f"FAILED: guest exits {exits} after {runs} runs", flush=True)
            return 1
        runs += 1
        if time.monotonic() - shown >= 0.5:
            print(f"guest runs: {runs}", flush=True)
            shown = time.monotonic()
        time.sleep(0.02)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except OSError as exc:
        print(f"FAILED: {exc}", flush=True)
        sys.exit(1)
