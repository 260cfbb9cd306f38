"""`python -m quantlab.cache list | prune ...`: the command lives in quantlab.tools.cache."""
import sys

from quantlab.errors import cli_guard
from quantlab.tools.cache import main

if __name__ == "__main__":
    sys.exit(cli_guard(main))
