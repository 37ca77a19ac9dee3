"""``python -m specdec.serve ARGS`` = ``specdec serve ARGS``."""

import sys

from specdec.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
