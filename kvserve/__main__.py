"""``python -m kvserve``: the ``kvserve`` command."""

import sys

from kvserve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
