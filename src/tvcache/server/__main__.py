"""`python -m tvcache.server serve|stats ...`: the same commands as `tvcache serve|stats`."""

import sys

from .cli import main

sys.exit(main())
