"""``python -m quantkit``: the same as the ``quantkit`` command."""

from quantkit.cli import main

main()
