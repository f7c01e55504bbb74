"""The conceptual diagrams draw the rules the code follows (benchmarks/diagrams.py):
the ring's chunk schedule ends where chapter 2 says, the zigzag owners are the library's
split, and the mesh's numbering is Topology's."""

import importlib.util

import pytest

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("diagrams", REPO / "benchmarks/diagrams.py")
diagrams = importlib.util.module_from_spec(spec)
spec.loader.exec_module(diagrams)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_the_ring_leaves_rank_r_one_whole_chunk_then_every_chunk(n):
    states, sends = diagrams.ring_states(n)
    assert len(sends) == 2 * (n - 1) and len(states) == 2 * n - 1
    after_reduce_scatter = states[n - 1]
    for r in range(n):
        whole = [c for c in range(n) if after_reduce_scatter[r][c] == set(range(n))]
        assert whole == [(r + 1) % n]
    assert all(chunk == set(range(n)) for row in states[-1] for chunk in row)
    assert all(len(moves) == n for _, _, moves in sends)      # every rank sends one chunk a step


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_zigzag_owners_are_rank_r_and_its_mirror(cp):
    assert diagrams.zigzag_owner(cp) == [min(b, 2 * cp - 1 - b) for b in range(2 * cp)]


def test_the_mesh_numbering_is_the_topologys():
    """rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank, chapter 2's formula."""
    tp, cp, dp, pp = 2, 2, 2, 2
    ranks = sorted(diagrams.mesh_rank(t, c, d, p, tp, cp, dp) for t in range(tp) for c in range(cp)
                   for d in range(dp) for p in range(pp))
    assert ranks == list(range(16))
    for t, c, d, p in [(1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (1, 1, 1, 1)]:
        assert diagrams.mesh_rank(t, c, d, p, tp, cp, dp) == ((p * dp + d) * cp + c) * tp + t
