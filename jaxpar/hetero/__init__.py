"""Training on unequal hardware (issue 39): devices of unequal speed and memory.

``allocation``: Sky Computing's uneven pipeline stages, the contiguous layer ranges per
pipeline rank that minimise the slowest stage's time within each rank's memory.
``adasum``: Adasum's pairwise combination of replicas' gradients (on stacked
gradients). ``compression``: one replica's thresholded sparsification with error
feedback, an optax transformation. ``reduction``: both as collectives over a mesh's
``data`` axis inside the train step (``make_train_step(..., reduction=Reduction(...))``):
Adasum by recursive doubling, and DCT's top-k exchange of only the kept entries, its
residuals carried per replica in the optimizer state.
"""

from jaxpar.hetero import adasum, compression
from jaxpar.hetero.allocation import allocate, even_split, stage_times

__all__ = ["adasum", "allocate", "compression", "even_split", "stage_times"]
