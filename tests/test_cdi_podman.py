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
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hlplugin.cdi import CdiReconciler, check_file, qualified_name, render_spec

KVM = Path("/dev/kvm")
MOUNTPOINT = Path("/var/run/cdi")
UID = GID = 65534
TOOLS = ("podman", "runc", "unshare", "mount")

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0,
                       reason="podman in a private mount namespace needs root"),
    pytest.mark.skipif(not KVM.exists(), reason="no /dev/kvm on this machine"),
    pytest.mark.skipif(not all(shutil.which(t) for t in TOOLS),
                       reason=f"needs all of {', '.join(TOOLS)} on PATH"),
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


@pytest.fixture(scope="module")
def mountpoint() -> Iterator[Path]:
    """/var/run/cdi must exist to be bound over. If missing, an empty one is made (on /run, a
    tmpfs) and removed afterwards; we never write into it."""
    created = not MOUNTPOINT.exists()
    if created:
        MOUNTPOINT.mkdir(mode=0o755)
    try:
        yield MOUNTPOINT
    finally:
        if created:
            with contextlib.suppress(OSError):
                MOUNTPOINT.rmdir()


@pytest.fixture(scope="module")
def spec_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("cdi")
    desired = render_spec("kvm", UID, GID)
    reconciler = CdiReconciler(directory, desired)
    assert asyncio.run(reconciler.reconcile("start")).ok
    assert check_file(directory / "hyperlight.json", desired) == (True, "")
    return directory


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rootfs")
    root.chmod(0o755)  # the container's "/", walked by a non-root user
    for name in ("usr", "lib", "lib64", "bin"):
        (root / name).mkdir()
    return root


def run_container(spec_dir: Path, rootfs: Path, *extra: str,
                  user: str = f"{UID}:{GID}") -> dict[str, Any]:
    volumes = [arg for name in ("usr", "lib", "lib64", "bin") if Path("/", name).exists()
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


def host_kvm() -> tuple[int, int, int, int]:
    st = os.stat(KVM)
    return st.st_mode, st.st_uid, st.st_gid, st.st_rdev


@pytest.mark.usefixtures("mountpoint")
def test_non_root_container_with_the_cdi_device_creates_a_vm(spec_dir: Path,
                                                             rootfs: Path) -> None:
    before = host_kvm()
    out = run_container(spec_dir, rootfs, "--device", qualified_name("kvm"))
    assert out.get("open_error") is None, out
    assert (out["uid"], out["gid"]) == (UID, GID)
    assert out["api_version"] == 12
    assert out["vm_created"] is True
    is_chr, _mode, uid, gid, major, minor = out["node"]
    host = os.stat(KVM)
    assert is_chr and (uid, gid) == (UID, GID)
    assert (major, minor) == (os.major(host.st_rdev), os.minor(host.st_rdev))
    assert out["env"] == {"HYPERLIGHT_HYPERVISOR": "kvm", "HYPERLIGHT_DEVICE_PATH": "/dev/kvm"}
    assert host_kvm() == before  # the host's device node is not changed
    assert stat.S_ISCHR(before[0])


@pytest.mark.usefixtures("mountpoint")
def test_the_same_container_without_the_device_cannot_open_kvm(spec_dir: Path,
                                                                rootfs: Path) -> None:
    out = run_container(spec_dir, rootfs)
    assert out.get("open_error") == "ENOENT", out
    assert out["env"] == {}


@pytest.fixture(scope="module")
def owner_only_spec_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Our spec but for the node's mode, 0600: what containerd 2.x gives when none is stated."""
    directory = tmp_path_factory.mktemp("cdi-0600")
    spec = json.loads(render_spec("kvm", UID, GID))
    spec["devices"][0]["containerEdits"]["deviceNodes"][0]["fileMode"] = 0o600
    desired = (json.dumps(spec, indent=2) + "\n").encode()
    assert asyncio.run(CdiReconciler(directory, desired).reconcile("start")).ok
    return directory


@pytest.mark.usefixtures("mountpoint")
def test_a_workload_with_another_uid_opens_the_device_and_creates_a_vm(
    spec_dir: Path, owner_only_spec_dir: Path, rootfs: Path,
) -> None:
    # The spec's nodes are owned by 65534; this workload runs as 1000:1000, as most do.
    out = run_container(spec_dir, rootfs, "--device", qualified_name("kvm"), user="1000:1000")
    assert out.get("open_error") is None, out
    assert (out["uid"], out["gid"]) == (1000, 1000)
    assert out["api_version"] == 12 and out["vm_created"] is True
    is_chr, mode, uid, gid, _major, _minor = out["node"]
    assert is_chr and mode == oct(0o666) and (uid, gid) == (UID, GID)
    # The runtime does apply fileMode: with the mode containerd copies from this host (0600),
    # the same workload could not open the device. So the spec's 0666 is what lets it in.
    denied = run_container(owner_only_spec_dir, rootfs, "--device", qualified_name("kvm"),
                           user="1000:1000")
    assert denied.get("open_error") == "EACCES", denied
