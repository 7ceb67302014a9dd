"""The paper's efficiency and needle claims (results/paper/paper_claims.csv) next to ours: `claims.md|csv`.

Each claim is measured by whichever benchmark's report section says it measures it (`Tables.claim` of the benchmark's
report module, found through the task registry): the last matching run, or "not measured".
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Callable

from harness import REPO_ROOT
from harness.tables import markdown_table

PAPER_CLAIMS = REPO_ROOT / "results" / "paper" / "paper_claims.csv"


def load_claims(path: Path = PAPER_CLAIMS) -> list[dict]:
    if not Path(path).exists():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def claims_rows(claims: list[dict], measures: list[Callable], runs) -> list[dict]:
    """The paper's claims next to our matching measurement (the first benchmark whose `claim` answers), or 'not measured'."""
    devices = {run.rel: run.device for run in runs}
    out = []
    for c in claims:
        ours, where = None, ""
        for measure in measures:
            found = measure(c)
            if found:
                ours, where = found
                break
        out.append({**{k: c.get(k) for k in ("id", "claim", "model", "setting", "paper_full", "paper_snapkv", "paper_ratio", "unit", "hardware")},
                    "ours": ours or "not measured", "device": devices.get(where) if where else None, "run": where})
    return out


CLAIM_FIELDS = ["id", "claim", "model", "setting", "paper_full", "paper_snapkv", "paper_ratio", "unit", "hardware", "ours", "device", "run"]


def claims_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    headers = ["Claim", "Setting", "Paper: full", "Paper: SnapKV", "Paper ratio", "Paper hardware", "Ours", "Our device"]
    body = [[r["claim"], r["setting"], r["paper_full"] or "–", r["paper_snapkv"] or "–", r["paper_ratio"] or "–",
             r["hardware"] or "–", r["ours"], r["device"] or "–"] for r in rows]
    return "\n".join(["## The paper's efficiency and needle claims", "", markdown_table(headers, body), "",
                      "- Paper values: results/paper/paper_claims.csv (SnapKV, arXiv 2404.14469). Ours: the matching run under the "
                      "collected folder (model, batch, budget, length as in the claim), else 'not measured'. Measurements on "
                      "other hardware than the paper's are not the paper's numbers: compare ratios, not seconds."]) + "\n"


