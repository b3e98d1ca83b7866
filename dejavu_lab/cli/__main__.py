"""``python -m dejavu_lab.cli``: the ``dejavu-lab`` command."""

import sys

from .main import main

sys.exit(main())
