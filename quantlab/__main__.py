"""`python -m quantlab +precision=fp8`: the CLI entry point (no logic here; see quantlab.cli)."""
import sys


def main() -> None:
    """Run the command line (quantlab.cli) and exit with its code."""
    from quantlab.cli import main as cli_main

    sys.exit(cli_main())


if __name__ == "__main__":
    main()
