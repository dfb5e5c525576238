""":mod:`divjac.jax`'s binding of the public transforms (:mod:`divjac._public`): JAX's backend,
and how JAX runs a transform.

Called outside ``jax.jit``, a transform runs as one cached compiled program
(:mod:`divjac.jax._eager`, keyed by the transform, its constant options and the function); JAX's
failures to differentiate a ``custom_jvp`` rule are named (:mod:`divjac.jax._refusals`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._core import stochastic
from .._divergence import is_probes
from .._public import Api
from . import _detect, _eager
from ._backend import BACKEND
from ._refusals import leaked_tracers_refused

__all__ = ["API", "clear_caches"]


class JaxApi(Api[jax.Array]):
    """The public transforms on JAX arrays."""

    framework = "JAX"
    module = "divjac.jax"
    array = "jax.Array"
    array_type = jax.Array

    def transform(
        self,
        make: Callable[..., Callable[..., Any]],
        f: Any,
        *positional: Any,
        skip: int,
        cached: bool,
        **options: Any,
    ) -> Callable[..., Any]:
        if not cached:  # traced where it is called (inside the caller's jax.jit)
            return make(BACKEND, f, *positional, **options)
        call = _eager.compiled_when_eager(
            lambda g: make(BACKEND, g, *positional, **options),
            f,
            (make.__name__, positional, tuple(sorted(options.items()))),
            skip=skip,
            functional=BACKEND.functional,
            randomness=lambda r: BACKEND.is_randomness(r) or is_probes(BACKEND, r),
        )
        return leaked_tracers_refused(make.__name__)(call)  # a context, used as a decorator

    def detect(
        self, make: Callable[..., Callable[..., Any]], f: Any, *positional: Any, **options: Any
    ) -> Callable[..., Any]:
        return make(BACKEND, f, *positional, **options)


API = JaxApi()


def clear_caches() -> None:
    """Drop every trace, detection and compiled eager call that ``divjac.jax`` has cached.

    Never needed for correct results: a cached detection is reused only when the traced
    program and everything it read are unchanged (see ``docs/how-it-works.md``, "Caching").
    Use it to free memory, or to time a first call.
    """
    _detect.CACHE.clear()
    _eager.CACHE.clear()
    _eager.VARYING.clear()
    stochastic.clear_plans()
