"""The README tells the truth: its configuration table is generated from config.OPTIONS, and it
opens with its title, one sentence and the two quickstart commands (its metrics table: tests/test_docs.py).

Regenerate the configuration table after changing an option: `python tests/test_readme.py --write`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from hlplugin import config, durations

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BEGIN = "<!-- BEGIN options: generated from config.OPTIONS by `python tests/test_readme.py --write` -->"
END = "<!-- END options -->"
QUICKSTART = (
    "```\n"
    "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/hlplugin demo   # install and run "
    "the main job: both daemons against a built-in kubelet emulator\n"
    "bash .ci/run                                                                  # run the tests: "
    "installs podman, prometheus, mmdebstrap and the other Debian tools, and the Python test tools in .venv; "
    "lints, then runs pytest\n"
    "```\n"
)
_USERS = (("serve", config.SERVE_OPTIONS), ("bootstrap", config.BOOTSTRAP_OPTIONS),
          ("cdi", config.CDI_OPTIONS), ("doctor", config.DOCTOR_OPTIONS), ("dra", config.DRA_OPTIONS))
_OWN_DEFAULTS = (("bootstrap", config.BOOTSTRAP_OPTIONS), ("dra", config.DRA_OPTIONS))


def _shown(value: Any) -> str:
    if value is None or value == "":
        return "(empty)"
    text = ":".join(map(str, value)) if isinstance(value, tuple) else str(value)
    return f"`{text.lower() if isinstance(value, bool) else text}`"


def render_options_table() -> str:
    rows = ["| flag | environment | default | used by | meaning |",
            "| --- | --- | --- | --- | --- |"]
    for name, option in config.OPTIONS.items():
        default = (f"`{durations.show(option.default)}`" if option.metavar == config.DURATION
                   else _shown(option.default))
        for command, names in _OWN_DEFAULTS:
            if name in names and option.default_for(command) != option.default:
                default += f" ({command}: {_shown(option.default_for(command))})"
        users = ", ".join(command for command, names in _USERS if name in names)
        flag = f"`{option.flag}`" if option.is_switch else f"`{option.flag} {option.metavar}`"
        env = f"`{option.env}`" if option.env else ""
        cells = [flag, env, default, users, option.help]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def _block(text: str) -> str:
    start = text.index(BEGIN) + len(BEGIN) + 1
    return text[start:text.index(END)]


def _pip_installs(text: str) -> list[str]:
    """Every command (a line, or one `&&` part of it) that runs `pip install`."""
    parts = (part.strip() for line in text.splitlines() if not line.lstrip().startswith("#")
             for part in line.split("&&"))
    return [part for part in parts if re.search(r"\bpip3?\b.*\binstall\b", part)]


def test_readme_starts_with_title_sentence_and_quickstart_that_installs_only_into_venvs() -> None:
    """PEP 668 distros (Debian 12, Ubuntu 24.04) refuse `pip install` into the system Python: the
    first command makes its own venv and uses only its pip and its hlplugin; the second, `.ci/run`,
    runs only a virtual environment's pip, and the linters and pytest come from there too."""
    readme = README.read_text()
    title, sentence, rest = readme.split("\n\n", 2)
    assert re.fullmatch(r"# hlplugin: .+", title), title
    assert not sentence.startswith(("#", "`")) and sentence.count(". ") == 0, sentence
    assert rest.startswith(QUICKSTART), "the two commands come right after the title and one sentence"
    floor = re.search(r'requires-python = ">=(\d+\.\d+)"', (ROOT / "pyproject.toml").read_text())
    assert floor is not None
    assert f"Python {floor.group(1)} or newer" in readme[:1500]
    first = QUICKSTART.splitlines()[1].split("#")[0]
    installs = _pip_installs(first)
    assert installs and all(cmd.startswith(".venv/bin/pip ") for cmd in installs), installs
    assert first.startswith("python3 -m venv .venv && ")
    assert ".venv/bin/hlplugin demo" in first
    script = (ROOT / ".ci" / "run").read_text()
    installs = _pip_installs(script)
    assert installs, "no pip install found in .ci/run"
    for command in installs:
        assert re.match(r'"\$\w*venv/bin/(pip|python)"', command), command
    assert re.search(r'^\s*"\$python" -m venv "\$venv"$', script, re.M)
    for tool in ("ruff check src tests", "mypy", "python -m pytest"):
        assert re.search(rf'^"\$venv/bin/{re.escape(tool.split()[0])}"', script, re.M), tool


def test_readme_says_what_serve_writes_and_binds_and_how_to_run_it_by_hand() -> None:
    """The same facts as `serve --help` (cli.SERVE_EFFECTS), and a command that parses and keeps
    every path and the HTTP port off the machine's own."""
    from hlplugin.cli import build_parser

    flat = " ".join(README.read_text().split())
    for part in ("writes `/var/run/cdi/hyperlight.json`", "podman and containerd", "stays after exit",
                 "`/var/lib/kubelet/device-plugins`", "`0.0.0.0:8080`", "`hlplugin demo --hold`"):
        assert part in flat, part
    command = re.search(r"^hlplugin (serve --plugin-dir .*)$", README.read_text(), re.M)
    assert command is not None
    args = build_parser().parse_args(command.group(1).split())
    assert str(args.plugin_dir).startswith("/tmp/") and str(args.cdi_dir).startswith("/tmp/")
    assert args.http_address == ("127.0.0.1", 0)


def test_options_table_matches_config_and_covers_both_daemons() -> None:
    table = _block(README.read_text())
    assert table == render_options_table(), (
        "README options table is stale: run `python tests/test_readme.py --write`")
    for name in (*config.SERVE_OPTIONS, *config.BOOTSTRAP_OPTIONS):
        option = config.OPTIONS[name]
        row = next(line for line in table.splitlines() if f"`{option.flag}" in line)
        assert option.env is None or f"`{option.env}`" in row


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_readme.py --write")
    text = README.read_text()
    README.write_text(text.replace(_block(text), render_options_table()))
