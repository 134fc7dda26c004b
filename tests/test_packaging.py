"""Packaging: one version everywhere, and the metadata a package index and an operator read.

The version is written once, in src/hlplugin/__init__.py (pyproject reads it as a dynamic version).
The image label, the manifests' image tag and the chart's versions cannot import it, so they repeat
it and this file keeps them equal: a release that bumps one and forgets another fails here.
"""

from __future__ import annotations

import email
import email.message
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from hlplugin import __version__, cli

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "ghcr.io/hyperlight-dev/hlplugin"
REPOSITORY = "https://github.com/hyperlight-dev/hlplugin"


def test_version_is_a_release_number() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__), __version__


def test_cli_reports_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"hlplugin {__version__}"


def test_installed_metadata_has_the_package_version() -> None:
    """pyproject's dynamic version reads __version__; a literal there would drift."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert importlib.metadata.version("hlplugin") == __version__


def _final_stage() -> list[str]:
    lines = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("FROM ")]
    return lines[starts[-1]:]


def test_image_label_carries_the_package_version() -> None:
    stage = _final_stage()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", "\n".join(stage), re.M))
    label = re.search(r'org\.opencontainers\.image\.version="([^"]+)"', "\n".join(stage))
    assert label is not None, "the final stage has no org.opencontainers.image.version label"
    value = label.group(1)
    ref = re.fullmatch(r"\$\{?(\w+)\}?", value)
    assert (args.get(ref.group(1)) if ref else value) == __version__


def _image_entries() -> list[tuple[Path, dict[str, str]]]:
    found = []
    for path in sorted((ROOT / "deploy").rglob("kustomization.yaml")):
        for entry in yaml.safe_load(path.read_text()).get("images") or []:
            found.append((path.relative_to(ROOT), entry))
    return found


def test_manifests_tag_the_package_version() -> None:
    """Every kustomization that points at the published image uses this version's tag (KIND's,
    which renames it to a locally built image, has its own tag)."""
    published = [(path, e) for path, e in _image_entries() if e.get("newName") == IMAGE]
    assert published, "no kustomization sets the published image"
    for path, entry in published:
        assert str(entry.get("newTag")) == __version__, f"{path}: {entry}"


def test_chart_version_and_app_version_are_the_package_version() -> None:
    """The chart is released with the image (release.yml pushes both for one tag), and its
    appVersion is the image tag it runs by default."""
    chart = yaml.safe_load((ROOT / "deploy/chart/hlplugin/Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert str(chart["version"]) == __version__, "Chart.yaml version"
    assert str(chart["appVersion"]) == __version__, "Chart.yaml appVersion"


def test_docs_refer_to_this_release() -> None:
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for ref in re.findall(r"\?ref=v([\w.]+)", path.read_text()):
            assert ref == __version__, f"{path.name}: ?ref=v{ref}"


# --- metadata ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def metadata(tmp_path_factory: pytest.TempPathFactory) -> tuple[email.message.Message, Path]:
    """The wheel metadata the build backend makes from pyproject.toml, as pip would build it."""
    out = tmp_path_factory.mktemp("metadata")
    code = ("import sys, setuptools.build_meta as b; "
            "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))")
    result = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    dist_info = out / result.stdout.strip().splitlines()[-1]
    return email.message_from_bytes((dist_info / "METADATA").read_bytes()), dist_info


def test_metadata_names_the_license_and_ships_its_text(
        metadata: tuple[email.message.Message, Path]) -> None:
    meta, dist_info = metadata
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    text = (dist_info / "licenses" / "LICENSE").read_text()
    assert text == (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text, "the full text, not a notice"


def test_metadata_has_classifiers_and_project_urls(
        metadata: tuple[email.message.Message, Path]) -> None:
    meta, _ = metadata
    classifiers = meta.get_all("Classifier") or []
    floor = re.fullmatch(r">=3\.(\d+)", meta["Requires-Python"] or "")
    assert floor is not None
    assert f"Programming Language :: Python :: 3.{floor.group(1)}" in classifiers
    assert "Operating System :: POSIX :: Linux" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")], (
        "PEP 639: the license expression replaces License classifiers")
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    assert {"Homepage", "Source", "Issues", "Documentation"} <= set(urls)
    assert all(u.startswith(REPOSITORY) for u in urls.values()), urls
    # The image is named after the repository (release.yml pushes it under that one fixed name).
    assert IMAGE.removeprefix("ghcr.io/") == REPOSITORY.removeprefix("https://github.com/")


def test_build_floor_reads_license_expressions() -> None:
    """A string `license` is a PEP 639 SPDX expression, which setuptools reads from 77 on; an
    older floor lets pip pick a setuptools that refuses to build (70 does)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(pyproject["project"]["license"], str)
    (requirement,) = [r for r in pyproject["build-system"]["requires"] if r.startswith("setuptools")]
    floor = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", requirement)
    assert floor is not None and int(floor.group(1)) >= 77, requirement


def test_the_tree_holds_no_symlink_leaving_it() -> None:
    """A tracked link to an absolute path (one arrived with a merge once) dangles in every clone
    and the image's build context; a relative one must stay inside the tree."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing says which files are tracked")
    listing = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-s"], capture_output=True,
                             text=True, check=True).stdout
    links = [line.split("\t", 1)[1] for line in listing.splitlines() if line.startswith("120000")]
    leaving = [link for link in links if Path(os.readlink(ROOT / link)).is_absolute()
               or not (ROOT / link).resolve().is_relative_to(ROOT) or not (ROOT / link).exists()]
    assert not leaving, leaving
