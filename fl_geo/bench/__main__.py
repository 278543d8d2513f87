"""``python -m fl_geo.bench ...``: the same as ``fl-geo bench ...``."""

import sys

from fl_geo.bench.command import main

sys.exit(main())
