"""Whether mode/method ``"auto"`` should detect the per-sample pattern at all: decided first.

``"auto"`` detects the per-sample pattern only to save passes: it takes a sparse plan when that
needs at most :data:`~divjac._core.plan.SPARSE_GAIN` of the dense passes. A detection labels
every input element and costs, on the benchmark models, from 11 to 200 batched passes (see
:data:`FEW_PASSES`; ``bench_first_call``); on a dense model it is paid in vain at every new
shape. :func:`screen` decides before it, in two ways:

* **Few dense passes.** With at most :data:`FEW_PASSES` dense passes (a 10-class classifier's
  10 reverse passes, a divergence in 2 to 16 dimensions), a sparse plan saves at most
  ``FEW_PASSES - 1`` passes a call, fewer than a detection costs (see :data:`FEW_PASSES`): the
  first call cannot gain, and the later ones can gain only a few cheap passes.
* **Dense on a few probes.** :data:`PROBES` input positions, evenly spread over the sample (the
  same in every sample), each get one label, and the program is propagated with those labels
  only: an element holds at most ``PROBES`` of them, so it costs about what the coupling check
  costs, and far less than a detection with ``n`` labels. The propagation stops at the first
  intermediate whose elements depend, on average, on more than :data:`DENSE` of the probes: a
  dense layer over the sample, a reduction of it (a global pool, a normalization over its
  positions), attention over all positions. If the per-sample Jacobian's mean row holds more
  than a fraction ``r`` of the inputs, some row holds at least ``r * n_in`` (a column coloring
  needs that many colors) and some column holds at least ``r * n_out`` (so does a row
  coloring): with ``r > SPARSE_GAIN`` no sparse plan is taken. For the diagonal coloring of a
  divergence the same holds where the dense part is made of dense blocks, the shape of a dense
  network's Jacobian. The probes estimate ``r`` from ``PROBES`` columns, and an intermediate
  stands for the output: a dense intermediate makes what follows it dense, unless the program
  then drops most of it. A wrong verdict only costs speed (dense passes, the same values).

Neither way skips the coupling check: the caller then checks coupling alone (one label per
sample, cheap), so a function that mixes samples is refused whatever the screening says.
A verdict of "dense" is cached with the traced program's detections (see :func:`screen`).
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import numpy as np

from .._errors import DenseFallbackWarning
from . import rules
from .detection import EntryLimit, TooDense, Traced
from .plan import SPARSE_GAIN

__all__ = ["DENSE", "FEW_PASSES", "PROBES", "Verdict", "screen"]

FEW_PASSES = 16
"""Dense pass counts at or below which ``"auto"`` never detects the per-sample pattern.

A per-sample detection costs, counted in batched passes of the same call, from about ten
passes (a small classifier or MLP) to a few hundred (a CNN); ``bench_first_call`` holds the
measurements. So with at most 16 dense passes the sparse plan saves at most 15 passes a call,
about what the detection costs at the least: it cannot pay on the first call, and saves little
on later ones.
"""

PROBES = 16
"""Input positions labelled by the probe of :func:`screen` (a sixteenth of a label per element
of a convolutional network, on average: the probe costs about what the coupling check costs)."""

DENSE = SPARSE_GAIN
"""Mean fraction of the probes an intermediate's elements depend on beyond which the pattern
is taken as dense: past it, no coloring can take :data:`~divjac._core.plan.SPARSE_GAIN` of the
dense passes or fewer."""

# The ``max_entries`` of a screening's verdict "dense" in ``Traced.detections``: a per-sample
# detection abandoned at once (``None``), which ``Traced.detect`` never returns.
_SCREENED = 0


class Verdict(NamedTuple):
    """What :func:`screen` decided.

    Attributes:
        detect: detect the per-sample pattern (it may pay off).
        reason: why not, when not (for ``divjac inspect``).
    """

    detect: bool
    reason: str = ""


def screen(traced: Traced, dense_passes: int) -> Verdict:
    """Whether ``"auto"`` should detect the per-sample pattern of ``traced``, whose dense plan
    takes ``dense_passes`` passes (``min(n_in, n_out)`` for a Jacobian, ``n`` for a divergence).

    A detection already made (completed, or abandoned as too dense) is reused rather than
    screened. A verdict of "dense" is kept in ``traced.detections`` under the per-sample key of
    a detection abandoned at once, so that later calls of the same program skip the probe.
    """
    if dense_passes <= FEW_PASSES:
        return Verdict(
            detect=False, reason=f"{dense_passes} dense passes: too few for detection to pay off"
        )
    generation = rules.generation()
    detections = traced.detections
    if any(
        gen == generation and per_sample and not whole_batch and limit != _SCREENED
        for gen, per_sample, whole_batch, limit in detections
    ):
        return Verdict(detect=True)
    key = (generation, True, False, _SCREENED)
    if key not in detections:
        if not _dense_on_probes(traced):
            return Verdict(detect=True)
        detections[key] = None
    return Verdict(
        detect=False, reason=f"dense on {PROBES} probed inputs: no coloring would save passes"
    )


def _dense_on_probes(traced: Traced) -> bool:
    """Whether the program, seeded with :data:`PROBES` evenly spread input positions of each
    sample, makes an intermediate (or its output) depend on more than :data:`DENSE` of them on
    average (past the detection's memory budget: not dense, the detection will tell)."""
    x_shape = traced.x_shape
    n = math.prod(x_shape[1:])
    positions = np.unique(np.linspace(0, n - 1, min(PROBES, n)).round().astype(np.int64))
    k = len(positions)
    labels = np.full(n, -1, np.int64)
    labels[positions] = np.arange(k)
    # Seeded like a detection (with the sample labels, held once for all samples), so the
    # probe costs one sample whatever the batch: an element may hold k + 1 labels.
    seeded = rules.from_samples(x_shape, x_shape[0], labels, k)
    try:
        with warnings.catch_warnings():  # the detection or the coupling check warns, not this
            warnings.simplefilter("ignore", DenseFallbackWarning)
            out = traced._propagate(seeded, EntryLimit(0, k + 1, density=DENSE)).out
    except TooDense as stop:
        # Past the memory budget the probe proves nothing: the detection then stops too, and
        # says so (never a silent dense plan).
        return not stop.memory
    return out.nnz > DENSE * out.size * (k + 1)
