"""hlplugin: a Kubernetes device plugin that hands Hyperlight workloads a proven-usable hypervisor."""

__version__ = "0.1.0"
