"""The sparse MLP over kept neurons (Deja Vu §4.4, Appendix E): :mod:`.up` (the kept rows of
W1, or gate and up, with the activation), :mod:`.down` (the kept rows of W2 stored transposed) and
:mod:`.fused` (up and activation in one launch, then down)."""
