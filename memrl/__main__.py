"""`python -m memrl ...` runs the same command line as the `memrl` script (useful from a checkout that is
not the installed one: `PYTHONPATH=. python -m memrl`)."""
from memrl.cli import main

if __name__ == "__main__":
    main()
