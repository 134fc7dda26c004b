"""The generated code in src/hlplugin/api is exactly what protos/ generates."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROTO = "hlplugin/api/deviceplugin.proto"
PROTOS = sorted((ROOT / "protos" / "hlplugin" / "api").glob("*.proto"))


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is needed to regenerate the API code")
    assert len(PROTOS) >= 4, PROTOS
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "protos"),
         f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
         *map(str, PROTOS)],
        check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert len(generated) == 3 * len(PROTOS), generated
    for relative in generated:
        committed = ROOT / "src" / relative
        assert committed.read_bytes() == (tmp_path / relative).read_bytes(), (
            f"{committed} is stale: regenerate it with the command in protos/{PROTO}")


def numbers(message: type) -> dict[str, int]:
    return {f.name: f.number for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]


def test_wire_compatible_field_numbers() -> None:
    from hlplugin.api import deviceplugin_pb2 as pb

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


def test_plugin_watcher_api_is_the_kubelets() -> None:
    """k8s.io/kubelet/pkg/apis/pluginregistration/v1: its package is "pluginregistration"."""
    from hlplugin.api import pluginregistration_pb2 as pb

    assert pb.DESCRIPTOR.package == "pluginregistration"
    assert numbers(pb.PluginInfo) == {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4}
    assert numbers(pb.RegistrationStatus) == {"plugin_registered": 1, "error": 2}
    assert numbers(pb.InfoRequest) == {} and numbers(pb.RegistrationStatusResponse) == {}
    (service,) = pb.DESCRIPTOR.services_by_name.values()
    assert service.full_name == "pluginregistration.Registration"
    assert {m.name: (m.input_type.name, m.output_type.name) for m in service.methods} == {
        "GetInfo": ("InfoRequest", "PluginInfo"),
        "NotifyRegistrationStatus": ("RegistrationStatus", "RegistrationStatusResponse")}


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_dra_api_is_the_kubelets(version: str) -> None:
    """k8s.io/kubelet/pkg/apis/dra/{v1,v1beta1}: the method paths the kubelet calls, the fields."""
    import importlib

    pb = importlib.import_module(f"hlplugin.api.dra_{version}_pb2")
    package = f"k8s.io.kubelet.pkg.apis.dra.{version}"
    assert pb.DESCRIPTOR.package == package
    (service,) = pb.DESCRIPTOR.services_by_name.values()
    assert service.full_name == f"{package}.DRAPlugin"
    assert {m.name: (m.input_type.name, m.output_type.name) for m in service.methods} == {
        "NodePrepareResources": ("NodePrepareResourcesRequest", "NodePrepareResourcesResponse"),
        "NodeUnprepareResources": ("NodeUnprepareResourcesRequest", "NodeUnprepareResourcesResponse")}
    assert numbers(pb.Claim) == {"namespace": 1, "uid": 2, "name": 3}
    share = {"share_id": 5} if version == "v1" else {}  # 1.36's v1 only: consumable capacity
    assert numbers(pb.Device) == {"request_names": 1, "pool_name": 2, "device_name": 3,
                                  "cdi_device_ids": 4, **share}
    assert numbers(pb.NodePrepareResourceResponse) == {"devices": 1, "error": 2}
    assert numbers(pb.NodeUnprepareResourceResponse) == {"error": 1}
    for message in (pb.NodePrepareResourcesRequest, pb.NodeUnprepareResourcesRequest,
                    pb.NodePrepareResourcesResponse, pb.NodeUnprepareResourcesResponse):
        assert numbers(message) == {"claims": 1}
    claims = pb.NodePrepareResourcesResponse.DESCRIPTOR.fields_by_name["claims"]
    assert claims.message_type.GetOptions().map_entry  # map<string, NodePrepareResourceResponse>
    key, value = claims.message_type.fields
    assert (key.type, value.message_type.name) == (key.TYPE_STRING, "NodePrepareResourceResponse")


# --- against the kubelet itself -------------------------------------------------------------------

def _kubelet_xz() -> Path | None:
    """The v1.36 kubelet of HLPLUGIN_K8S_DIR (as the cluster tests take it), else of ../shared/k8s
    (README there) beside the repository or its worktree: a clone elsewhere still finds it."""
    dirs = [Path(os.environ["HLPLUGIN_K8S_DIR"])] if os.environ.get("HLPLUGIN_K8S_DIR") else []
    for k8s in (*dirs, ROOT.parent / "shared" / "k8s", ROOT.parent.parent / "shared" / "k8s"):
        if (k8s / "kubelet.xz").is_file():
            return k8s / "kubelet.xz"
    return None


def _embedded_descriptors(binary: bytes) -> dict[str, object]:
    """The kubelet's own API descriptors, as Go's generated code embeds them: each a serialized
    FileDescriptorProto named after its staging path, parsed up to its longest valid prefix."""
    import re

    from google.protobuf import descriptor_pb2

    found: dict[str, object] = {}
    for match in re.finditer(rb"\n([\x05-\x7f])(staging/src/k8s\.io/kubelet/pkg/apis/[a-z0-9/_-]+"
                             rb"/api\.proto)", binary):
        if match.group(1)[0] != len(match.group(2)):
            continue
        start, best, name = match.start(), None, match.group(2).decode()
        for end in range(start + 64, min(start + 16384, len(binary))):
            proto = descriptor_pb2.FileDescriptorProto()
            try:
                proto.ParseFromString(binary[start:end])
            except Exception:  # a prefix that is not a whole descriptor
                continue
            # A prefix running into the next descriptor parses too, merged: its name is the next's.
            if proto.service and proto.name == name:
                best = proto
        if best is not None:
            found[match.group(2).decode().removeprefix("staging/src/k8s.io/kubelet/pkg/apis/")] = best
    return found


def _shape(proto: object) -> dict[str, object]:
    """What the wire depends on: package, messages (nested too) with each field's name, number,
    label, type and type name, enums, and services with their methods' types and streaming."""
    def message(m: object) -> dict[str, object]:
        return {"fields": sorted((f.name, f.number, f.label, f.type, f.type_name)  # type: ignore[attr-defined]
                                 for f in m.field),  # type: ignore[attr-defined]
                "nested": {n.name: message(n) for n in m.nested_type},  # type: ignore[attr-defined]
                "map": m.options.map_entry}  # type: ignore[attr-defined]

    return {
        "package": proto.package,  # type: ignore[attr-defined]
        "messages": {m.name: message(m) for m in proto.message_type},  # type: ignore[attr-defined]
        "enums": {e.name: [(v.name, v.number) for v in e.value] for e in proto.enum_type},  # type: ignore[attr-defined]
        "services": {s.name: sorted((m.name, m.input_type, m.output_type, m.client_streaming,  # type: ignore[attr-defined]
                                     m.server_streaming) for m in s.method)
                     for s in proto.service},  # type: ignore[attr-defined]
    }


