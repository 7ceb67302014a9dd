#!/usr/bin/env python3
"""Reproduce the SnapKV paper in one command, then build the tables: the documented entry over harness/reproduce.py
(`python -m harness.reproduce` is the same command). `python scripts/reproduce_paper.py --help` lists the parts."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, the venv without an install

from harness.reproduce import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
