"""Elastic scheduling of a shared cluster (issue 40: ONES and its baselines).

``jobs``: a job's model, its throughput as a function of devices and batch size and its
statistical efficiency as a function of batch size (from the gradient noise scale);
their product is goodput. ``scheduler``: the one interface every scheduler implements
(each decision: for every running or waiting job, its devices and batch size). The
schedulers, the trace readers and the discrete-event simulator build on these two.
Nothing here imports JAX: a simulation runs anywhere.
"""

from jaxpar.elastic.jobs import JobModel, SpeedModel
from jaxpar.elastic.scheduler import Allocation, JobView, Scheduler

__all__ = ["Allocation", "JobModel", "JobView", "Scheduler", "SpeedModel"]
