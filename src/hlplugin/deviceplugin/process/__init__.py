"""The process: a daemon's named root tasks, its stop signals, its HTTP probes and metrics scrape,
and the lazy imports that keep its start small. The top wing: it may import every other."""
