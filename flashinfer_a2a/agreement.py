"""Construction agreement: every rank checks that all ranks build a MoeAlltoAll with the same sizes and modes.

Ranks built with a different ``hidden_size``, ``top_k``, ``num_experts``, ``dtype`` or ``max_num_tokens`` would
otherwise run without an error and return wrong rows (receivers read rows laid out for other sizes, or tokens for
experts they do not own); a workspace of another size fails later in ``cuMemMap`` with an error that blames the
hardware. The check is one allgather of a small record before anything is allocated, and it touches no GPU, so a
mismatch raises the same ValueError on every rank.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from .comm import Communicator


def construction_record(**fields: Any) -> dict[str, str]:
    """The fields as strings (dtypes, formats and None print unambiguously; JSON carries them unchanged)."""
    return {name: str(value) for name, value in fields.items()}


def check_agreement(comm: Communicator, record: Mapping[str, str], what: str = "MoeAlltoAll") -> None:
    """Allgathers ``record`` and raises ValueError on every rank if any field differs between ranks.

    Collective: every rank of ``comm`` calls it. The message names each differing field with every rank's value,
    so the rank that was configured differently can be found from any rank's log.
    """
    mine = json.dumps(dict(record), sort_keys=True).encode()
    records = [json.loads(blob) for blob in comm.allgather(mine)]
    differing = sorted({name for r in records for name in r if any(o.get(name) != r.get(name) for o in records)})
    if not differing:
        return
    lines = []
    for name in differing:
        values = ", ".join(f"rank {r}: {rec.get(name, '<missing>')}" for r, rec in enumerate(records))
        lines.append(f"{name} ({values})")
    raise ValueError(f"{what}: the ranks were built with different arguments: " + "; ".join(lines) +
                     ". Every rank of the group must pass the same sizes, dtype, formats and modes.")
