"""The one exception type that means "the user gave us something we cannot use".

Command-line entry points print its message as a single line (from one rank) and
exit non-zero on every rank; anything else is a bug and gets a traceback.
"""


class UserError(Exception):
    """Bad configuration, missing or corrupt data/checkpoint: a one-line message."""
