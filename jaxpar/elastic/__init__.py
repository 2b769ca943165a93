"""Elastic scheduling of a shared cluster (issue 40: ONES and its baselines).

``jobs``: a job's model, its throughput as a function of devices and batch size and its
statistical efficiency as a function of batch size (from the gradient noise scale);
their product is goodput. ``scheduler``: the one interface every scheduler implements
(each decision: for every running or waiting job, its devices and batch size).
``baselines``: FIFO, SRTF, Tiresias and the registry by name; ``pollux``: Pollux's
goodput fitness solved exactly; ``ones``: ONES' online evolutionary search
(``goodput_table``: both read goodput from one cached table). ``traces``: Philly and
PAI readers and the synthetic generator; ``simulator``: the SimPy discrete-event
simulation. ``adascale``: AdaScale's learning-rate gain for a resized job, an optax
transformation (the one module here that imports JAX, and ``__init__`` does not load it:
a simulation runs anywhere).
"""

from jaxpar.elastic.jobs import JobModel, SpeedModel
from jaxpar.elastic.scheduler import Allocation, JobView, Scheduler

__all__ = ["Allocation", "JobModel", "JobView", "Scheduler", "SpeedModel"]
