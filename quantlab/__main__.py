"""`python -m quantlab +precision=fp8`: the CLI entry point (no logic here; see quantlab.cli)."""
import sys


def main() -> None:
    from quantlab.cli import main as cli_main

    sys.exit(cli_main())


if __name__ == "__main__":
    main()
