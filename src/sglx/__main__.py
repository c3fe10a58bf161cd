"""`python -m sglx` runs the same CLI as the `sglx` executable."""

from sglx.cli.app import main

if __name__ == "__main__":
    main()
