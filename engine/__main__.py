"""``python -m pdserve.engine`` is ``pdserve serve``."""

import sys

from pdserve.entrypoints.cli import serve_main

sys.exit(serve_main(sys.argv[1:]))
