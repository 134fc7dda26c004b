import sys

from hlplugin.cli import main

sys.exit(main())
