"""The CDI spec the main daemon keeps: exactly the documented content, rendered deterministically,
in a cdiVersion that covers every field written, valid against the CDI schema."""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  (to_thread's, imported before any fork)
import json
from pathlib import Path
from typing import Any

import pytest

import hlplugin.cdi
from hlplugin.cdi_spec import desired_spec, render_spec

SCHEMA_DIR = Path(__file__).parent / "data" / "cdi-schema"


def test_desired_spec_is_exactly_the_documented_content_rendered_deterministically() -> None:
    assert hlplugin.cdi_spec.qualified_name("kvm") == "hyperlight.dev/hypervisor=kvm"
    assert desired_spec("kvm", 65534, 65533) == {
        "cdiVersion": "0.3.0",
        "kind": hlplugin.cdi_spec.KIND,
        "devices": [{
            "name": "kvm",
            "containerEdits": {
                "deviceNodes": [{"path": "/dev/kvm", "type": "c", "permissions": "rw",
                                 "fileMode": 0o666, "uid": 65534, "gid": 65533}],
                "env": ["HYPERLIGHT_HYPERVISOR=kvm", "HYPERLIGHT_DEVICE_PATH=/dev/kvm"],
            },
        }],
    }
    mshv = desired_spec("mshv", 0, 0)["devices"][0]["containerEdits"]
    assert mshv["deviceNodes"][0]["path"] == "/dev/mshv"
    assert mshv["env"] == ["HYPERLIGHT_HYPERVISOR=mshv", "HYPERLIGHT_DEVICE_PATH=/dev/mshv"]
    # Rendered deterministically, with a decimal fileMode.
    first = render_spec("kvm", 65534, 65534)
    assert first == render_spec("kvm", 65534, 65534)
    assert first.endswith(b"}\n") and not first.endswith(b"\n\n")
    assert json.loads(first) == desired_spec("kvm", 65534, 65534)
    assert first.startswith(b'{\n  "cdiVersion": "0.3.0",\n  "kind": "hyperlight.dev/hypervisor",')
    assert render_spec("kvm", 1, 2) != first
    # Without fileMode, containerd 2.x gives the container's node the host's mode (0600 here), so
    # only DEVICE_UID could open it. JSON has no octal: Go decodes 438 into os.FileMode 0o666.
    node = json.loads(first)["devices"][0]["containerEdits"]["deviceNodes"][0]
    assert node["fileMode"] == 438 == 0o666
    assert type(node["fileMode"]) is int
    assert b'"fileMode": 438,' in first


# Fields each CDI version up to CDI_VERSION (0.3.0) knows; anything newer would need a newer
# cdiVersion (see the version table in tests/data/cdi-schema's source, SPEC.md).
FIELDS_0_3_0 = {
    "spec": {"cdiVersion", "kind", "devices", "containerEdits"},
    "device": {"name", "containerEdits"},
    "edits": {"env", "deviceNodes", "hooks", "mounts"},
    "node": {"path", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"},
}


@pytest.mark.parametrize("hypervisor", ["kvm", "mshv"])
def test_cdi_version_covers_every_field_we_write(hypervisor: str) -> None:
    spec = desired_spec(hypervisor, 65534, 65534)
    assert spec["cdiVersion"] == hlplugin.cdi_spec.CDI_VERSION == "0.3.0"
    assert set(spec) <= FIELDS_0_3_0["spec"]
    vendor, _, name = spec["kind"].partition("/")
    assert vendor and "." not in name  # a dot in the name segment needs 0.6.0
    for device in spec["devices"]:
        assert set(device) <= FIELDS_0_3_0["device"]
        assert device["name"][0].isalpha()  # a leading digit needs 0.5.0
        edits = device["containerEdits"]
        assert set(edits) <= FIELDS_0_3_0["edits"]
        for node in edits["deviceNodes"]:
            assert set(node) <= FIELDS_0_3_0["node"]  # hostPath would need 0.5.0


@pytest.mark.skipif(not (SCHEMA_DIR / "schema.json").is_file(),
                    reason=f"CDI reference schema not found at {SCHEMA_DIR}")
@pytest.mark.parametrize(("hypervisor", "uid", "gid"),
                         [("kvm", 65534, 65534), ("mshv", 0, 4_294_967_295)])
def test_rendered_spec_validates_against_the_cdi_schema(hypervisor: str, uid: int, gid: int) -> None:
    from jsonschema import Draft7Validator, ValidationError
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT7

    defs = Resource.from_contents(json.loads((SCHEMA_DIR / "defs.json").read_text()),
                                  default_specification=DRAFT7)
    registry: Registry[Any] = Registry().with_resource("defs.json", defs)
    validator = Draft7Validator(json.loads((SCHEMA_DIR / "schema.json").read_text()), registry=registry)
    validator.validate(json.loads(render_spec(hypervisor, uid, gid)))
    with pytest.raises(ValidationError):  # the validator does check what we rely on
        validator.validate(desired_spec("kvm", -1, 0))
