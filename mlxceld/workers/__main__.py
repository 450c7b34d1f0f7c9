"""``python -m mlxceld.workers --role ROLE --name NAME``: started by the supervisor only.

The role and name on the command line are for ``ps``; the authoritative spec
arrives on stdin.
"""

import sys

from mlxceld.workers.runtime import main

sys.exit(main(sys.argv[1:]))
