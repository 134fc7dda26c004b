"""A generic Kubernetes device plugin: what both daemons share, and nothing resource-specific.

The lifecycle (serve, register, watch, re-register), the servicer base (ListAndWatch of a health
tracker, request bounds), the daemon runner (root tasks, signals, HTTP probes), the health
conditions and their producers, the directory watcher and the metrics every device plugin
exports. A daemon built on it passes in its resource name, socket name, metrics prefix, checks
and the words its operators know (the flag that names the plugin directory); the seams it
implements are in interfaces.py.
"""
