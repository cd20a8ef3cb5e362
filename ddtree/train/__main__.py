"""`python -m ddtree.train ...` runs the training command line (ddtree.train.cli)."""

import sys

from ddtree.train.cli import main

sys.exit(main())
