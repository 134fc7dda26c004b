"""`python -m hlplugin` and the `hlplugin` command (pyproject's console script names run())."""

import gc
import sys


def run() -> int:
    # A start imports some 200 modules, whose 45,000 objects live as long as the process; while
    # they are made, the cyclic GC would traverse them again and again (about 10 ms of a start).
    # It stays off until they are made: cli.main then freezes them (no later collection
    # traverses them) and turns it back on.
    gc.disable()
    from hlplugin.cli import main

    return main()


if __name__ == "__main__":
    sys.exit(run())
