"""Sticky routing by user id (consistent hashing) over two real local servers, each with its own in-process
history store: a user's record and later reads reach the same server; a stopped server's users move to the
next one on the ring; the ring moves only the removed server's users."""

from __future__ import annotations

import pytest

from recsvc.client.routing import HashRing
from recsvc.client.sticky import StickyClient, split_targets


def test_ring_spreads_users_and_moves_only_a_removed_servers_users():
    targets = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]
    ring = HashRing(targets)
    users = [f"user-{i}" for i in range(3000)]
    owners = {user: ring.owner(user) for user in users}
    shares = [sum(1 for o in owners.values() if o == t) / len(users) for t in targets]
    assert all(0.2 < share < 0.47 for share in shares), shares
    assert HashRing(list(reversed(targets))).owner("user-7") == owners["user-7"]  # order of the list is irrelevant
    smaller = HashRing(targets[:2])
    moved = [u for u in users if smaller.owner(u) != owners[u]]
    assert moved and all(owners[u] == targets[2] for u in moved)  # only the removed server's users move
    assert ring.order("user-1")[0] == owners["user-1"] and sorted(ring.order("user-1")) == sorted(targets)
    with pytest.raises(ValueError, match="distinct"):
        HashRing(["a:1", "a:1"])
    with pytest.raises(ValueError, match="host:port"):
        split_targets("a:1,b")


def test_a_users_calls_reach_one_server(catalog, make_server):
    first, second = make_server(catalog), make_server(catalog)  # each has its own in-memory history store
    users = [f"u{i}" for i in range(30)]
    with StickyClient(f"{first.address},{second.address}", timeout_s=5) as client:
        assert set(client.health().values()) == {"SERVING"}
        for i, user in enumerate(users):
            client.record(user, [i + 1, i + 2])
        for i, user in enumerate(users):
            assert client.history(user) == [i + 1, i + 2]  # read where it was written
            reply = client.recommend(user, k=2, exclude_history=True)
            assert i + 1 not in [item.item_id for item in reply.items]
        by_server = {s.address: [u for u in users if client.target_of(u) == s.address] for s in (first, second)}
        assert all(by_server.values()), by_server  # both servers own users
        for server, own in ((first, by_server[first.address]), (second, by_server[second.address])):
            assert sorted(u for u in users if server.store.get(u)) == sorted(own)

        moved = by_server[first.address][0]
        first.stop(grace_s=0.5)
        assert client.health()[first.address] == "UNAVAILABLE"
        # reads of the stopped server's users go to the next server on the ring (its own, empty, store)
        assert client.history(moved) == []
        assert client.recommend(moved, history=[1], k=2).items
        kept = by_server[second.address][0]
        assert client.history(kept) == [users.index(kept) + 1, users.index(kept) + 2]


def _client_cli(argv: list[str]) -> int:
    import argparse

    from recsvc.client import cli as client_cli

    parser = argparse.ArgumentParser(prog="recsvc")
    client_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["client", *argv])
    return args.func(args)


def test_client_cli_routing_sticky(catalog, make_server, capsys):
    import json

    first, second = make_server(catalog), make_server(catalog)
    target = f"{first.address},{second.address}"
    with StickyClient(target) as probe:
        owner = probe.target_of("alice")
    common = ["--target", target, "--routing", "sticky", "--user", "alice"]
    for _ in range(3):  # every write and read of alice reaches her server, so its history grows in one place
        assert _client_cli(["record", *common, "--items", "4,5"]) == 0
    assert json.loads(capsys.readouterr().out.split("}\n")[-2] + "}")["history_length"] == 6
    assert _client_cli(["history", *common]) == 0
    assert json.loads(capsys.readouterr().out)["item_ids"] == [4, 5] * 3
    stores = {s.address: s.store.get("alice") for s in (first, second)}
    assert stores[owner] == [4, 5] * 3 and not [v for t, v in stores.items() if t != owner and v]
    assert _client_cli(["health", "--target", target, "--routing", "sticky"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == {first.address: "SERVING", second.address: "SERVING"}
