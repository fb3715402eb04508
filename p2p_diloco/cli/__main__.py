"""``python -m p2p_diloco.cli.main``: the same as the ``p2p-diloco`` command."""

import sys

from p2p_diloco.cli.main import main

sys.exit(main())
