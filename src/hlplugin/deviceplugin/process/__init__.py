"""The process: a daemon's named root tasks, its stop signals, its HTTP probes and metrics scrape,
and the lazy imports that keep its start small. The top wing: it may import the health wing and
the package root, and serves any daemon whatever kubelet protocol it speaks: it asks the daemon's
kubelet side only what daemon.KubeletSide declares, and imports no kubelet protocol
(tests/test_layers.py)."""
