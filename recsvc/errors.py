"""User-facing errors: raised for bad input, turned into exit code 2 (CLI) or INVALID_ARGUMENT (gRPC)."""


class UserError(Exception):
    """A mistake in what the user gave us (missing file, wrong format, bad flag value).

    The CLI prints ``error: <message>`` and exits with code 2; it never shows a traceback for these.
    """


class InvalidRequest(UserError):
    """A request the client must fix (an RPC's arguments); the service answers INVALID_ARGUMENT."""
