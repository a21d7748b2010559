"""``python -m tpcomm``: the ``tpcomm`` command (see :mod:`tpcomm.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
