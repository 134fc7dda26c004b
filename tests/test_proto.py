"""The generated code in src/hlplugin/api is exactly what protos/ generates."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROTO = "hlplugin/api/deviceplugin.proto"


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is needed to regenerate the API code")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "protos"),
         f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
         str(ROOT / "protos" / PROTO)],
        check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc generated nothing"
    for relative in generated:
        committed = ROOT / "src" / relative
        assert committed.read_bytes() == (tmp_path / relative).read_bytes(), (
            f"{committed} is stale: regenerate it with the command in protos/{PROTO}")


def test_wire_compatible_field_numbers() -> None:
    from hlplugin.api import deviceplugin_pb2 as pb

    def numbers(message: type) -> dict[str, int]:
        return {f.name: f.number for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]

    assert pb.DESCRIPTOR.package == "v1beta1"
    assert numbers(pb.ContainerAllocateResponse) == {
        "envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5}
    assert numbers(pb.Device) == {"ID": 1, "health": 2, "topology": 3}
    assert numbers(pb.RegisterRequest) == {
        "version": 1, "endpoint": 2, "resource_name": 3, "options": 4}
    assert numbers(pb.DeviceSpec) == {"container_path": 1, "host_path": 2, "permissions": 3}
    assert numbers(pb.ContainerAllocateRequest) == {"devices_ids": 1}
    services = {s.full_name: [m.name for m in s.methods] for s in pb.DESCRIPTOR.services_by_name.values()}
    assert services == {
        "v1beta1.Registration": ["Register"],
        "v1beta1.DevicePlugin": ["GetDevicePluginOptions", "ListAndWatch",
                                 "GetPreferredAllocation", "Allocate", "PreStartContainer"],
    }
