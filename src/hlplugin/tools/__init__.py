"""What the CLI offers beside the daemons, and what the tests and benchmarks drive them with.

The kubelet emulator (``emulator``), the daemon-process driver (``process``), ``hlplugin demo``
and ``hlplugin doctor``. The daemons never import this package (tests/test_layers.py).
"""
