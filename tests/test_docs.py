"""The docs cannot drift from the code: every metric name, label value, condition name and quoted
reason or log line in README.md and docs/*.md is one the code really produces.

What the code produces is read from the code, not from a list kept here:

- metric names, label names and label values: the /metrics of real daemons (both daemons, on a
  node with the hypervisor and on one without), plus the label names of the Metrics registry and,
  for label values that only appear on an event (a repair's cause, a failed registration), the
  string literals of the source;
- condition names: the /readyz of the same daemons (the trackers' conditions as they are served);
- reasons and log lines: the message templates of the source (string literals, f-strings and
  %-format strings, each placeholder matching anything), which a quote must match; "...", "…"
  or a <name> in the quote stands for a value (a placeholder, or text without letters), never
  for words of the template.

What counts as a mention: any hyperlight_*, process_* or python_* name (with its {label="value"}
selector); the rows of a metrics table; `condition X is ...`, "`X`: " (a condition and its reason),
README's "Conditions:" sentence and the conditions of a ```json /readyz example; any backticked
text of three words or more that is not a command (COMMANDS) or another program's (FOREIGN).
Completeness is checked where a list claims to be whole: README's metrics table lists every label
value the daemons exposed, README's "Conditions:" every condition, and a metrics table elsewhere
lists the same values as README's.

A new metric, label value or condition shows up here by itself; a doc that names one the code does
not have, or a reason the code cannot print, fails with the file and the text.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import itertools
import json
import re
import shlex
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import pytest
from harness import HAVE_KVM, Daemon, Node, declared, metric_families, needs_kvm, on_kubelet
from prometheus_client.parser import text_string_to_metric_families

from hlplugin import cli
from hlplugin.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "src" / "hlplugin"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Metric families the docs may name: ours, and the process and runtime collectors'.
METRIC = re.compile(r"(?<![\w/.-])((?:hyperlight|process|python)_[a-z0-9_]*[a-z0-9])(\{[^}\n]*\})?")
ELLIPSIS = re.compile(r"\.\.\.|…")
PLACEHOLDER = re.compile(r"<[a-z][\w-]*>")  # <dev-dir>, <pod>: a doc's name for any value
WILD = "\0"  # one "anything" in a template or a quote
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "summary": ("_count", "_sum", "_created"), "info": ("_info",), "gauge": (),
            "unknown": (), "stateset": (), "gaugehistogram": ("_bucket", "_gcount", "_gsum")}

# Backticked text with spaces that is not ours to check: commands, configuration, other programs'
# messages. Everything else with two spaces or more is a quote and must match a source template.
COMMANDS = ("kubectl ", "python ", "python3 ", "pip ", "bash ", "git ", "ls ", "kind ",
            "az ", "docker ", "podman ", "sh ", "sudo ", "curl ", "systemctl ", "journalctl ",
            "crictl ", "ctr ", "helm ", "promtool ", "prometheus ", "deploy/", ".venv/", "apt ",
            "apt-get ", "increase(", "rate(", "GET ", "kubernetes-validate ", "-", "{", "[")
# A PromQL comparison (`up == 0`) or a YAML/config entry (`release: <name>`, `enable_cdi = true`).
NOT_A_MESSAGE = re.compile(r"\s(?:==|!=|>=|<=|>|<|=)\s|^[A-Za-z_][\w.-]*: ")
FOREIGN = {
    "Insufficient hyperlight.dev/hypervisor": "the scheduler's event",
    "0/1 nodes are available: 1 cannot allocate all claims": "the scheduler's event (DRA)",
    "number of requested devices 2001 exceeds the claim limit of 32": "the scheduler's event (DRA)",
    'namespaces "hyperlight-system" not found': "the API server's, as helm install prints it",
    'namespaces "hyperlight-system" already exists': "the API server's, as Helm 3 prints it",
    '"Registered DRA plugin"': "the kubelet's DRA plugin manager (log)",
    '"Unregistered DRA plugin"': "the kubelet's DRA plugin manager (log)",
    '"WatchResources health stream has ended"': "the kubelet's DRA health streams (log)",
    '"Successfully started WatchResources health stream"': "the kubelet's DRA health streams (log)",
    '"Skipping allocation for DRA-backed extended resource" resourceName="hyperlight.dev/hypervisor"':
        "the kubelet's device manager (log)",
    '"Error syncing pod, skipping" err="unprepare dynamic resources: DRA driver hyperlight.dev is not '
    'registered"': "the kubelet's pod workers (log)",
    "unprepare dynamic resources: DRA driver hyperlight.dev is not registered": "the kubelet's DRA manager",
    '"ListAndWatch ended unexpectedly for device plugin"': "the kubelet's device manager (log)",
}


# --- what the code produces ------------------------------------------------------------------------


@dataclass
class Exposed:
    metrics: set[str] = field(default_factory=set)  # family and sample names
    labels: dict[str, set[str]] = field(default_factory=dict)  # family -> label names
    values: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # (family, label) -> seen
    conditions: set[str] = field(default_factory=set)

    def family_of(self, name: str) -> str:
        for suffix in ("_total", "_created", "_bucket", "_count", "_sum", "_info"):
            if name.endswith(suffix) and name.removesuffix(suffix) in self.labels:
                return name.removesuffix(suffix)
        return name

    def add_metrics(self, text: str) -> None:
        for family in text_string_to_metric_families(text):
            names = {family.name, *(family.name + s for s in SUFFIXES.get(family.type, ()))}
            names |= {sample.name for sample in family.samples}
            self.metrics |= names
            labels = self.labels.setdefault(family.name, set())
            for sample in family.samples:
                for label, value in sample.labels.items():
                    if label not in ("le", "quantile"):
                        labels.add(label)
                        self.values.setdefault((family.name, label), set()).add(value)

    def add_registry(self) -> None:
        """Label names of families with no child yet (a counter nothing has moved)."""
        for metric in declared(Metrics()):
            family = next(iter(metric.describe()))
            self.labels.setdefault(family.name, set()).update(metric._labelnames)


@pytest.fixture(scope="module")
def exposed() -> Exposed:
    """/metrics and /readyz of both daemons on a node with the hypervisor and on one without."""
    found = Exposed()

    async def snapshot(proc: Daemon, ready: bool) -> None:
        """Once the daemon is ready (a node with a usable hypervisor) or, on a node without one,
        answers at all (every condition is listed from the start, "not checked yet" at first)."""
        body = await proc.wait_http("/readyz", 200 if ready else 503)
        conditions = json.loads(body)["conditions"]
        assert set(conditions) - {"registered", "listandwatch"}, conditions
        found.conditions |= set(conditions)
        code, body = await proc.http("/metrics")
        assert code == 200, body
        found.add_metrics(body.decode())

    async def main() -> None:
        with tempfile.TemporaryDirectory(prefix="hlp-docs-", dir="/tmp") as tmp:
            empty = Path(tmp) / "no-dev"
            empty.mkdir()
            for dev in (Path("/dev"), empty):
                node = Node.make(Path(tmp) / dev.name, dev_dir=dev, host_dev_dir=dev)
                boot = Daemon(["bootstrap", "--plugin-dir", str(node.plugin_dir), "--dev-dir",
                               str(dev)])
                async with on_kubelet(node, node.serve_args()) as (_, serve):
                    await boot.start()
                    try:
                        ready = dev != empty and HAVE_KVM
                        await asyncio.gather(snapshot(serve, ready), snapshot(boot, ready))
                    finally:
                        await boot.stop()

    # A sync module-scoped fixture (async ones need a plugin): its own loop, with a 90 s guard.
    asyncio.run(asyncio.wait_for(main(), 90))
    found.add_registry()
    return found


def _literals() -> Iterator[ast.JoinedStr | ast.Constant]:
    for path in sorted(SOURCE.rglob("*.py")):
        if "api" in path.relative_to(SOURCE).parts:
            continue  # generated gRPC code
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant)
                                                   and isinstance(node.value, str)):
                yield node


@lru_cache(maxsize=1)
def source_strings() -> frozenset[str]:
    return frozenset(n.value for n in _literals() if isinstance(n, ast.Constant))


_PERCENT = re.compile(r"%(?:\([^)]*\))?[-#0 +]*\d*(?:\.\d+)?[sdrfgixXe]")


@lru_cache(maxsize=1)
def templates() -> tuple[str, ...]:
    """Every message the source can build, with WILD for each placeholder; only those with some
    words of their own (a bare "{a}: {b}" would match anything)."""
    out = set()
    for node in _literals():
        if isinstance(node, ast.Constant):
            text = _PERCENT.sub(WILD, str(node.value).replace("%%", "%"))
        else:
            text = "".join(str(v.value) if isinstance(v, ast.Constant) else WILD for v in node.values)
        text = re.sub(f"{WILD}+", WILD, " ".join(text.split()))
        if sum(c.isalpha() for c in text.replace(WILD, "")) >= 5:
            out.add(text)
    return tuple(sorted(out))


def _literal_overlap(quote: str, template: str) -> int:
    """How many characters of ``quote`` can be matched to the template's own text, in one
    alignment in which a WILD of the template stands for any text and one of the quote for any
    text without letters or for the template's placeholders; -1 when none exists."""
    m, n = len(quote), len(template)
    none = -1
    best = [[none] * (n + 1) for _ in range(m + 1)]
    best[m][n] = 0
    for i in range(m, -1, -1):
        for j in range(n, -1, -1):
            if i == m and j == n:
                continue
            q = quote[i] if i < m else None
            t = template[j] if j < n else None
            options = []
            if q == WILD:  # "..." stands for values and punctuation, never the template's words
                options += [best[i + 1][j],
                            best[i][j + 1] if t is not None and not t.isalpha() else none]
            if t == WILD:
                options += [best[i][j + 1], best[i + 1][j] if i < m else none]
            if q is not None and q == t and q != WILD and best[i + 1][j + 1] != none:
                options.append(best[i + 1][j + 1] + 1)
            best[i][j] = max(options, default=none)
    return best[0][0]


