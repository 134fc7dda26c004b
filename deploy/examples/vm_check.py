"""Prove that this container can create a VM through the injected device.

The example workloads run this as UID 65534 with every capability dropped.
With KVM it opens /dev/kvm, checks the API version and creates an empty VM;
with MSHV it opens /dev/mshv read-write. Exit status 0 means success.

    python3 vm_check.py                  # check once
    python3 vm_check.py --interval 60    # check every 60 s until one fails or SIGTERM
"""

import argparse
import fcntl
import os
import signal
import sys
import time

KVM_GET_API_VERSION = 0xAE00
KVM_CREATE_VM = 0xAE01
KVM_API_VERSION = 12


def check(dev_dir: str) -> str:
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        raise RuntimeError("running as root: the example must prove non-root access")
    kvm = os.path.join(dev_dir, "kvm")
    mshv = os.path.join(dev_dir, "mshv")
    if os.path.exists(kvm):
        fd = os.open(kvm, os.O_RDWR | os.O_CLOEXEC)
        try:
            version = fcntl.ioctl(fd, KVM_GET_API_VERSION)
            if version != KVM_API_VERSION:
                raise RuntimeError(f"unexpected KVM API version {version}")
            os.close(fcntl.ioctl(fd, KVM_CREATE_VM, 0))
        finally:
            os.close(fd)
        return f"created a KVM VM as uid={uid} gid={gid} (KVM API {version})"
    if os.path.exists(mshv):
        os.close(os.open(mshv, os.O_RDWR | os.O_CLOEXEC))
        return f"opened {mshv} read-write as uid={uid} gid={gid}"
    raise RuntimeError(f"no hypervisor device in {dev_dir}: was hyperlight.dev/hypervisor requested?")


def stop(signum: int, frame: object) -> None:
    """SIGTERM: exit now. As a container's PID 1 the process would otherwise ignore it (the
    kernel gives PID 1 no default action), and every pod stop would wait out the grace period."""
    print("hyperlight-vm-check: stopping on SIGTERM", flush=True)
    sys.exit(0)


def main() -> int:
    signal.signal(signal.SIGTERM, stop)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=0, help="repeat every N seconds")
    parser.add_argument("--dev-dir", default="/dev", help="where the device node is")
    args = parser.parse_args()
    while True:
        try:
            print(f"hyperlight-vm-check: {check(args.dev_dir)}", flush=True)
        except (OSError, RuntimeError) as err:
            print(f"hyperlight-vm-check: FAILED: {err}", file=sys.stderr, flush=True)
            return 1
        if args.interval <= 0:
            return 0
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
