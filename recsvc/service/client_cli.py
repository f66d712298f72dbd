"""``recsvc client recommend|record|history|health``: talks to a running service and prints JSON.

gRPC errors print ``error: CODE: details`` on stderr (never a traceback) and exit with 2 for
INVALID_ARGUMENT, 1 for any other status.
"""

from __future__ import annotations

import argparse
import json
import sys

from recsvc.errors import UserError

EXIT_INVALID = 2
EXIT_OTHER = 1


def _ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("client", help="call a running recommendation service", description=__doc__)
    sub = p.add_subparsers(dest="client_command", metavar="ACTION", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default="127.0.0.1:50051",
                        help="host:port, several as IP:port,IP:port, or a gRPC URI (dns:///name:port, ipv4:...): "
                             "round_robin over the servers, UNAVAILABLE retried (default: %(default)s)")
    common.add_argument("--api-key", help="sent as x-api-key (default: $RECSVC_API_KEY)")
    common.add_argument("--tls-ca", help="PEM CA certificate (enables TLS)")
    common.add_argument("--tls-server-name", help="expected server name in its certificate")
    common.add_argument("--timeout", type=float, default=10.0, help="seconds (default: %(default)s)")

    rec = sub.add_parser("recommend", parents=[common], help="top-k items for a user")
    rec.add_argument("--user", required=True)
    rec.add_argument("--history", type=_ids, default=[], help="inline history 1,2,3 (default: stored)")
    rec.add_argument("--k", type=int)
    rec.add_argument("--mode", choices=("default", "strict", "relaxed", "plain"), default="default")
    rec.add_argument("--exclude", type=_ids, default=[], help="item ids never returned")
    rec.add_argument("--exclude-history", action="store_true", help="do not recommend history items")
    rec.add_argument("--temperature", type=float)
    rec.add_argument("--seed", type=int)

    record = sub.add_parser("record", parents=[common], help="append interactions to a user's history")
    record.add_argument("--user", required=True)
    record.add_argument("--items", "--history", dest="items", type=_ids, required=True, help="item ids 1,2,3")

    hist = sub.add_parser("history", parents=[common], help="a user's stored history")
    hist.add_argument("--user", required=True)

    sub.add_parser("health", parents=[common], help="health status of the server")
    p.set_defaults(func=run_client)


def run_client(args: argparse.Namespace) -> int:
    import grpc

    from .client import RecClient, response_to_dict
    from .security import api_key_from

    try:
        client = RecClient(
            args.target,
            api_key=api_key_from(args.api_key),
            tls_ca=args.tls_ca,
            server_name=args.tls_server_name,
            timeout_s=args.timeout,
        )
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
                    exclude_history=args.exclude_history,
                    temperature=args.temperature,
                    seed=args.seed,
                )
            )
        elif args.client_command == "record":
            out = {"user_id": args.user, "history_length": client.record(args.user, args.items)}
        elif args.client_command == "history":
            out = {"user_id": args.user, "item_ids": client.history(args.user)}
        elif args.client_command == "health":
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
