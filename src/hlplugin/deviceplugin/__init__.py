"""A generic Kubernetes device plugin: what both daemons share, and nothing resource-specific.

Three wings, each importing only the ones below it and this package's root modules (metrics,
files, quoting, ownedfile), which import no wing (tests/test_deviceplugin_generic.py):

- ``process``: a daemon's named root tasks, signals, HTTP probes and scrape, lazy imports;
- ``kubelet``: the socket the kubelet dials, registration, the lifecycle, the gRPC server and
  the servicer base with its seams (kubelet/interfaces.py);
- ``health``: conditions and their tracker, the producers that keep them, bounded runners,
  directory watches, repeated-line aggregation.

A daemon built on it passes in its resource name, socket name, metrics prefix, checks and the
words its operators know (the flag that names the plugin directory).
"""
