"""tests/support/clusterd.py's supervisor on its own (no namespaces, no cluster): a component it
must keep running, as systemd keeps a node's kubelet, is started again when it exits by itself,
and never when a command stopped it. Run in a child process: the supervisor reaps every child of
its process, which in pytest's would take other tests' exit statuses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from clusterd import Supervisor
plan = json.loads(sys.argv[2])
count = lambda: len(open(plan["counter"]).read().split())
sup = Supervisor(plan)
sup.start("flaky")
deadline = time.monotonic() + 30
while count() < 3 and time.monotonic() < deadline:  # it exits at once: restarted each time
    sup.reap()
    sup.restart_exited()
    time.sleep(0.01)
started = count()
sup.stop("flaky")  # stopped by a command (it may already have exited): stays down
for _ in range(30):
    sup.reap()
    sup.restart_exited()
    time.sleep(0.01)
print(json.dumps({"started": started, "after_stop": count(), "exited": sup.exited}))
"""


def test_a_component_that_exits_by_itself_is_started_again_until_a_command_stops_it(
        tmp_path: Path) -> None:
    counter = tmp_path / "starts"
    counter.write_text("")
    plan = {"logs": str(tmp_path), "cgroup": "unused", "counter": str(counter), "components": [
        {"name": "flaky", "argv": ["sh", "-c", f"echo x >> {counter}; exit 3"], "restart_after": 0.02}]}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT / "tests/support"), json.dumps(plan)],
                            capture_output=True, text=True, timeout=60, check=True)
    found = json.loads(result.stdout)
    assert found["started"] >= 3, found
    # A start under way when the stop came writes once more; none comes after the stop.
    assert found["after_stop"] in (found["started"], found["started"] + 1), found
    assert found["exited"]["flaky"] in (3, -15), found  # exited by itself, or the stop's SIGTERM
