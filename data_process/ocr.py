#!/usr/bin/env python
"""Checkout entry point of ``python -m verl_diffusion.data_process.ocr`` (the script ships in the package; --help)."""

import sys

from verl_diffusion.data_process.ocr import *  # noqa: F401,F403  (the script's functions, for tests and imports)
from verl_diffusion.data_process.ocr import main

if __name__ == "__main__":
    sys.exit(main())
