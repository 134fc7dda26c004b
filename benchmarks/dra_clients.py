"""What a Kubernetes client adds to the DRA driver (issue 31, item 3; issue 41, item 1): import
time and resident memory on top of `import hlplugin.dra.driver`, each in a fresh interpreter, medians of
N runs, beside the standard library's TLS (what any client pays) measured in the same run.

Our own client (`hlplugin.kubeapi`, built from an in-cluster configuration: a service account
directory with one CA and a token, the service's address in the environment) is always measured.
The others are not dependencies of the project: install each into a scratch virtual environment
and name its site-packages directory (docs/dra.md says what was measured):

    python benchmarks/dra_clients.py [--runs 3] [--lightkube /tmp/lk/lib/python3.11/site-packages] \
        [--kubernetes-asyncio /tmp/ka/lib/python3.11/site-packages]

A case whose directory is not given is left out. Run it with the project's interpreter (it
imports hlplugin from the source tree beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# A kubeconfig the lightkube client is built from: one CA (as in-cluster, the service account's).
_LIGHTKUBE = """
from lightkube import AsyncClient, KubeConfig
from lightkube.resources.resource_v1 import ResourceSlice
config = KubeConfig.from_dict({{"apiVersion": "v1", "kind": "Config",
    "clusters": [{{"name": "c", "cluster": {{"server": "https://127.0.0.1:9",
                                             "certificate-authority": {ca!r}}}}}],
    "users": [{{"name": "u", "user": {{"token": "t"}}}}],
    "contexts": [{{"name": "x", "context": {{"cluster": "c", "user": "u"}}}}],
    "current-context": "x"}})
client = AsyncClient(config=config)
"""
_KUBERNETES_ASYNCIO = """
from kubernetes_asyncio.client.api.resource_v1_api import ResourceV1Api
from kubernetes_asyncio.client.api_client import ApiClient
from kubernetes_asyncio.client.configuration import Configuration
configuration = Configuration(host="https://127.0.0.1:9")
configuration.ssl_ca_cert = {ca!r}
import asyncio
async def build():  # its aiohttp session wants a running loop
    return ResourceV1Api(ApiClient(configuration))
api = asyncio.run(build())
"""
# What the driver will do at start: import the client, build it for the pod's service account.
_KUBEAPI = """
from pathlib import Path
from hlplugin.kubeapi import Client, Config
client = Client(Config.in_cluster({{"KUBERNETES_SERVICE_HOST": "127.0.0.1",
                                   "KUBERNETES_SERVICE_PORT": "9"}}, Path({account!r})))
"""
_TLS = """
import ssl
context = ssl.create_default_context(cafile={ca!r})
"""
_PROBE = """
import gc, json, sys, time
import hlplugin.dra.driver
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:"))
gc.collect()
before, modules, began = rss(), len(sys.modules), time.perf_counter()
{code}
took = time.perf_counter() - began
gc.collect()
print(json.dumps({{"seconds": took, "kib": rss() - before, "modules": len(sys.modules) - modules}}))
"""


def one_ca() -> str:
    """A file holding one CA certificate of the host's bundle."""
    bundle = Path("/etc/ssl/certs/ca-certificates.crt").read_text()
    first = bundle[bundle.index("-----BEGIN CERTIFICATE-----"):]
    first = first[:first.index("-----END CERTIFICATE-----") + len("-----END CERTIFICATE-----")]
    handle, name = tempfile.mkstemp(suffix=".crt")
    with os.fdopen(handle, "w") as out:
        out.write(first + "\n")
    return name


def service_account(ca: str) -> str:
    """A directory shaped as a pod's service account mount: ca.crt (one CA) and a token."""
    account = tempfile.mkdtemp()
    Path(account, "ca.crt").write_text(Path(ca).read_text())
    Path(account, "token").write_text("x" * 1000 + "\n")  # a bound token's size
    return account


def measure(code: str, site: str, runs: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(SRC), site) if p))
    results = []
    for _ in range(runs):
        done = subprocess.run([sys.executable, "-c", _PROBE.format(code=code)], env=env,
                              capture_output=True, text=True, check=True, timeout=120)
        results.append(json.loads(done.stdout.splitlines()[-1]))
    return {key: statistics.median(r[key] for r in results) for key in results[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lightkube", default="", help="site-packages with lightkube and its models")
    parser.add_argument("--kubernetes-asyncio", default="", help="site-packages with kubernetes_asyncio")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    ca = one_ca()
    account = service_account(ca)
    try:
        cases = [("standard library TLS (ssl, one CA)", _TLS, ""),
                 ("hlplugin.kubeapi Client, in-cluster", _KUBEAPI, "")]
        if args.lightkube:
            cases.append(("lightkube AsyncClient + ResourceSlice", _LIGHTKUBE, args.lightkube))
        if args.kubernetes_asyncio:
            cases.append(("kubernetes_asyncio ResourceV1Api", _KUBERNETES_ASYNCIO,
                          args.kubernetes_asyncio))
        print(f"on top of import hlplugin.dra.driver, medians of {args.runs} fresh interpreters")
        for name, code, site in cases:
            m = measure(code.format(ca=ca, account=account), site, args.runs)
            print(f"{name:40s} +{m['kib'] / 1024:5.1f} MiB RSS  {m['seconds'] * 1000:6.0f} ms  "
                  f"+{m['modules']:4.0f} modules")
    finally:
        os.unlink(ca)
        shutil.rmtree(account)
    return 0


if __name__ == "__main__":
    sys.exit(main())
