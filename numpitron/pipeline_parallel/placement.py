"""Which pipeline rank, and which of its chunks, holds each virtual stage.

A pipeline of p ranks with v chunks each runs p*v virtual stages in order: the
activations of a micro-batch go from virtual stage j to j + 1, its gradients back.
Two placements of the stages on the ranks:

  loop (interleaved 1F1B, Narayanan et al. 2021, §2.2.2): chunk c of rank r is
      virtual stage c*p + r. A micro-batch goes round the ring of ranks v times, and
      the last virtual stage is on rank p - 1.
  V (ZB-V, Qi et al. 2024; DualPipeV): the even chunks run down the ranks, the odd
      ones back up: chunk c of rank r is c*p + r for even c and c*p + p - 1 - r for
      odd c. With v = 2, rank r holds virtual stages r and 2p - 1 - r, so the first
      and the last both live on rank 0, and at the bottom of the V (stage p - 1 to
      p, both on rank p - 1) the activations stay on their rank.

The model asks `stage` which layers a chunk holds; the executor and the schedule
simulator ask `holder` where the neighbour of a virtual stage lives.
"""

from typing import NamedTuple


class StagePlacement(NamedTuple):
    p: int                  # pipeline ranks
    v: int = 1              # chunks per rank
    v_shape: bool = False   # the V placement instead of the loop

    @property
    def stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage that chunk `chunk` of pipeline rank `rank` holds."""
        going_up = self.v_shape and chunk % 2 == 1
        return chunk * self.p + (self.p - 1 - rank if going_up else rank)

    def holder(self, stage: int) -> tuple[int, int]:
        """(pipeline rank, chunk) holding virtual stage `stage`."""
        chunk, offset = divmod(stage, self.p)
        going_up = self.v_shape and chunk % 2 == 1
        return (self.p - 1 - offset if going_up else offset), chunk

    def rank_of(self, stage: int) -> int:
        return self.holder(stage)[0]
