"""Training on unequal hardware (issue 39): devices of unequal speed and memory.

``allocation``: Sky Computing's uneven pipeline stages, the contiguous layer ranges per
pipeline rank that minimise the slowest stage's time within each rank's memory.
``adasum``: Adasum's pairwise combination of replicas' gradients (so far on stacked
gradients; the reduction over a mesh's data axes is to come). ``compression``: one
replica's thresholded sparsification with error feedback, an optax transformation (the
exchange of only the kept entries is to come).
"""

from jaxpar.hetero import adasum, compression
from jaxpar.hetero.allocation import allocate, even_split, stage_times

__all__ = ["adasum", "allocate", "compression", "even_split", "stage_times"]
