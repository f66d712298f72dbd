"""One history append as a Lua script (atomic RPUSH, LTRIM, EXPIRE, LLEN on one key), optionally followed by
``WAIT numreplicas timeout`` on the same connection.

WAIT counts the replicas that acknowledged every write made on *its own connection*, so the script and the
WAIT travel in one pipeline (one connection, one round trip). When WAIT returns fewer replicas than asked,
:class:`WriteNotReplicated` is raised: the append is then not acknowledged (the caller answers UNAVAILABLE),
although the items may still be in the master's list; it is never retried (that would store them twice).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis
from redis.exceptions import RedisError

from .base import HistoryStoreUnavailable

# ARGV: max_len, ttl_s, item...; RPUSH in chunks (Lua's unpack has a stack limit of a few thousand values)
APPEND_SCRIPT = """
local key = KEYS[1]
for i = 3, #ARGV, 1000 do
  redis.call('RPUSH', key, unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('LTRIM', key, -tonumber(ARGV[1]), -1)
redis.call('EXPIRE', key, ARGV[2])
return redis.call('LLEN', key)
"""


@dataclass(frozen=True)
class WaitPolicy:
    """Acknowledge an append only once ``replicas`` replicas have it, waiting at most ``timeout_ms``."""

    replicas: int
    timeout_ms: int = 500

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.timeout_ms < 1:
            raise ValueError("WAIT needs replicas >= 1 and timeout_ms >= 1 (0 would block forever)")


class WriteNotReplicated(HistoryStoreUnavailable):
    """WAIT returned fewer replicas than the policy asks for: the append is not acknowledged."""


def append_script(
    client: redis.Redis,
    key: str,
    values: Sequence[int],
    *,
    max_len: int,
    ttl_s: int,
    wait: WaitPolicy | None = None,
    asking: bool = False,
) -> int:
    """Runs the append on ``client`` (one connection: a pipeline, not a transaction); returns the list's
    length. Redis errors propagate (the first failed reply is raised); ``asking``: prefix ``ASKING`` (a
    cluster slot being migrated to this node)."""
    pipe = client.pipeline(transaction=False)
    if asking:
        pipe.execute_command("ASKING")
    pipe.execute_command("EVAL", APPEND_SCRIPT, 1, key, max_len, ttl_s, *values)
    if wait is not None:
        pipe.execute_command("WAIT", wait.replicas, wait.timeout_ms)
    replies = pipe.execute(raise_on_error=False)
    for reply in replies:
        if isinstance(reply, RedisError):
            raise reply
    length = int(replies[1 if asking else 0])
    if wait is not None:
        acked = int(replies[-1])
        if acked < wait.replicas:
            raise WriteNotReplicated(
                f"append not replicated: {acked} of {wait.replicas} replicas within {wait.timeout_ms} ms"
            )
    return length
