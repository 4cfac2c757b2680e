"""``python -m hf_openjev ...``: the same command line as ``hf-openjev`` (so ``accelerate launch -m hf_openjev eval``
works)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
