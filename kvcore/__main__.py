"""``python -m kvcore ...`` (and ``torchrun -m kvcore up ...``): the ``kvcore`` command line."""

import sys

from kvcore.tools.cli import main

sys.exit(main())
