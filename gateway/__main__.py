"""``python -m gateway serve ...`` (see gateway/server.py)."""

import sys

from gateway.server import main

if __name__ == "__main__":
    sys.exit(main())
