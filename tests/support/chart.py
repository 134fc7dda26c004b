"""What the chart's tests share (tests/test_chart*.py): the chart rendered by the real helm, its
values and schema, the objects' parts they look at, and the daemons' own ranges and defaults,
read in one place (hlplugin.settings through the command line's table)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from harness import documents, helm_template, kustomize

from hlplugin import config
from hlplugin.settings import DraSettings, ServeSettings
from support.deploy import BOOTSTRAP, DRA, MAIN, NAMESPACE

# --- the daemons' own ranges and defaults, read in one place -------------------------------------
# hlplugin.config is being regrouped: when its names move, repoint these and nothing else.


def daemon_duration_ranges() -> dict[str, tuple[float, float]]:
    """Each duration setting's range in seconds (both bounds allowed), by its option name."""
    from hlplugin.settings import INTERVAL_RANGE, TIMEOUT_RANGE

    return {"cdi_interval": INTERVAL_RANGE, "health_interval": INTERVAL_RANGE,
            "probe_timeout": TIMEOUT_RANGE, "register_timeout": TIMEOUT_RANGE}


def daemon_integer_ranges() -> dict[str, tuple[int, int]]:
    """Each whole-number setting's range (both bounds allowed), by its option name."""
    from hlplugin.settings import MAX_DEVICE_COUNT, MAX_SLOTS, UINT32_MAX

    return {"device_count": (1, MAX_DEVICE_COUNT), "slots": (1, MAX_SLOTS),
            "device_uid": (0, UINT32_MAX), "device_gid": (0, UINT32_MAX)}


def daemon_parse(dest: str, text: str) -> Any:
    """The setting as the daemons read it from their environment; ValueError where they refuse it."""
    return config.OPTIONS[dest].parse(text)


def daemon_default(dest: str) -> Any:
    """The daemons' default of a setting: its hlplugin.settings field's (the main daemon's; for
    one only the DRA driver takes, the driver's)."""
    if dest in config.SERVE_OPTIONS:
        return config.value_at(ServeSettings(), config.OPTIONS[dest].path)
    return config.value_at(DraSettings(), config.OPTIONS[dest].path)


ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/chart/hlplugin"
README = CHART / "README.md"
DEPLOY = ROOT / "deploy"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
TEST_POD = "hyperlight-test-vm"  # templates/tests/vm-check.yaml, what `helm test` runs
SUBCOMMAND_OPTIONS = {MAIN: config.SERVE_OPTIONS, BOOTSTRAP: config.BOOTSTRAP_OPTIONS,
                      DRA: config.DRA_OPTIONS}
# Every toggle on (networkPolicy and admissionPolicy are on by default).
TOGGLES = {"namespace": {"create": True},
           "monitoring": {"podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}}
# The DRA driver on, alone and with every toggle (not in TOGGLES: deploy/ has no driver yet).
DRA_ON = {"dra": {"enabled": True}}
CRD_GROUP = "monitoring.coreos.com/"
# The daemons' settings the chart sets itself, to match its mounts, probes and network policies;
# every other setting of either daemon is a config.* value.
CHART_OWNED = {"plugin_dir", "cdi_dir", "dev_dir", "host_dev_dir", "http_address", "registry_dir",
               "dra_dir", "pod_uid", "node_name"}
SETTINGS = sorted((set(config.SERVE_OPTIONS) | set(config.BOOTSTRAP_OPTIONS) | set(config.DRA_OPTIONS))
                  - CHART_OWNED)

Objects = list[dict[str, Any]]


def camel(dest: str) -> str:
    first, *rest = dest.split("_")
    return first + "".join(part.title() for part in rest)


def render(values: dict[str, Any] | None = None, namespace: str = NAMESPACE) -> Objects:
    result = helm_template(CHART, namespace, values)
    assert result.returncode == 0, result.stderr
    return documents(result.stdout)


def refusal(values: dict[str, Any]) -> str:
    result = helm_template(CHART, NAMESPACE, values)
    assert result.returncode != 0, f"helm accepted {values}"
    assert "don't meet the specifications of the schema" in result.stderr, result.stderr
    return result.stderr


def nested(path: str, value: Any) -> dict[str, Any]:
    """{"a": {"b": value}} for "a.b"."""
    for key in reversed(path.split(".")):
        value = {key: value}
    return value  # type: ignore[no-any-return]


def merged(*trees: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tree in trees:
        for key, value in tree.items():
            both = isinstance(value, dict) and isinstance(out.get(key), dict)
            out[key] = merged(out[key], value) if both else value
    return out


def default_of(path: str) -> Any:
    node: Any = VALUES
    for key in path.split("."):
        node = node[key]
    return node


def leaves(node: dict[str, Any] = SCHEMA, prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(dotted name, schema) of every value: a schema node without `properties`."""
    for key, child in node["properties"].items():
        name = f"{prefix}{key}"
        if "properties" in child:
            yield from leaves(child, name + ".")
        else:
            yield name, child


def closed_objects(node: dict[str, Any] = SCHEMA, pointer: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(JSON pointer, schema) of every object whose keys the schema names."""
    if "properties" in node or "propertyNames" in node:
        yield pointer, node
    for key, child in node.get("properties", {}).items():
        yield from closed_objects(child, f"{pointer}/{key}")


def daemonsets(objs: Objects) -> dict[str, dict[str, Any]]:
    found = {o["metadata"]["name"]: o for o in objs if o["kind"] == "DaemonSet"}
    assert set(found) - {DRA} == {BOOTSTRAP, MAIN}, found.keys()
    return found


def pod(ds: dict[str, Any]) -> dict[str, Any]:
    return ds["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def container(ds: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod(ds)["containers"]
    return only  # type: ignore[no-any-return]


def env(ds: dict[str, Any]) -> dict[str, str]:
    """The container's environment given as values (not those from the downward API)."""
    return {e["name"]: e["value"] for e in container(ds)["env"] if "value" in e}


def host_paths(ds: dict[str, Any]) -> dict[str, str]:
    return {v["name"]: v["hostPath"]["path"] for v in pod(ds)["volumes"]}


def hooks(objs: Objects) -> Objects:
    """The objects only `helm test` (or another hook) creates, not `helm install`."""
    return [o for o in objs if "helm.sh/hook" in o["metadata"].get("annotations", {})]


def installed(objs: Objects) -> Objects:
    return [o for o in objs if o not in hooks(objs)]


def kinds(objs: Objects) -> set[str]:
    return {o["kind"] for o in objs}


def index(objs: Objects) -> dict[tuple[str, str, str], dict[str, Any]]:
    out = {}
    for o in objs:
        key = (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])
        assert key not in out, f"two {key}"
        out[key] = o
    return out


def kustomized(workdir: Path, *components: str, deploy: Path = DEPLOY) -> Objects:
    """deploy/base with ``components``, as an operator's overlay would put them together."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(deploy / "base", workdir)],
        "components": [os.path.relpath(deploy / "components" / c, workdir) for c in components],
    }))
    return documents(kustomize(workdir))


PLUGIN_DIR = "/var/lib/kubelet/device-plugins"


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def hook_pod(objs: Objects) -> dict[str, Any]:
    (found,) = [o for o in hooks(objs) if o["kind"] == "Pod"]
    return found
