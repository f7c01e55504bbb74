"""Failures that only some ranks see, turned into the same error on every rank."""

from numpitron.errors import UserError


def on_every_rank(comm, attempt):
    """Run attempt() on every rank of comm; if it fails on any, it fails on all.

    The checks are deterministic, so normally every rank fails alike; this agreement
    covers the rest (a file only one stage reads, an I/O error on one host), so that
    one rank's failure never leaves the others waiting in the next collective.
    """
    error = None
    try:
        result = attempt()
    except Exception as caught:   # noqa: BLE001 -- re-raised below, on this rank and the others
        error = caught
    # The lowest failing rank speaks for all: encode it so that MAX finds it.
    code = comm.all_reduce_object_max(comm.size - comm.rank if error is not None else 0)
    if code == 0:
        return result
    speaker = comm.size - code
    told = comm.broadcast_object((isinstance(error, UserError), str(error)) if comm.rank == speaker else None,
                                 root=speaker)
    if error is not None:
        raise error
    is_user_error, message = told
    raise UserError(message if is_user_error else f"failed on rank {speaker}: {message}")
