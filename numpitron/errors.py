"""The one exception type that means "the user gave us something we cannot use".

Command-line entry points print its message as a single line (from one rank) and
exit non-zero on every rank; anything else is a bug and gets a traceback.
"""

import sys


class UserError(Exception):
    """Bad configuration, missing or corrupt data/checkpoint: a one-line message."""


def exit_with_one_line(main) -> None:
    """Run a one-process command's main(): a UserError becomes one line on stderr and
    exit status 1 (MPI programs use distributed.launch.run_main instead)."""
    try:
        sys.exit(main())
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
