"""The user's mistakes, one type for every package: the CLI turns a ``UserError`` into exit code 2, the service
into INVALID_ARGUMENT (``recsvc.errors`` adds the service's ``InvalidRequest``)."""


class UserError(Exception):
    """A mistake in what the user gave us (missing file, wrong format, bad flag value).

    The CLI prints ``error: <message>`` and exits with code 2; it never shows a traceback for these.
    """
