"""``python -m pdserve.router ...`` (same flags as ``pdserve router``)."""

from __future__ import annotations

import sys

from pdserve.router.cli import main

if __name__ == "__main__":
    sys.exit(main())
