"""``python -m perfloop.cli``: the `perfloop` command."""

import sys

from perfloop.cli.parser import main

sys.exit(main())
