"""Which code produced a table set: the code version of every record, per run and over all runs.

Every record carries `_code` (harness/rundir.py: a fingerprint of harness/ and metrics/, plus the torch and
transformers versions). A run resumed with `resume=force` holds records of more than one version, and a table set
collected from several runs may merge runs made by different versions. Neither is refused here (a forced resume
was a decision), but neither stays silent: `runs.csv` gets a `code` column and README.md a paragraph naming every
version, the git commits its sessions ran at, how many runs it made, and which runs mix versions.
"""

from __future__ import annotations

import json
from collections import Counter

from harness.rundir import record_codes


def version_label(code) -> str:
    """`fingerprint` of a record's `_code`, with its library versions: `1ee77b7a9c8f (torch 2.13.0, transformers
    5.24.0)`; `unrecorded` for records written before fingerprints were."""
    if not isinstance(code, dict) or not code.get("fingerprint"):
        return "unrecorded"
    libs = ", ".join(f"{k} {v}" for k, v in sorted(code.items()) if k != "fingerprint" and v)
    return f"{code['fingerprint']} ({libs})" if libs else str(code["fingerprint"])


def run_versions(run) -> Counter:
    """Records per code version in the run's directory; a run without records (bench) counts its session's version once."""
    counts = Counter(version_label(c) for c in record_codes(run.path.parent))
    if not counts:
        counts[version_label((run.data.get("provenance") or {}).get("code"))] += 1
    return counts


def _sessions(run) -> list:
    """The provenance of every session the run was made of: results.json's (the last session), and
    provenance.json's `earlier_sessions` (resumed runs), where the run directory still has it."""
    sessions = [run.data.get("provenance") or {}]
    try:
        stored = json.loads((run.path.parent / "provenance.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return sessions
    return sessions + [stored] + list(stored.get("earlier_sessions") or []) if isinstance(stored, dict) else sessions


def commits_by_fingerprint(runs) -> dict[str, set[str]]:
    """fingerprint -> the git commits (7 hex digits, `+dirty`) of the sessions that recorded it (this one and earlier)."""
    out: dict[str, set[str]] = {}
    for run in runs:
        for session in _sessions(run):
            fingerprint = (session.get("code") or {}).get("fingerprint") if isinstance(session, dict) else None
            git = session.get("git") if isinstance(session, dict) else None
            if fingerprint and isinstance(git, dict) and git.get("commit"):
                out.setdefault(fingerprint, set()).add(str(git["commit"])[:7] + ("+dirty" if git.get("dirty") else ""))
    return out


def code_column(counts: Counter) -> str:
    """runs.csv's `code`: the one version, or every version with its record count."""
    if len(counts) == 1:
        return next(iter(counts))
    return "; ".join(f"{label} x{n}" for label, n in sorted(counts.items()))


def versions_paragraph(runs, per_run: dict[str, Counter]) -> list[str]:
    """README.md lines: the code versions behind the table set, and the runs whose records mix versions."""
    if not runs:
        return []
    made: Counter = Counter()
    for counts in per_run.values():
        made.update(counts.keys())
    commits = commits_by_fingerprint(runs)

    def named(label: str) -> str:
        found = sorted(commits.get(label.split(" ")[0], ()))
        return f"`{label}`" + (f" (git {', '.join(found)})" if found else "")

    mixed = [rel for rel, counts in per_run.items() if len(counts) > 1]
    if len(made) == 1:
        lines = [f"Code version: every record of the {len(runs)} run(s) was written by {named(next(iter(made)))}."]
    else:
        lines = [f"**Code versions: {len(made)}.** These tables merge records written by different code or libraries:"]
        lines += [f"- {named(label)}: records in {n} run(s)" for label, n in sorted(made.items())]
        if mixed:
            lines.append(f"- {len(mixed)} run(s) hold records of more than one version (resumed with `resume=force`): "
                         + ", ".join(f"`{rel}`" for rel in mixed[:5]) + (" ..." if len(mixed) > 5 else "")
                         + "; records per version in runs.csv (`code`).")
    return lines + [""]