OURS = {"deviceplugin/v1beta1/api.proto": "deviceplugin_pb2",
        "pluginregistration/v1/api.proto": "pluginregistration_pb2",
        "dra/v1/api.proto": "dra_v1_pb2", "dra/v1beta1/api.proto": "dra_v1beta1_pb2",
        "dra-health/v1alpha1/api.proto": "dra_health_v1alpha1_pb2"}


def test_every_kubelet_api_we_speak_is_the_v1_36_kubelets_own() -> None:
    """Compared with the descriptors compiled into the real kubelet (../shared/k8s): the same
    package, messages, fields, enums and methods, so the same bytes and method paths."""
    import importlib
    import lzma

    from google.protobuf import descriptor_pb2

    xz = _kubelet_xz()
    if xz is None:
        pytest.skip("no kubelet.xz (the v1.36 kubelet) in HLPLUGIN_K8S_DIR or ../shared/k8s")
    theirs = _embedded_descriptors(lzma.decompress(xz.read_bytes()))
    assert set(OURS) <= set(theirs), sorted(theirs)
    for path, module in OURS.items():
        ours = descriptor_pb2.FileDescriptorProto()
        importlib.import_module(f"hlplugin.api.{module}").DESCRIPTOR.CopyToProto(ours)
        assert _shape(ours) == _shape(theirs[path]), path
