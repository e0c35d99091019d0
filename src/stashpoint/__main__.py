"""``python -m stashpoint``: the same commands as the ``stashpoint`` console script."""

from stashpoint._tools.cli import main

if __name__ == "__main__":
    main()
