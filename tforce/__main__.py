"""`python -m tforce ...`: the same command line as `tforce ...`."""
from .cli import main

if __name__ == "__main__":
    main()
