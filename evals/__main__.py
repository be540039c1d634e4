"""``python -m evals``: run the quality sweep (see :func:`evals.sweep.main`)."""

import sys

from evals.sweep import main

sys.exit(main())
