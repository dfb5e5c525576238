"""Stochastic Lanczos quadrature for ``log|det J|`` (Ubaru, Chen & Saad 2017).

``log|det J| = tr log(J^T J) / 2``, and for a probe ``v`` with ``E[v v^T] = I``,
``E[v^T log(A) v] = tr log(A)`` (Hutchinson). ``v^T log(A) v`` is approximated by the Gauss
quadrature of ``m`` Lanczos steps on ``A = J^T J`` started at ``v / ||v||``: with the tridiagonal
``T_m = U diag(theta) U^T``, ``v^T log(A) v ~ ||v||^2 sum_i U_0i^2 log(theta_i)``, exact for
polynomials of degree ``2m - 1`` (and exact when ``m = n``). Each Lanczos step is one product
with ``A``: one JVP and one VJP of the batched function.

The standard error adds the quadrature's error to the probes': below ``n`` steps, the Gauss
rule of ``m`` nodes overestimates ``v^T log(A) v`` (the derivatives of ``log`` of even order
are negative), slowly where ``A`` is ill-conditioned (its smallest eigenvalues are found
last), and that bias does not shrink with more probes. Its size is estimated from the same
tridiagonal matrix, without another product, by the Gauss rule of ``floor(m / 2)`` nodes (its
leading block): twice the gap ``|G_floor(m/2) - G_m|`` per probe bounds ``G_m``'s own error
where that error falls like ``m^-p`` with ``p >= 0.59`` (``2 (2^p - 1) >= 1``; measured
``p ~ 1`` on the ill-conditioned Jacobians of networks, where the gap alone fell short at 8-16
steps), and overshoots it where it falls faster (then it is small anyway). The mean of the
gaps over the probes, ``b`` (in the terms' units), is added to the stderr, so that
``estimate +- 2 stderr`` is the probes' interval widened by ``2 b`` on each side. No estimate can
see an eigenvalue that the Krylov space has not approached at all (an isolated tiny singular
value found only after ``m`` steps), and at a few steps the bias has not started to fall
steadily: below :data:`MIN_GAUGED_STEPS` steps (and ``n``) no standard error is given (``J``
with log-spaced singular values of condition 500, 1e4 and 1e6, ``n = 32``, 32 probes: coverage
0.62, 0.00 and 0.25 at 4, 4 and 8 steps, 0.97-1.00 from 5, 8 and 12 steps: a bar at 8 steps
still falls short where ``J`` is that ill-conditioned); ``lanczos_steps = n`` is exact.

Written with the array API, batched over samples and probes, with full reorthogonalization
(``m`` is small): every step is differentiable, so the gradient of the estimate is that of the
computed quantity. A Lanczos breakdown (an invariant Krylov subspace, e.g. ``J = c I``) ends
the recurrence exactly: the remaining steps add decoupled entries of zero weight.

References:
    - Ubaru, Chen & Saad (2017), "Fast estimation of tr(f(A)) via stochastic Lanczos
      quadrature", SIAM Journal on Matrix Analysis and Applications 38(4).
    - Golub & Meurant (2010), "Matrices, Moments and Quadrature with Applications".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

from ..._errors import NumProbesError
from ._common import (
    Array,
    Matvec,
    apply,
    check_probes,
    device,
    mean_and_stderr,
    namespace,
)

__all__ = ["DEFAULT_LANCZOS_STEPS", "MIN_GAUGED_STEPS", "default_lanczos_steps", "slq_log_abs_det"]

DEFAULT_LANCZOS_STEPS = 30
"""Lanczos steps per probe when the caller names none (fewer when ``n`` is smaller)."""

MIN_GAUGED_STEPS = 8
"""Lanczos steps below ``n`` from which a standard error is given (see the module docstring)."""

_DEAD, _GOLDEN = 0.5772156649015329, 1.618033988749895
"""The entries of dead Lanczos steps: ``_DEAD + j * _GOLDEN`` (unlikely eigenvalues)."""


Loop: TypeAlias = Callable[[int, Callable[[Any, Any], Any], Any], Any]
"""``loop(n, body, carry)``: ``carry = body(j, carry)`` for ``j = 0 .. n - 1`` (a framework's
loop, :attr:`divjac._backend.Backend.fori_loop`; ``j`` may then be an array)."""


def default_lanczos_steps(n: int) -> int:
    """The default number of Lanczos steps at dimension ``n``: ``min(n, 30)``."""
    return min(n, DEFAULT_LANCZOS_STEPS)


def slq_log_abs_det(
    gram_matvec: Matvec,
    probes: Array,
    num_steps: int,
    *,
    stderr: bool = True,
    loop: Loop | None = None,
) -> tuple[Array, Array | None]:
    """``log|det J_b|`` per sample by stochastic Lanczos quadrature on ``A_b = J_b^T J_b``.

    Args:
        gram_matvec: Batched matvec of the Gram matrices, ``(B, n, k) -> (B, n, k)``,
            ``W[b] = J_b^T J_b V[b]``.
        probes: The probes ``(B, n, k)`` with ``E[v v^T] = I``; one Lanczos run each.
        num_steps: Lanczos steps per probe, ``1 <= num_steps <= n``.
        stderr: Also return the standard error (needs ``k >= 2`` probes, and
            ``num_steps >= 2`` below ``n``).
        loop: The loop of the Lanczos steps (:data:`Loop`; ``None``: Python's): a framework's
            (``lax.fori_loop``) traces one step, whatever ``num_steps``; Python's lets the
            basis grow by a row per step, so that a step's products cost the rows found so far.

    Returns:
        ``(estimate, stderr)`` of shape ``(B,)`` (``stderr`` ``None`` unless asked for): the
        mean of the ``k`` quadrature terms and its standard error: Hutchinson's
        (:func:`~._common.mean_and_stderr`) for ``B = log(A) / 2`` with the images ``B v``
        approximated by Lanczos (``||v|| Q_m log(T_m) e_1 / 2``, no extra product), the
        probes' randomness, plus the gauge ``b`` of the quadrature's bias below ``n`` steps
        (the module's docstring): ``+- 2 stderr`` spans ``+- 2 (s + b)``.

    Raises:
        NumProbesError: ``num_steps`` is not in ``1 .. n``; or ``stderr`` with one probe, or
            with fewer than :data:`MIN_GAUGED_STEPS` Lanczos steps below ``n`` (its bias
            cannot be gauged there).

    Example:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> J = rng.standard_normal((2, 6, 6)) + 4 * np.eye(6)
        >>> V = rng.choice([-1.0, 1.0], size=(2, 6, 400))
        >>> A = np.swapaxes(J, 1, 2) @ J
        >>> estimate, se = slq_log_abs_det(lambda W: A @ W, V, 6)
        >>> bool(np.all(np.abs(estimate - np.linalg.slogdet(J)[1]) < 4 * se))
        True
    """
    xp = namespace(probes)
    check_probes(probes, "probes", xp)
    n, k = probes.shape[-2], probes.shape[-1]
    if not 1 <= num_steps <= n:
        raise NumProbesError(
            f"slq: num_steps must be between 1 and n = {n} (Lanczos steps per probe); got "
            f"{num_steps}."
        )
    if stderr and k < 2:
        raise NumProbesError(
            "slq: a standard error needs at least 2 probes per sample (the spread of their "
            f"terms); got {k}. Pass num_probes >= 2, or return_stderr=False."
        )
    if stderr and num_steps < min(n, MIN_GAUGED_STEPS):
        raise NumProbesError(
            f"slq: a standard error below n = {n} Lanczos steps needs at least "
            f"{MIN_GAUGED_STEPS}: the quadrature's bias is gauged by the rule of half the steps, "
            "which assumes that bias falls steadily, and at 2-6 steps it did not (Jacobians of "
            f"condition 500-1e4 covered 0-0.6); got {num_steps}. Pass lanczos_steps >= "
            f"{MIN_GAUGED_STEPS} (or n, exact), or return_stderr=False."
        )
    norms = xp.sqrt(xp.sum(probes * probes, axis=-2))  # (B, k)
    bias = stderr and num_steps < n
    quadrature, images, gap = _quadrature(
        gram_matvec, probes / norms[..., None, :], num_steps, bias=bias, loop=loop
    )
    terms = norms * norms * quadrature / 2
    if not stderr:
        return xp.mean(terms, axis=-1), None
    mean, se = mean_and_stderr(terms, xp, norms[..., None, :] * images / 2, probes)
    if gap is None:  # n steps: the quadrature is exact
        return mean, se
    return mean, se + xp.mean(norms * norms * gap / 2, axis=-1)


def _quadrature(
    gram_matvec: Matvec, q: Array, m: int, *, bias: bool, loop: Loop | None
) -> tuple[Array, Array, Array | None]:
    """``e_1^T log(T_m) e_1`` ``(B, k)`` of ``m`` Lanczos steps from the unit columns ``q``,
    Lanczos's approximation ``Q_m log(T_m) e_1`` ``(B, n, k)`` of ``log(A) q``, and with
    ``bias``, the gap ``|G_h - G_m|`` ``(B, k)`` to the Gauss rule of ``h = floor(m / 2)``
    nodes (0 after a breakdown: the quadrature is then exact).

    The first ``m - 1`` steps are one ``loop`` over arrays of fixed shapes (the basis, the
    entries of ``T_m``), so that a framework's loop traces one step whatever ``m`` (an
    unrolled one traces ``m`` products, and its compile time grows with ``m``); the last step is
    its product alone. In Python's loop (``loop=None``) the basis grows instead: a step reads
    and writes the rows found so far, not all ``m`` (a masked update of the whole basis and
    products with its rows of zeros took 90 % of a torch SLQ of 2000 samples x 32 probes)."""
    xp = namespace(q)
    info = xp.finfo(q.dtype)
    constant = {"dtype": q.dtype, "device": device(q)}
    steps = xp.arange(m, device=device(q))
    k_axes = q.shape[:-2] + q.shape[-1:]  # (B, k)
    # The basis probe-major, (..., k, m, n): rows not reached yet are 0 (or absent, in Python's
    # loop), so the products with it reorthogonalize against the vectors found so far only.
    basis = xp.zeros((*k_axes, 0 if loop is None else m, q.shape[-2]), **constant)

    def put(rows: Array, j: Any, row: Array) -> Array:
        """``rows`` (..., m, ...) with ``row`` at ``j`` on axis ``-2`` (a mask, no indexing);
        in Python's loop, ``rows`` (..., j, ...) and ``row`` after them."""
        if loop is None:
            return xp.concat([rows, row[..., None, :]], axis=-2)
        return xp.where((steps == j)[:, None], row[..., None, :], rows)

    def entry(entries: Array, j: Any, value: Array) -> Array:
        return xp.where(steps == j, value[..., None], entries)

    def alpha_of(j: Any, q: Array, alive: Array) -> tuple[Array, Array]:
        w = apply(gram_matvec, q)
        alpha = xp.sum(q * w, axis=-2)
        # A dead step (after a breakdown) gets a decoupled constant entry: weight 0, log finite,
        # and distinct from the others (the derivative of eigh divides by eigenvalue gaps).
        return w, xp.where(alive, alpha, xp.full_like(alpha, _DEAD) + j * _GOLDEN)

    def step(j: Any, state: tuple[Array, ...]) -> tuple[Array, ...]:
        q, basis, alphas, betas, alive = state
        basis = put(basis, j, xp.moveaxis(q, -1, -2))
        w, alpha = alpha_of(j, q, alive)
        alphas = entry(alphas, j, alpha)
        # Full reorthogonalization, classical Gram-Schmidt twice ("twice is enough", Giraud et
        # al. 2005), as products with the basis: two matmuls, not 2j updates.
        r = xp.moveaxis(w, -1, -2)[..., None]  # (..., k, n, 1)
        for _ in range(2):
            r = r - xp.matrix_transpose(basis) @ (basis @ r)
        w = xp.moveaxis(r[..., 0], -2, -1)
        squared = xp.sum(w * w, axis=-2)
        alive = alive & (squared > (1e3 * info.eps * xp.abs(alphas[..., 0])) ** 2)
        # the root of 1 where dead: a finite derivative (that of sqrt at 0 is not)
        norm = xp.sqrt(xp.where(alive, squared, xp.ones_like(squared)))
        betas = entry(betas, j, xp.where(alive, norm, xp.zeros_like(norm)))
        q = xp.where(alive[..., None, :], w / norm[..., None, :], 0 * w)
        return q, basis, alphas, betas, alive

    zeros = xp.zeros((*k_axes, m), **constant)
    alive = xp.ones(k_axes, dtype=xp.bool, device=device(q))  # (B, k)
    state = (q, basis, zeros, zeros, alive)
    if loop is None:
        for j in range(m - 1):
            state = step(j, state)
    else:
        state = loop(m - 1, step, state)
    q, basis, alphas, betas, alive = state
    basis = put(basis, m - 1, xp.moveaxis(q, -1, -2))
    _, alpha = alpha_of(m - 1, q, alive)
    T = _tridiagonal(entry(alphas, m - 1, alpha), betas)
    if bias:
        # Both rules in one eigh: the leading block of h nodes, the rest decoupled constants of
        # weight 0. Two independent batched eighs in one XLA:CPU program run at once, and
        # jaxlib's LAPACK kernels wait for the thread pool they run on: with every thread in
        # one, the program never finishes (seen with 2 threads).
        h = m // 2  # (m / h >= 2, as the bound assumes: ceil(m / 2) covered 0.06 at m = 3)
        i = xp.arange(m, device=device(q))  # made on the device: no host data
        lead = i < h
        dead = xp.where(lead, 0.0, _DEAD + xp.astype(i, T.dtype) * _GOLDEN)
        block = xp.astype(lead[:, None] & lead[None, :], T.dtype)
        half = T * block + xp.astype(i[:, None] == i[None, :], T.dtype) * dead
        both = _log_e1(xp.stack([T, half]), xp)
        coefficients, gauss_h = both[0], both[1][..., 0]
    else:
        coefficients = _log_e1(T, xp)  # log(T) e_1
    # Q_m log(T_m) e_1: (..., k, 1, m) @ (..., k, m, n), back to (..., n, k)
    image = xp.moveaxis((coefficients[..., None, :] @ basis)[..., 0, :], -2, -1)
    if not bias:
        return coefficients[..., 0], image, None
    gap = xp.where(alive, xp.abs(gauss_h - coefficients[..., 0]), xp.zeros_like(gauss_h))
    return coefficients[..., 0], image, gap


def _log_e1(T: Array, xp: Any) -> Array:
    """``log(T) e_1`` ``(..., m)`` of symmetric positive ``(..., m, m)`` matrices ``T`` (their
    eigenvalues floored at the dtype's smallest normal number; in float32 where ``T`` is in
    half precision, which has no eigensolver)."""
    if xp.finfo(T.dtype).bits < 32:
        return xp.astype(_log_e1(xp.astype(T, xp.float32), xp), T.dtype)
    theta, U = xp.linalg.eigh(T)
    floor = xp.full_like(theta, xp.finfo(T.dtype).tiny)
    logs = xp.log(xp.maximum(theta, floor))
    return xp.sum(U * (U[..., 0, :] * logs)[..., None, :], axis=-1)


def _tridiagonal(alphas: Array, betas: Array) -> Array:
    """The ``(..., m, m)`` symmetric tridiagonal matrices of the diagonal ``alphas`` and the
    off-diagonal ``betas`` (both ``(..., m)``; the last of ``betas`` 0): the diagonal times
    ``I`` plus the off-diagonal times the unit shift and its transpose (the array API has no
    ``diag_embed``; a sum of ``3 m`` unit matrices costs ``m`` times more)."""
    xp, m = namespace(alphas), alphas.shape[-1]
    i = xp.arange(m, device=device(alphas))  # made on the device: no host data
    eye, upper, lower = (xp.astype(i[:, None] + k == i[None, :], alphas.dtype) for k in (0, 1, -1))
    return alphas[..., :, None] * eye + betas[..., :, None] * upper + betas[..., None, :] * lower
