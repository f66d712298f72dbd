"""Per-request device counts for the benches' JSON: eager device operations (what a GPU launches from Python,
``recsvc.engine.meters.launches``), graph replays (work a GPU replays as captured graphs; on a CPU the units the
sync-free forwards mark as such) and device-to-host reads (``recsvc.engine.meters.host_reads``).

Counting costs a Python call per torch call, so it runs on requests of its own, never inside a timed one:
``count_requests`` runs each request twice, once under each counter.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch


def count_requests(requests: Sequence[Callable[[], object]], device: torch.device | str) -> dict:
    """Means over ``requests`` (each a call that makes one request): {"eager_ops", "replays", "host_reads",
    "requests"}; the reads are those of tensors on ``device``. Empty when there is no request."""
    from recsvc.engine.meters.host_reads import HostReads
    from recsvc.engine.meters.launches import Launches

    ops, replays, reads = [], [], []
    for request in requests:
        with Launches() as n:
            request()
        with HostReads(device) as r:
            request()
        ops.append(n.total)
        replays.append(n.replays)
        reads.append(r.total)
    if not ops:
        return {}
    return {"eager_ops": statistics.mean(ops), "replays": statistics.mean(replays),
            "host_reads": statistics.mean(reads), "requests": len(ops)}