def matches_source(quote: str) -> bool:
    """``quote`` (with "..." or a <placeholder> for anything) is a message some template of the
    source prints."""
    quote = PLACEHOLDER.sub(WILD, ELLIPSIS.sub(WILD, " ".join(quote.split())))
    quote = re.sub(f"{WILD}+", WILD, quote)
    literal = quote.replace(WILD, "")
    needed = min(10, len(literal))
    pieces = [p for p in quote.split(WILD) if len(p.strip()) >= 4]
    for template in templates():
        own = template.split(WILD)
        if WILD not in quote and WILD not in template:
            if quote == template:
                return True
            continue
        if not (any(p in quote for p in own if len(p.strip()) >= 4)
                or any(p in template for p in pieces)):
            continue
        if _literal_overlap(quote, template) >= needed:
            return True
    return False


# --- what the docs say ---------------------------------------------------------------------------


def doc_text(path: Path) -> str:
    return path.read_text()


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def backticked(text: str) -> Iterator[str]:
    for match in re.finditer(r"`([^`]+)`", prose(text)):
        yield " ".join(match.group(1).split())


def _docs() -> list[tuple[str, str]]:
    return [(path.relative_to(ROOT).as_posix(), doc_text(path)) for path in DOCS]


def _selector(braces: str) -> list[tuple[str, list[str]]]:
    """`{cause="a"|"b", result=c}` -> [("cause", ["a", "b"]), ("result", ["c"])]; a bare `{reason}`
    names a label without a value."""
    out = []
    for part in braces.replace("\\|", "|").strip("{}").split(","):
        name, op, value = re.match(r"\s*(\w+)\s*(=~|!=|=)?\s*(.*)", part).groups()  # type: ignore[union-attr]
        values = [v.strip().strip("\"'") for v in value.split("|")] if op else []
        out.append((name, [v for v in values if v and v not in ("...", "…")]))
    return out


