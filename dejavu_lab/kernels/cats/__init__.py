"""CATS (Lee et al. 2024): a dense gate, then the up and down rows of the neurons whose
``|act(gate)|`` passes the threshold: :mod:`.mlp` (the whole MLP), :mod:`.up` (the thresholded up
rows) and :mod:`.sums` (one token's gate as split-K sums left in a workspace)."""
