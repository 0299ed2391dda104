"""``python -m gdnprune``: same as the ``gdnprune`` command."""

import sys

from .cli import main

sys.exit(main())
