"""``python -m cuda_graph_runner.cli``: the ``cuda-graph-runner`` command."""

import sys

from .command import main

if __name__ == "__main__":
    sys.exit(main())
