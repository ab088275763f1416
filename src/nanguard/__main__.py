"""`python -m nanguard` is the same as the `nanguard` command."""

from nanguard.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
