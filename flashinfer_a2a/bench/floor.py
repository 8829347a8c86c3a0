"""The floor of a step on the links it runs over, from what ``docs/measurements/link_floor.py`` measured there
(``--floor floor.json``): each row of this package is printed as a multiple of it.

A pair (dispatch then combine) cannot take less than two handshakes (each phase signals its peers and waits for
them: the probe's handshake kernel, launch gap included) plus its remote bytes moved at the best rate the probe
measured to that many peers at once, by any engine: SM stores or loads at any of its buffer sizes, TMA bulk copies or
the copy engine. Both phases take that rate, since either could move its rows that way (a pushed combine stores, a
pulled one loads), so no step runs under its floor. A short transfer of the probe runs below that rate because its
own launch and first round trip count in its time; in a step they overlap the handshakes, so the floor does not count
them twice.
"""

from __future__ import annotations

import json
from typing import Any, Optional


class FloorError(ValueError):
    """The floor file is missing figures this run needs."""


def load(path: Optional[str]) -> Optional[dict[str, Any]]:
    """The probe's JSON, or None without a path."""
    if path is None:
        return None
    with open(path) as f:
        floor = json.load(f)
    for key in ("store", "load", "handshake_us"):
        if key not in floor:
            raise FloorError(f"{path} has no {key!r}: write it with docs/measurements/link_floor.py --json")
    return floor


def check_ranks(floor: dict[str, Any], ep_size: int) -> None:
    """Raises FloorError unless the file has the figures of a step on ``ep_size`` ranks."""
    if ep_size < 2:
        raise FloorError("a floor needs 2 or more ranks")
    peers = str(ep_size - 1)
    if peers not in floor["store"] or peers not in floor["load"] or str(ep_size) not in floor["handshake_us"]:
        raise FloorError(f"the floor file has no figures for {ep_size} ranks (it was measured on {floor.get('gpus')} "
                         "GPUs): measure this run's GPUs with docs/measurements/link_floor.py --json")


def best_rate(floor: dict[str, Any], peers: str) -> float:
    """Bytes per microsecond of the fastest way the probe moved bytes to ``peers`` peers at once."""
    engines = floor.get("store_engines", {}).get(peers, {})
    rates = [*floor["store"][peers].values(), *floor["load"][peers].values()]
    return max(rates + [rate for engine, rate in engines.items() if engine != "bytes"])


def pair_floor_us(floor: dict[str, Any], ep_size: int, dispatch_bytes: float, combine_bytes: float) -> float:
    """Microseconds a pair moving these remote bytes per rank cannot go under on ``ep_size`` ranks."""
    check_ranks(floor, ep_size)
    moved = (dispatch_bytes + combine_bytes) / best_rate(floor, str(ep_size - 1))
    return 2 * floor["handshake_us"][str(ep_size)] + moved
