"""A generic Kubernetes kubelet plugin (device plugin or DRA driver): what every daemon shares, and
nothing resource-specific.

Three wings, each importing only the ones below it and this package's root modules (metrics,
files, quoting, ownedfile), which import no wing (tests/test_deviceplugin_generic.py):

- ``process``: a daemon's named root tasks, signals, HTTP probes and scrape, lazy imports;
- ``kubelet``: the kubelet protocols, each in a wing of its own (``kubelet.deviceplugin``: the
  device-plugin API's lifecycle, registration and servicer base; ``kubelet.dra``: the DRA
  driver's plugin-watcher registration, service, health stream, writer and checkpoint) over what
  both share (socket ownership, the bounded gRPC server, the call context, the instance's role);
- ``health``: conditions and their tracker, the producers that keep them, bounded runners,
  directory watches, repeated-line aggregation.

A daemon built on it passes in its resource name, socket name, metrics prefix, checks and the
words its operators know (the flag that names the plugin directory).
"""
