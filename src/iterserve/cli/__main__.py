"""`python -m iterserve.cli ...`, as the `iterserve` script (what servers started by tests
and benchmarks run)."""

import sys

from iterserve.cli.main import main

sys.exit(main())
