"""``python -m kuberl_cli …`` is the ``kuberl`` command."""

import sys

from .main import main

sys.exit(main())
