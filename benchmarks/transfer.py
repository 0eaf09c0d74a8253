"""Thin wrapper: ``python benchmarks/transfer.py [options]`` == ``kvferry bench transfer [options]``.

Results of this machine are kept in benchmarks/results/transfer_<machine>.json and .png.
"""

from __future__ import annotations

import sys

from kvferry.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "transfer", *sys.argv[1:]]))
