"""The failover drill's client load and its ledger: every call with its time, type and status code, and every
acknowledged write as (user, sequence number).

Each client thread owns its users, so a user's writes are sequential: write ``n`` of a user records item ``n``
(1, 2, 3, ...), and an acknowledged write is exactly "item n is in the user's history". Call types:
``record`` (RecordInteractions, writes stored history), ``recommend_stored`` (Recommend on the stored history),
``history`` (GetHistory), ``recommend_inline`` (Recommend with the history in the request: needs no store).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from recsvc.client.client import RecClient

CALL_TYPES = ("record", "recommend_stored", "history", "recommend_inline")
STORED = frozenset(CALL_TYPES[:3])  # the calls that need the history store
MIX = ((0.40, "record"), (0.65, "recommend_stored"), (0.80, "history"), (1.00, "recommend_inline"))


@dataclass
class Call:
    at: float  # time.monotonic() when the answer came
    kind: str
    user: str
    code: str


@dataclass
class Ledger:
    """One thread's record (no locks: merged after the threads have stopped)."""

    calls: list[Call] = field(default_factory=list)
    acked: dict[str, list[int]] = field(default_factory=dict)  # user -> acknowledged sequence numbers
    sent: Counter = field(default_factory=Counter)  # user -> writes sent (acknowledged or not)


def user_ids(threads: int, per_thread: int) -> list[list[str]]:
    return [[f"drill-{t}-{u}" for u in range(per_thread)] for t in range(threads)]


def _one_call(client: RecClient, kind: str, user: str, ledger: Ledger, rng: random.Random) -> None:
    if kind == "record":
        ledger.sent[user] += 1
        seq = ledger.sent[user]
        client.record(user, [seq])
        ledger.acked.setdefault(user, []).append(seq)
    elif kind == "recommend_stored":
        client.recommend(user, k=5)
    elif kind == "history":
        client.history(user)
    else:
        client.recommend(user, history=rng.sample(range(1, 1000), 3), k=5)


def run_load(
    target: str,
    users: list[list[str]],
    stop: threading.Event,
    *,
    seed: int = 0,
    pause_s: float = 0.002,
    timeout_s: float = 5.0,
) -> list[Ledger]:
    """One thread per entry of ``users`` (its own users and channel), calling until ``stop`` is set; returns
    the ledgers once every thread has finished."""
    ledgers = [Ledger() for _ in users]

    def worker(i: int) -> None:
        rng = random.Random(seed * 7919 + i)
        with RecClient(target, timeout_s=timeout_s) as client:
            while not stop.is_set():
                draw = rng.random()
                kind = next(name for bound, name in MIX if draw < bound)
                user = rng.choice(users[i])
                try:
                    _one_call(client, kind, user, ledgers[i], rng)
                    code = "OK"
                except grpc.RpcError as exc:
                    code = exc.code().name
                ledgers[i].calls.append(Call(time.monotonic(), kind, user, code))
                if pause_s:
                    time.sleep(pause_s)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(users))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ledgers


def lost_writes(acked: dict[str, list[int]], histories: dict[str, list[int]]) -> dict[str, int]:
    """Acknowledged sequence numbers missing from the final histories; stored writes that were never
    acknowledged (answered UNAVAILABLE, yet applied); items stored more than once (an append retried after a
    broken connection)."""
    lost = stored_unacked = duplicates = 0
    for user, history in histories.items():
        present = Counter(history)
        mine = set(acked.get(user, ()))
        lost += len(mine - present.keys())
        stored_unacked += len(present.keys() - mine)
        duplicates += sum(n - 1 for n in present.values())
    return {"lost": lost, "stored_but_not_acknowledged": stored_unacked, "duplicates": duplicates}
