"""quantkit's command line from a checkout, without installing it: ``python cli.py --help``.

The same app as the installed ``quantkit`` command (quantkit/cli.py), with this folder's package first on the path.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quantkit.cli import main  # noqa: E402  (after the path is set)

if __name__ == "__main__":
    main()
