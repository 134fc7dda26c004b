"""hlplugin: a Kubernetes device plugin that hands Hyperlight workloads a proven-usable hypervisor."""

from hlplugin.deviceplugin.process import lazyprom

__version__ = "0.1.0"

# Before any module of ours imports prometheus_client: its exposition code loads at the first scrape.
lazyprom.defer()
