"""kv-harness: a reproducible evaluation harness for KV-cache compression (SnapKV and baselines)."""

from pathlib import Path

__version__ = "0.1.0"

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
CONF_DIR = REPO_ROOT / "conf"
