"""Built-in example models used by ``divjac demo``, the benchmarks, the examples and the tests.

:mod:`divjac.models.jax` and :mod:`divjac.models.torch` define the same architectures, so the
same weights give the same functions in both frameworks.
"""
