"""Render a chaos run's JSON (``python -m chaos --json FILE``) as docs/guarantees.md's table.

    python -m chaos.report chaos/results/full.json

One row per fault, one column per backend. A cell says which guarantees held
in that phase and the longest time the lock was unavailable:

- **fenced**: the register's accepted writes stayed in one increasing
  sequence (no lost update, no stale write) and no token was issued twice;
- **exclusive**: no two holders overlapped (not promised, and not checked,
  where a holder is paused or the server loses its data: then the overlaps
  seen are counted);
- **live**: the lock was taken again within the liveness bound of each heal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from chaos.run import FAULTS, TARGETS


def cell(row: dict[str, Any]) -> str:
    violations = row["violations"]
    if violations:
        return f"**{len(violations)} violation(s)**: {violations[0]}"
    fault = FAULTS[row["fault"]]
    if fault.pauses or fault.loses_data:
        exclusive = f"{row['overlaps']} overlaps (not promised)"
    else:
        exclusive = "exclusive"
    return f"fenced, {exclusive}, live; {row['longest_unavailable']:.1f} s"


def render(results: dict[str, Any], source: str) -> str:
    rows = results["rows"]
    backends = [t for t in TARGETS if any(r["backend"] == t for r in rows)]
    head = ["Fault", *backends]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for fault in FAULTS:
        mine = {r["backend"]: r for r in rows if r["fault"] == fault}
        if not mine:
            continue
        cells = [cell(mine[b]) if b in mine else "—" for b in backends]
        lines.append(f"| `{fault}`: {FAULTS[fault].what} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        f"Run behind every row: `{results['command']}` ({results['seconds']:.0f} s, TTL "
        f"{results['ttl']:g} s, liveness bound TTL + {results['slack']:g} s), results in "
        f"`{source}`."
    )
    return "\n".join(lines)


def main() -> None:
    path = Path(sys.argv[1])
    print(render(json.loads(path.read_text()), str(path)))


if __name__ == "__main__":
    main()
