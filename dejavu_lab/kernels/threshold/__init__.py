"""Input-sparse GEMVs with the mask ``|x| > thr`` computed inside (TEAL, WINA, CATS's down step):
:mod:`.gemv` (the compacting kernel and the wrapper), :mod:`.tile` (one masked tile per program)
and :mod:`.fused` (the tile kernel joined to the decode step's activation and epilogues);
:mod:`.lowrank` adds R-Sparse's low-rank term for the entries the threshold drops."""
