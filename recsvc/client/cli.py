"""``recsvc client recommend|record|history|health``: talks to a running service and prints JSON.

gRPC errors print ``error: CODE: details`` on stderr (never a traceback) and exit with 2 for
INVALID_ARGUMENT, 1 for any other status. Items are named by number (``--history``, ``--exclude``, ``--items``)
or by key, the team's own ids (``--history-keys``, ``--exclude-keys``, ``--item-keys``); the output shows each
item's key when the server's catalog has one.
"""

from __future__ import annotations

import argparse
import json
import sys

from recsvc.errors import UserError
from recsvc.service.arg_types import add_history_flags

EXIT_INVALID = 2
EXIT_OTHER = 1


def _ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _keys(text: str) -> list[str]:
    """``"B00ABC, B00DEF"`` -> ["B00ABC", "B00DEF"] (a key holding a comma cannot be given here)."""
    keys = [part.strip() for part in text.split(",") if part.strip()]
    if not keys:
        raise argparse.ArgumentTypeError(f"expected comma-separated item keys, got {text!r}")
    return keys


def _split(text: str, flag: str) -> tuple[str, str]:
    attribute, sep, rest = text.partition("=")
    if not sep or not attribute.strip() or not rest.strip():
        raise argparse.ArgumentTypeError(f"{flag} takes ATTRIBUTE=..., got {text!r}")
    return attribute.strip(), rest.strip()


def _cap(text: str) -> tuple[str, int]:
    """``brand=2`` -> ("brand", 2)."""
    attribute, m = _split(text, "--max-per")
    try:
        return attribute, int(m)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-per takes ATTRIBUTE=M (an integer), got {text!r}") from None


def _values(text: str) -> tuple[str, list[str]]:
    """``category=skin,makeup`` -> ("category", ["skin", "makeup"])."""
    attribute, rest = _split(text, "--allow / --deny")
    return attribute, [v.strip() for v in rest.split(",") if v.strip()]


def _boost(text: str) -> tuple[str, str, float]:
    """``brand=olay:0.5`` -> ("brand", "olay", 0.5)."""
    attribute, rest = _split(text, "--boost")
    value, sep, weight = rest.rpartition(":")
    try:
        if not sep or not value.strip():
            raise ValueError
        return attribute, value.strip(), float(weight)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--boost takes ATTRIBUTE=VALUE:WEIGHT, got {text!r}") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("client", help="call a running recommendation service", description=__doc__)
    sub = p.add_subparsers(dest="client_command", metavar="ACTION", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default="127.0.0.1:50051",
                        help="host:port, several as IP:port,IP:port, or a gRPC URI (dns:///name:port, ipv4:...): "
                             "round_robin over the servers, UNAVAILABLE retried (default: %(default)s)")
    common.add_argument("--routing", choices=("round_robin", "sticky"), default="round_robin",
                        help="several servers: round_robin (any server answers) or sticky (every call for a user "
                             "goes to that user's server by consistent hashing, the next one if it is UNAVAILABLE; "
                             "for deployments that keep per-user state in process) (default: %(default)s)")
    common.add_argument("--api-key", help="sent as x-api-key (default: $RECSVC_API_KEY)")
    common.add_argument("--tls-ca", help="PEM CA certificate (enables TLS)")
    common.add_argument("--tls-server-name", help="expected server name in its certificate")
    common.add_argument("--timeout", type=float, default=10.0, help="seconds (default: %(default)s)")

    rec = sub.add_parser("recommend", parents=[common], help="top-k items for a user")
    rec.add_argument("--user", required=True)
    rec.add_argument("--history", type=_ids, default=[], help="inline history 1,2,3 (default: stored)")
    rec.add_argument("--history-keys", type=_keys, default=[], metavar="KEY,KEY",
                     help="the inline history as item keys, e.g. B00ABC,B00DEF (instead of --history)")
    rec.add_argument("--k", type=int)
    rec.add_argument("--mode", choices=("default", "strict", "relaxed", "plain"), default="default")
    rec.add_argument("--exclude", type=_ids, default=[], help="item ids never returned")
    rec.add_argument("--exclude-keys", type=_keys, default=[], metavar="KEY,KEY",
                     help="item keys never returned (instead of --exclude)")
    add_history_flags(rec, "do not recommend history items", "history items may be recommended "
                      "(default: as the server is configured)")
    rec.add_argument("--temperature", type=float)
    rec.add_argument("--seed", type=int)
    rec.add_argument("--max-per", type=_cap, action="append", default=[], metavar="ATTRIBUTE=M",
                     help="at most M items per value of the attribute, e.g. brand=2 (repeatable)")
    rec.add_argument("--allow", type=_values, action="append", default=[], metavar="ATTRIBUTE=V1,V2",
                     help="only items with one of these values, e.g. category=skin,makeup (repeatable: all apply)")
    rec.add_argument("--deny", type=_values, action="append", default=[], metavar="ATTRIBUTE=V1,V2",
                     help="never items with one of these values (repeatable)")
    rec.add_argument("--boost", type=_boost, action="append", default=[], metavar="ATTRIBUTE=VALUE:WEIGHT",
                     help="add WEIGHT (log-probability units) to the score of items with the value, e.g. "
                          "brand=olay:0.5 (repeatable)")

    record = sub.add_parser("record", parents=[common], help="append interactions to a user's history")
    record.add_argument("--user", required=True)
    given = record.add_mutually_exclusive_group(required=True)
    given.add_argument("--items", "--history", dest="items", type=_ids, default=[], help="item ids 1,2,3")
    given.add_argument("--item-keys", type=_keys, default=[], metavar="KEY,KEY", help="item keys B00ABC,B00DEF")

    hist = sub.add_parser("history", parents=[common], help="a user's stored history")
    hist.add_argument("--user", required=True)

    sub.add_parser("health", parents=[common], help="health status of the server")
    p.set_defaults(func=run_client)


