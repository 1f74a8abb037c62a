"""`python -m specdec`: the `specdec` command (specdec_tools/cli.py), where the console script is not on the PATH.
A process's entry point, not a module of the shared core: nothing imports it, and the layering test
(tests/test_imports.py) leaves it out."""
import sys

from specdec_tools.cli import main

sys.exit(main())
