"""Heterogeneous memory (PatrickStar, Gemini, Elixir): train state that lives in host
memory between steps and moves to the device for the layers that use it.

``OffloadOptions`` is a resolved plan, part of the ``Execution`` a step is traced under
(it changes the program, so it is defined beside ``Execution`` in ``jaxpar.placement``).
How a step fetches host-resident layers (``fetch``), where the state lives between
steps and where the optimizer update runs (``state``), how saved activations go to the
host, and how ``auto`` chooses a plan under a device budget live in the modules beside
this one. ``jaxpar.train.step.make_train_step(..., offload=OffloadOptions(...))`` builds
a step under a plan.
"""

from jaxpar.placement.execution import OffloadOptions

__all__ = ["OffloadOptions"]
