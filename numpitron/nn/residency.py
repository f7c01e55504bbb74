"""Where a stage's parameters live while a pass runs.

Normally every rank holds its whole stage, so there is nothing to do: this class.
ZeRO-3 (data_parallel/zero3.py) keeps only a 1/dp slice and replaces it with one that
gathers each layer's parameters just before the layer runs and frees them after.
The stage calls the same four hooks either way (one code path):

    before_forward(i)   after_forward(i)   before_backward(i)   after_backward(i)

with i the layer's index in GPTStage.layers.
"""


class AlwaysResident:
    def before_forward(self, index: int) -> None:
        pass

    def after_forward(self, index: int) -> None:
        pass

    def before_backward(self, index: int) -> None:
        pass

    def after_backward(self, index: int) -> None:
        pass
