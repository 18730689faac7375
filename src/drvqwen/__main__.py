"""`python -m drvqwen`: the same as the `drvqwen` command."""

import sys

from ._entry import main

sys.exit(main())
