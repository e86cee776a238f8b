"""``python -m fxpipe``: the same command line as the ``fxpipe`` console script."""

import sys

from .cli._main import main

if __name__ == "__main__":
    sys.exit(main())