def run_client(args: argparse.Namespace) -> int:
    import grpc

    from recsvc.client.client import RecClient, response_to_dict, rules_message
    from recsvc.service.rpc.security import api_key_from

    from .sticky import StickyClient

    options = {"api_key": api_key_from(args.api_key), "tls_ca": args.tls_ca, "server_name": args.tls_server_name,
               "timeout_s": args.timeout}
    try:
        client = StickyClient(args.target, **options) if args.routing == "sticky" else RecClient(args.target, **options)
    except ValueError as exc:
        raise UserError(f"--target: {exc}") from None
    try:
        if args.client_command == "recommend":
            out = response_to_dict(
                client.recommend(
                    args.user,
                    history=args.history,
                    k=args.k,
                    mode=args.mode,
                    exclude_items=args.exclude,
                    history_keys=args.history_keys,
                    exclude_keys=args.exclude_keys,
                    exclude_history=args.exclude_history,
                    temperature=args.temperature,
                    seed=args.seed,
                    rules=rules_message(args.max_per, args.allow, args.deny, args.boost)
                    if args.max_per or args.allow or args.deny or args.boost else None,
                )
            )
        elif args.client_command == "record":
            out = {"user_id": args.user,
                   "history_length": client.record(args.user, args.items, item_keys=args.item_keys)}
        elif args.client_command == "history":
            reply = client.get_history(args.user)
            out = {"user_id": args.user, "item_ids": list(reply.item_ids),
                   **({"item_keys": list(reply.item_keys)} if reply.item_keys else {})}
        elif args.client_command == "health":  # sticky: one status per server
            out = {"status": client.health()}
        else:  # argparse guarantees one of the above
            raise UserError(f"unknown client action {args.client_command!r}")
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = exc.details() if hasattr(exc, "details") else str(exc)
        print(f"error: {code.name}: {details}", file=sys.stderr)
        return EXIT_INVALID if code == grpc.StatusCode.INVALID_ARGUMENT else EXIT_OTHER
    finally:
        client.close()
    print(json.dumps(out, indent=2))
    return 0
