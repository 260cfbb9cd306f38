"""`python -m quantlab.summary DIR [DIR ...] [--out OUT]`: the command lives in quantlab.tools.summary."""
import sys

from quantlab.errors import cli_guard
from quantlab.tools.summary import main

if __name__ == "__main__":
    sys.exit(cli_guard(main))
