"""AdaScale's learning-rate gain for a job whose global batch changes
(``optimizer.batch_scaling=adascale``; Johnson et al., "AdaScale SGD", ICML 2020, as
Pollux's AdaptDL applies it to Adam).

At ``scale = batch / base`` (``base``: the run's first global batch), a step's gradient
has ``sigma^2 / scale`` of the base batch's variance ``sigma^2`` about the true gradient
``mu``, so it is worth

    gain = (sigma^2 + |mu|^2) / (sigma^2 / scale + |mu|^2),   between 1 and scale,

base-batch steps: ``scale`` where noise dominates, 1 where the gradient does. The
schedule then runs on that progress rather than on the step count (``progress += gain``
each step, the learning rate read at ``schedule(progress)``), and the step's rate is
multiplied by ``gain ** power``: 1 for SGD (AdaScale's), 1/2 for Adam-like optimizers
(AdaptDL's ``AdamScale``, whose default this is: an Adam step's size does not grow
with the gradient's).

``sigma^2`` and ``|mu|^2`` come from the gradient noise scale's two estimates
(``simple_estimates``, McCandlish et al.): ``sigma^2 = S / base`` and ``|mu|^2 = G2``,
each smoothed by an exponential moving average in the optimizer's state, so that a
resized run resumes with its estimates. A step without the norms (one data replica)
keeps the averages and uses them as they are.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

DECAY = 0.9  # the averages' decay: about ten steps' memory, as the logged noise scale's
POWER = 0.5  # Adam's (AdaptDL's AdamScale); 1 is AdaScale's for SGD


def simple_estimates(small_sq, big_sq, b_small, b_big):
    """``(|G|^2, S)``: the unbiased estimates of the true gradient's squared norm and of
    ``tr(Sigma)`` (per sample) from the squared norms of gradients over ``b_small`` and
    ``b_big`` samples (floats or arrays; sizes checked where they are known, not traced)."""
    if not isinstance(b_small, jax.core.Tracer) and not 0 < b_small < b_big:
        raise ValueError(f"the batch sizes must satisfy 0 < b_small < b_big; got {b_small}, {b_big}")
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
    return g2, trace


def gain(g2, trace, base: float, batch: float):
    """AdaScale's gain at global batch ``batch`` for base batch ``base``, from ``|G|^2``
    and ``tr(Sigma)`` (or their averages: the gain is their ratio's), clamped as AdaptDL
    does (the variance at least 1e-6, the squared norm at least 0)."""
    var = jnp.maximum(trace / base, 1e-6)
    sqr = jnp.maximum(g2, 0.0)
    return (var + sqr) / (var * base / batch + sqr)


class AdaScaleState(NamedTuple):
    g2: jax.Array  # the average of |G|^2 (from zero: the ratio needs no bias correction)
    trace: jax.Array  # the average of tr(Sigma)
    progress: jax.Array  # base-batch steps so far: where the schedule is read
    gain: jax.Array  # the last step's gain (logged)
    rate: jax.Array  # the last step's learning rate, schedule(progress) * gain ** power (logged)


def scale_by_adascale(schedule: optax.Schedule, *, base: int, batch: int, replicas: int,
                      decay: float = DECAY, power: float = POWER) -> optax.GradientTransformationExtraArgs:
    """Multiplies the updates by ``-schedule(progress) * gain ** power`` (in place of
    ``optax.scale_by_learning_rate``); ``update`` takes the step's ``grad_sq_small`` (the
    mean over the ``replicas`` data replicas of each one's squared gradient norm) and
    ``grad_sq_big`` (the batch gradient's) as extra arguments. With ``batch == base``
    the gain is exactly 1 and this is ``scale_by_learning_rate(schedule)``. A step that
    knows the small batch its norms measure passes it too (``batch_small``: unequal
    replicas' rows, ``jaxpar.train.gradients``); else it is ``batch / replicas``."""
    b_small = batch / replicas

    def init(params):
        del params
        zero = jnp.zeros((), jnp.float32)
        return AdaScaleState(zero, zero, zero, jnp.ones((), jnp.float32), zero)

    def update(updates, state, params=None, *, grad_sq_small=None, grad_sq_big=None, batch_small=None, **extra):
        del params, extra
        g2, trace = state.g2, state.trace
        if grad_sq_small is not None and replicas > 1:
            small = b_small if batch_small is None else batch_small
            step_g2, step_trace = simple_estimates(grad_sq_small, grad_sq_big, small, batch)
            g2 = decay * g2 + (1 - decay) * step_g2
            trace = decay * trace + (1 - decay) * step_trace
        # before any estimate (both averages 0) the clamps give var 1e-6, sqr 0: the gain
        # is then the whole scale; with batch == base it is 1 whatever the averages.
        r = jnp.ones((), jnp.float32) if batch == base else gain(g2, trace, base, batch).astype(jnp.float32)
        rate = schedule(state.progress) * r ** power
        updates = jax.tree.map(lambda u: -rate * u, updates)
        return updates, AdaScaleState(g2, trace, state.progress + r, r, jnp.asarray(rate, jnp.float32))

    return optax.GradientTransformationExtraArgs(init, update)


def state_of(opt_state) -> AdaScaleState | None:
    """The ``AdaScaleState`` within an optimizer's state (None without one)."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, AdaScaleState))
             if isinstance(s, AdaScaleState)]
    return found[0] if found else None
