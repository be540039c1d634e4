"""``python -m kvmodels.eval``: run the quality sweep (see :func:`kvmodels.eval.sweep.main`)."""

import sys

from kvmodels.eval.sweep import main

sys.exit(main())
