"""User-facing errors: raised for bad input, turned into exit code 2 (CLI) or INVALID_ARGUMENT (gRPC).

``UserError`` is defined below every package (``recsvc_base.errors``: the item tokenizer raises it too) and is the
same class here; ``InvalidRequest`` is the service's."""

from recsvc_base.errors import UserError

__all__ = ["InvalidRequest", "UserError"]


class InvalidRequest(UserError):
    """A request the client must fix (an RPC's arguments); the service answers INVALID_ARGUMENT."""
