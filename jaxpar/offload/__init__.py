"""Heterogeneous memory (PatrickStar, Gemini, Elixir): train state that lives in host
memory between steps and moves to the device for the layers that use it.

``OffloadOptions`` is a resolved plan, part of the ``Execution`` a step is traced under
(it changes the program, so it is defined beside ``Execution`` in ``jaxpar.placement``).
How a step fetches host-resident layers (``fetch``), where the state lives between
steps and where the optimizer update runs (``state``), and how saved activations go to
the host (``activations``) live in the modules beside this one;
``jaxpar.train.step.make_train_step(..., offload=OffloadOptions(...))`` builds a step
under a plan. ``plan(...)`` (``planner``) chooses one under a device budget from the
compile-only profile and says what it costs, from a state's bytes per device
(``accounting``); ``parse_bytes`` reads budgets such as
``"6GiB"`` (``budget``).
"""

from jaxpar.offload.budget import format_bytes, parse_bytes
from jaxpar.offload.planner import Plan, PlanError, plan
from jaxpar.placement.execution import OffloadOptions

__all__ = ["OffloadOptions", "Plan", "PlanError", "format_bytes", "parse_bytes", "plan"]