def metric_rows(text: str) -> Iterator[tuple[str, list[str]]]:
    """(family name, backticked words after the type cell) of each metrics-table row."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) >= 3 and re.fullmatch(r"`[a-z][a-z0-9_]*`", cells[0]) and METRIC.search(cells[0]):
            yield cells[0].strip("`"), re.findall(r"`([^`]+)`", " | ".join(cells[2:]))


def _row_values(found: Exposed, name: str, words: list[str]) -> tuple[set[str], set[str]]:
    """(label names, label values) a metrics-table row lists for a family with one label."""
    family = found.family_of(name)
    labels = found.labels.get(family, set())
    named = {w for w in words if w in labels}
    values = {w for w in words if w not in labels and re.fullmatch(r"[a-z][a-z0-9_]*", w)}
    return named, values if len(labels) == 1 else set()


# --- the checks ----------------------------------------------------------------------------------


def test_every_metric_and_label_value_named_in_the_docs_exists(exposed: Exposed) -> None:
    wrong = []
    assert sum(len(METRIC.findall(text)) for _, text in _docs()) >= 40
    for name, text in _docs():
        for match in METRIC.finditer(text):
            metric, braces = match.group(1), match.group(2)
            if metric not in exposed.metrics:
                wrong.append(f"{name}: metric {metric} is not exposed")
                continue
            family = exposed.family_of(metric)
            for label, values in _selector(braces or "{}") if braces else []:
                if label not in exposed.labels.get(family, set()):
                    wrong.append(f"{name}: {metric} has no label {label}")
                for value in values:
                    if (value not in exposed.values.get((family, label), set())
                            and value not in source_strings()):
                        wrong.append(f'{name}: {metric}{{{label}="{value}"}} is never produced')
        for metric, words in metric_rows(text):
            for value in _row_values(exposed, metric, words)[1]:
                if value not in source_strings():
                    wrong.append(f"{name}: the {metric} row lists `{value}`, which the code never "
                                 "produces")
    assert not wrong, "\n".join(wrong)


def test_readme_has_a_metrics_row_for_every_family_naming_its_labels() -> None:
    rows = dict(metric_rows(DOCS[0].read_text()))
    families = metric_families()
    assert len(families) == 16
    assert set(families) <= set(rows), f"README's metrics table lacks {sorted(set(families) - set(rows))}"
    for name, labels in families.items():
        assert set(labels) <= set(rows[name]), f"README.md: the {name} row does not name {labels}"


def test_metrics_tables_list_the_same_label_values_as_the_readme(exposed: Exposed) -> None:
    """README's metrics table is the reference (and lists every value the daemons exposed); a
    table elsewhere that lists values lists them all, so a new value cannot be half documented."""
    readme = {m: _row_values(exposed, m, w)[1] for m, w in metric_rows(DOCS[0].read_text())}
    wrong = []
    for (family, label), seen in exposed.values.items():
        names = [m for m in readme if exposed.family_of(m) == family]
        # A version and a directory's path are values of the daemon's, not a set the docs list.
        if names and label not in ("version", "directory") and not seen <= readme[names[0]]:
            wrong.append(f"README.md: the {names[0]} row misses {sorted(seen - readme[names[0]])}")
    for name, text in _docs()[1:]:
        for metric, words in metric_rows(text):
            values = _row_values(exposed, metric, words)[1]
            if values and metric in readme and values != readme[metric]:
                wrong.append(f"{name}: the {metric} row lists {sorted(values)}; README.md lists "
                             f"{sorted(readme[metric])}")
    assert not wrong, "\n".join(wrong)


_NAMED_REASON = re.compile(r"(?:^|(?<=[\s|(]))`([a-z_]+)`: (?:([^`|\n][^|\n]*?)\s*(?:\||$))?", re.M)


def named_reasons(text: str) -> Iterator[tuple[str, str | None]]:
    """("cdi", reason) for each "`cdi`: reason" said of /readyz: within 200 characters after a
    mention of /readyz, or in a table whose header has a "condition" column. The reason is None
    when it is backticked (then it is checked as any backticked quote)."""
    body = prose(text)
    for match in _NAMED_REASON.finditer(body):
        line_start = body.rfind("\n", 0, match.start()) + 1
        in_table = False
        if body[line_start:].startswith("|"):  # a table row: its header is the block's first line
            above = reversed(body[:line_start].splitlines())
            block = list(itertools.takewhile(lambda line: line.startswith("|"), above))
            in_table = bool(block) and "condition" in block[-1]
        if in_table or "/readyz" in body[max(0, match.start() - 200):match.start()]:
            yield match.group(1), match.group(2)


def _condition_mentions(text: str) -> Iterator[str]:
    body = prose(text)
    yield from re.findall(r"\bcondition ([a-z_]+) is (?:un)?healthy", text)
    yield from (name for name, _ in named_reasons(text))
    conditions = re.search(r"^Conditions: (.*?)\.\s", body, re.S | re.M)
    if conditions:
        yield from re.findall(r"`([a-z_]+)`", conditions.group(1))
    for block in re.findall(r"^```json\n(.*?)^```", text, re.S | re.M):
        yield from json.loads(block).get("conditions", {})


def test_every_condition_named_in_the_docs_exists(exposed: Exposed) -> None:
    assert {"registered", "listandwatch", "device", "cdi"} <= exposed.conditions
    wrong = [f"{name}: condition {c} does not exist (the daemons have {sorted(exposed.conditions)})"
             for name, text in _docs() for c in _condition_mentions(text)
             if c not in exposed.conditions]
    assert not wrong, "\n".join(wrong)


def test_readme_lists_every_condition(exposed: Exposed) -> None:
    readme = prose(DOCS[0].read_text())
    listed = re.search(r"^Conditions: (.*?)\.\s", readme, re.S | re.M)
    assert listed, "README: no `Conditions:` sentence"
    missing = exposed.conditions - set(re.findall(r"`([a-z_]+)`", listed.group(1)))
    assert not missing, f"README's Conditions sentence misses {sorted(missing)}"


def is_hlplugin_command(text: str) -> bool:
    """`hlplugin ...` that our own command line accepts (a log line starting with the program's
    name is not one, and is checked as a quote)."""
    try:
        words = shlex.split(text)
    except ValueError:
        return False
    if words[:1] != ["hlplugin"]:
        return False
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            cli.build_parser().parse_args(words[1:])
        except SystemExit as exc:
            return exc.code == 0  # --version, --help
    return True


_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ (hlplugin[\w.]*): (.*?)"
                       r"((?: \w+='[^']*')*)$")


def quotes(text: str) -> Iterator[str]:
    """Every reason or log text a doc quotes: backticked text of three words or more that is not a
    command, a metric expression or another program's; the reason after "`condition`: " in a
    table; the reasons of a /readyz example."""
    for span in backticked(text):
        if (span.count(" ") < 2 or span.startswith(COMMANDS) or span in FOREIGN
                or METRIC.search(span) or NOT_A_MESSAGE.search(span) or is_hlplugin_command(span)):
            continue
        line = _LOG_LINE.match(span)
        if line:
            assert (SOURCE / f"{line.group(1).removeprefix('hlplugin.').replace('.', '/')}.py").exists(), span
            span = line.group(2)
        yield span
    for _, reason in named_reasons(text):
        if reason and ELLIPSIS.sub("", reason).strip():
            yield reason
    for block in re.findall(r"^```json\n(.*?)^```", text, re.S | re.M):
        for condition in json.loads(block).get("conditions", {}).values():
            if condition.get("reason"):
                yield condition["reason"]


def test_every_quoted_reason_and_log_line_is_printed_by_the_code() -> None:
    found = [(name, quote) for name, text in _docs() for quote in quotes(text)]
    assert len(found) >= 30, found  # the extraction itself still works
    wrong = [f"{name}: `{quote}` is printed nowhere in src/hlplugin (another program's text? "
             "then add it to FOREIGN in tests/test_docs.py, saying whose)"
             for name, quote in found if not matches_source(quote)]
    assert not wrong, "\n".join(wrong)


def _durations(text: str) -> dict[str, str]:
    """The run time a text states for the full and the --quick benchmark command."""
    found = {}
    for line in text.splitlines():
        match = re.match(r"\s*python benchmarks/run.py( --quick)?\s+#.*?about (\d+ \w+)", line)
        if match:
            found["quick" if match.group(1) else "full"] = match.group(2)
    return found


def test_benchmark_run_times_agree_with_the_script() -> None:
    """docs/benchmarks.md and benchmarks/run.py state the same run times (the recorded run's
    own duration is in the JSON it writes, as `seconds`)."""
    script = _durations((ROOT / "benchmarks" / "run.py").read_text())
    docs = _durations((ROOT / "docs" / "benchmarks.md").read_text())
    assert set(script) == {"full", "quick"} and script == docs, (script, docs)


# --- the checker itself --------------------------------------------------------------------------


@pytest.mark.parametrize(("quote", "expected"), [
    ("/var/run/cdi/hyperlight.json is a directory; refusing to replace what we do not own", True),
    ("… is not a regular file", False),
    ("condition cdi is unhealthy: …", True),
    ("condition cdi is sad: …", False),
    ("repaired CDI spec … (cause: …, trigger: …)", True),
    ("repaired CDI spec /x (because: malformed)", False),
    ("no hypervisor device under … (looked for mshv and kvm); waiting for one; …", True),
    ("no hypervisor device under …; waiting for one", False),  # "…" hides the template's words
    ("open on /dev/kvm failed: [Errno 13] Permission denied", True),
    ("the failing step and errno", False),
    ("<dev-dir>/kvm: No such file or directory (errno 2)", True),
])
def test_quote_matching(quote: str, expected: bool) -> None:
    """The matcher accepts what the daemons print, with "..." for any part, and nothing else."""
    assert matches_source(quote) is expected


@needs_kvm
def test_the_daemons_expose_what_the_checks_rely_on(exposed: Exposed) -> None:
    """Guards the fixture: real families, labels and values were read, not an empty page."""
    assert "hyperlight_cdi_repairs_total" in exposed.metrics
    assert "cause" in exposed.labels["hyperlight_cdi_repairs"]
    assert "missing" in exposed.values[("hyperlight_cdi_repairs", "cause")]  # the first write
    assert {"cdi", "device", "host_identity"} <= exposed.values[
        ("hyperlight_health_condition", "condition")]


@pytest.mark.parametrize(("text", "expected"), [
    ("hlplugin doctor --host-dev-dir /dev", True),
    ("hlplugin --version", True),
    ("hlplugin serve --no-such-flag x", False),
    ("hlplugin bootstrap 0.1.0 starting; from flags: none", False),
])
def test_hlplugin_commands_are_told_from_log_lines(text: str, expected: bool) -> None:
    assert is_hlplugin_command(text) is expected
