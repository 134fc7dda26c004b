"""End to end: podman, a real CDI consumer, resolves the spec CdiReconciler writes.

podman 4.3 reads CDI specs only from /etc/cdi and /var/run/cdi, so each run happens in a private
mount namespace with the test's directory bound over /var/run/cdi; the machine's own stays as it
is. The container runs the host's python3 from a root filesystem of read-only bind mounts.
podman accepting the spec at all also guards its constant cdiVersion.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import operator
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hlplugin.cdi import CdiReconciler
from hlplugin.cdi_spec import check_file, qualified_name, render_spec
from hlplugin.settings import CdiSettings

KVM = Path("/dev/kvm")
MOUNTPOINT = Path("/var/run/cdi")
UID = GID = 65534
TOOLS = ("podman", "runc", "unshare", "mount")
SYSTEM_DIRS = ("usr", "lib", "lib64", "bin")
node_of = operator.attrgetter("st_mode", "st_uid", "st_gid", "st_rdev")

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="podman in a private mount namespace needs root"),
    pytest.mark.skipif(not KVM.exists(), reason="no /dev/kvm on this machine"),
    pytest.mark.skipif(not all(map(shutil.which, TOOLS)), reason=f"needs all of {', '.join(TOOLS)} on PATH"),
]

# Runs inside the container; prints one JSON line.
PROBE = r"""
import errno, fcntl, json, os, stat
out = {"uid": os.getuid(), "gid": os.getgid(),
       "env": {k: v for k, v in os.environ.items() if k.startswith("HYPERLIGHT_")}}
try:
    fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
except OSError as exc:
    out["open_error"] = errno.errorcode[exc.errno]
else:
    st = os.fstat(fd)
    out["node"] = [stat.S_ISCHR(st.st_mode), oct(stat.S_IMODE(st.st_mode)), st.st_uid, st.st_gid,
                   os.major(st.st_rdev), os.minor(st.st_rdev)]
    out["api_version"] = fcntl.ioctl(fd, 0xAE00, 0)  # KVM_GET_API_VERSION
    vm = fcntl.ioctl(fd, 0xAE01, 0)  # KVM_CREATE_VM
    out["vm_created"] = vm >= 0
    os.close(vm)
    os.close(fd)
print(json.dumps(out))
"""


def run_container(spec_dir: Path, rootfs: Path, *extra: str, user: str) -> dict[str, Any]:
    volumes = [arg for name in SYSTEM_DIRS if Path("/", name).exists()
               for arg in ("-v", f"/{name}:/{name}:ro")]
    podman = ["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs",
              "--events-backend=file", "run", "--rm", "--network=none",
              "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
              "--user", user, "--cap-drop=ALL", "--security-opt", "no-new-privileges",
              "--read-only", *volumes, *extra, "--rootfs", str(rootfs),
              "/usr/bin/python3", "-c", PROBE]
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
         str(spec_dir), str(MOUNTPOINT), *podman],
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, f"podman failed ({result.returncode}): {result.stderr}"
    lines = result.stdout.strip().splitlines()
    assert lines, f"no output; stderr: {result.stderr}"
    out: dict[str, Any] = json.loads(lines[-1])
    return out


@pytest.fixture
def mountpoint() -> Iterator[Path]:
    """/var/run/cdi must exist to be bound over. If missing, an empty one is made (on /run, a
    tmpfs) and removed afterwards; we never write into it."""
    created = not MOUNTPOINT.exists()
    if created:
        MOUNTPOINT.mkdir(mode=0o755)
    yield MOUNTPOINT
    if created:
        with contextlib.suppress(OSError):
            MOUNTPOINT.rmdir()


@pytest.mark.usefixtures("mountpoint")
def test_the_cdi_device_lets_workloads_create_a_vm_as_its_spec_says(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    for name in SYSTEM_DIRS:
        (rootfs / name).mkdir(parents=True)
    rootfs.chmod(0o755)  # the container's "/", walked by a non-root user
    spec_dir, owner_only_dir = tmp_path / "cdi", tmp_path / "cdi-0600"
    desired = render_spec("kvm", UID, GID)
    assert asyncio.run(CdiReconciler(CdiSettings(spec_dir), desired).reconcile("start")).ok
    assert check_file(spec_dir / "hyperlight.json", desired) == (True, "")
    # Our spec but for the node's mode, 0600: what containerd 2.x gives when none is stated.
    spec = json.loads(desired)
    spec["devices"][0]["containerEdits"]["deviceNodes"][0]["fileMode"] = 0o600
    owner_only = (json.dumps(spec, indent=2) + "\n").encode()
    assert asyncio.run(CdiReconciler(CdiSettings(owner_only_dir), owner_only).reconcile("start")).ok
    host = node_of(os.stat(KVM))  # (mode, uid, gid, rdev)
    device = ("--device", qualified_name("kvm"))
    env = {"HYPERLIGHT_HYPERVISOR": "kvm", "HYPERLIGHT_DEVICE_PATH": "/dev/kvm"}

    # A non-root workload as the spec's node owner, and one with another uid (1000, as most
    # are), get the host's device as a node of mode 0666 owned by 65534, and create a VM.
    for user, ids in ((f"{UID}:{GID}", (UID, GID)), ("1000:1000", (1000, 1000))):
        out = run_container(spec_dir, rootfs, *device, user=user)
        assert out.get("open_error") is None, out
        assert (out["uid"], out["gid"]) == ids
        assert out["api_version"] == 12 and out["vm_created"] is True
        assert out["node"] == [True, oct(0o666), UID, GID, os.major(host[3]), os.minor(host[3])]
        assert out["env"] == env

    # The same container without the device cannot open it.
    out = run_container(spec_dir, rootfs, user=f"{UID}:{GID}")
    assert out.get("open_error") == "ENOENT", out
    assert out["env"] == {}

    # The runtime does apply fileMode: with the mode containerd copies from this host (0600),
    # the workload with another uid could not open the device. So the spec's 0666 lets it in.
    denied = run_container(owner_only_dir, rootfs, *device, user="1000:1000")
    assert denied.get("open_error") == "EACCES", denied

    assert stat.S_ISCHR(host[0])
    assert node_of(os.stat(KVM)) == host  # the host's node is not changed
