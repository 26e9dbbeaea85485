"""The one exception type for mistakes a user can make (bad path, bad option, corrupt file)."""


class LeanLMError(Exception):
    """A user-facing error: the CLI prints its message on one line, without a traceback."""
