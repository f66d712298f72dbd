"""Shared fixtures: private redis-server processes and in-process recommendation servers."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterator

import pytest
import torch

# the devices the engine, drafter and rules tests run on: the CPU always, CUDA where a GPU is present
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    """The device under test ("cpu", and "cuda" when torch sees a GPU): a test or module fixture that takes it
    puts its model (and trie) there and runs once per device."""
    return request.param


REDIS_MISSING = "redis-server is not installed (apt-get install -y redis-server, or `make redis`)"


@pytest.fixture(autouse=True)
def _isolated_recsvc_logging() -> Iterator[None]:
    """Each test starts and ends with the ``recsvc`` loggers as it found them: a test that runs ``recsvc serve``
    in-process configures JSON logging to stderr, which must not leak into the next test's captured stderr."""
    root = logging.getLogger("recsvc")
    saved = (list(root.handlers), root.level, root.propagate)
    yield
    root.handlers[:], root.level, root.propagate = saved[0], saved[1], saved[2]


def _redis_process(tmp_path, name: str):
    if shutil.which("redis-server") is None:
        pytest.skip(REDIS_MISSING)
    from harness.redis_server import RedisProcess

    data_dir = tmp_path / name
    data_dir.mkdir()
    return RedisProcess(data_dir=data_dir)


@pytest.fixture
def redis_server(tmp_path) -> Iterator:
    """A private ``redis-server --port <free> --save "" --appendonly yes --appendfsync always`` on 127.0.0.1.

    The fixture value is a RedisProcess (``.url``, ``.stop()``, ``.start()``); skipped without redis-server.
    """
    proc = _redis_process(tmp_path, "redis")
    proc.start()
    yield proc
    proc.close()


@pytest.fixture
def persistent_redis_server(tmp_path) -> Iterator:
    """Like ``redis_server`` (also an fsync-always append-only file): data survives ``.restart()``."""
    proc = _redis_process(tmp_path, "redis-aof")
    proc.start()
    yield proc
    proc.close()


@pytest.fixture
def catalog():
    """A popularity recommender over items 1..2000 (item i has count 3000 - i), with semantic ids."""
    from recsvc.service.startup.popularity import PopularityRecommender

    counts = {item: 3000 - item for item in range(1, 2001)}
    semantic_ids = {item: [f"<a_{item % 256}>", f"<b_{item // 256}>", "<c_0>", "<d_0>"] for item in counts}
    return PopularityRecommender(counts, max_k=50, max_history=200, semantic_ids=semantic_ids)


@pytest.fixture
def make_server() -> Iterator[Callable]:
    """``make_server(recommender, store=None, **config_fields)`` -> a started RecServer (stopped after)."""
    from recsvc.service.rpc.server import RecServer, ServerConfig

    servers = []

    def factory(recommender, store=None, **config):
        config.setdefault("max_wait_ms", 2.0)
        server = RecServer(recommender, store, ServerConfig(**config)).start()
        servers.append(server)
        return server

    yield factory
    for server in servers:
        server.stop(grace_s=0.5)
