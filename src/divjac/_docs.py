"""The shared text of the public transforms' docstrings, written once for ``divjac.jax`` and
``divjac.torch``.

:func:`text` gives a transform's summary, then its Args (one text per parameter of its
signature, :data:`ARGS`, unless the transform words one its own way), Returns and Raises; each
framework's function adds its own example (:func:`divjac._public.bind`).
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ARGS", "text"]

_RANDOMNESS = """The function of a stochastic method takes one more argument, **first**: its
randomness, a JAX PRNG key (``jax.random.key(0)``) or a ``torch.Generator`` (``None``:
torch's global generator), or the caller's own probes (a floating array of shape
``(k, *x.shape)``, or ``x.shape`` for one). Every argument and keyword after it is ``f``'s
and reaches ``f`` untouched (``key=`` of an Equinox model included)."""

ARGS: dict[str, str] = {
    "f": """batched function (in PyTorch also an ``nn.Module``); argument ``argnums`` and the
        output carry the batch on ``batch_axis``. Other arguments pass through untouched.""",
    "u": """batched function returning one scalar per sample (output ``(B,)`` or ``(B, 1)``;
        in PyTorch also an ``nn.Module``).""",
    "pattern": """the per-sample pattern of ``f`` (from :func:`sparsity`), trusted as it is: it
        must hold every nonzero of ``f``'s per-sample Jacobian (a pattern that misses one gives
        wrong values). Detected once, it is reused with no detection at any call.""",
    "argnums": """position of the differentiated array argument; a tuple of positions gives a
        tuple of results, one per argument (``has_aux``: ``(results, aux)``).""",
    "batch_axis": """batch axis of the differentiated argument and of the output; ``None`` for
        a single-sample function.""",
    "mode": """``"fwd"`` (one JVP per input element), ``"rev"`` (one VJP per output element),
        ``"sparse"`` (one pass per color of the detected per-sample pattern) or ``"auto"``
        (sparse when it saves passes, else the cheaper of fwd/rev).""",
    "method": """``"exact"`` (one batched pass per input element), ``"sparse"`` (exact, one pass
        per color of a diagonal coloring of the detected pattern), ``"auto"`` (exact: sparse
        when it saves passes, never stochastic), or a stochastic estimate: ``"hutchinson"``,
        ``"hutch++"``, ``"xtrace"``, ``"probing"``.""",
    "num_probes": """matvec budget per sample of a stochastic method (default 16, Hutch++ 15;
        Hutch++ needs a multiple of 3, XTrace an even number).""",
    "distribution": """probe distribution: ``"rademacher"``, ``"gaussian"`` or
        ``"sphere"`` (not read by ``"probing"``, whose probes are signs per color, nor by
        ``"stde"``, which samples coordinates).""",
    "return_stderr": """return ``(result, stderr)``: an error bar (estimate +- 2 stderr covered
        the truth at least 94 % of the time on the calibration set, never NaN; each method's
        limits in docs/calibration.md); 0 for exact methods.""",
    "chunk_size": "passes computed at once (bounds memory); ``None`` picks from the sizes.",
    "has_aux": """``f`` returns ``(output, aux)``; the returned function then gives
        ``(result, aux)``.""",
    "coupling": """``"raise"`` (default) refuses a function that mixes samples with a
        :class:`~divjac.BatchCouplingError`; ``"exact"`` computes the true per-sample diagonal
        blocks of such a function (one pass per sample and element).""",
    "A": """the coefficient matrix ``(n, n)``, shared by all samples, or ``(B, n, n)``, one per
        sample (batch first); ``n`` is the number of elements of one input sample. ``None``
        when ``factor`` is given.""",
    "factor": """instead of ``A``, a factor ``S`` of ``A = S S^T``: ``(n, r)`` or ``(B, n, r)``
        (e.g. the diffusion coefficient ``sigma`` of an SDE, with ``A = sigma sigma^T``);
        ``r`` directions instead of ``2n``.""",
    "alpha": """flat per-sample input indices, with repetition, of the partial derivative
        (``(0, 0, 1)``: ``d^3u/dx0^2 dx1``); order 1 to 4.""",
    "terms": """sequence of ``(c, alpha)``: ``c`` a number, a per-sample array ``(B,)`` or a
        function of one input sample returning a scalar; ``alpha`` as in :func:`derivative`.""",
    "probing_distance": """for ``"probing"``, color a distance-limited pattern (Chebyshev
        distance on the per-sample grid) instead of choosing the distance from the budget.""",
    "layout": """``torch.sparse_coo`` (default; a 3-d COO tensor) or ``torch.sparse_csr`` (a
        batched CSR tensor: every sample shares the pattern).""",
}

_ARG_RAISES = """ArgnumsError, BatchAxisError, BatchSizeMismatchError, InputDtypeError,
        OutputError, UnexpectedRandomnessError: the arguments do not fit (the message says how
        to fix them)."""
_COUPLED = """BatchCouplingError: ``f`` mixes samples (with ``coupling="raise"``)."""
_OPTION = """OptionError: an option (``mode``, ``method``, ``coupling``, ...) has a value it
        does not take."""
_OPTION_NO_COUPLING = _OPTION.replace("``coupling``, ", "")
_PATTERN = """PatternError: ``pattern`` is not of this function at these shapes (detect it
        again), or of a function that mixes samples."""
_DIV_RAISES = (
    _COUPLED,
    """NonSquareJacobianError: output and input samples differ in shape.""",
    """MissingKeyError: a stochastic method's function was called without its randomness
        (a key, generator or probes) as its first argument.""",
    """NumProbesError: ``num_probes`` or the probes do not fit the method.""",
    _OPTION,
    _ARG_RAISES,
)
_SECOND_RAISES = (
    _COUPLED,
    """OutputError: ``u`` does not return what the transform needs (one scalar per sample
        for ``hessian`` and ``hessian_diagonal``, and for ``laplacian``'s ``"hutch++"``,
        ``"xtrace"`` and ``"probing"``).""",
    """MissingKeyError: a stochastic method's function was called without its randomness
        (a key, generator or probes) as its first argument.""",
    """NumProbesError: ``num_probes`` or the probes do not fit the method.""",
    _OPTION,
    _ARG_RAISES,
)
_COUPLED_ALWAYS = """BatchCouplingError: ``u`` mixes samples."""
_COEFFICIENT = """CoefficientError: neither or both of ``A`` and ``factor``, or one of the wrong
        shape or dtype."""
_MULTI_INDEX = """MultiIndexError: ``alpha`` (or a term's) is empty, of order above 4, not integer
        indices, or has an index out of range of the flat per-sample input; ``terms`` is empty
        or not pairs."""
_OPERATOR_COEFFICIENT = """CoefficientError: a coefficient is not a number, a floating
        per-sample array ``(B,)`` or a function of one sample returning a scalar."""
_U_ANY = """batched function ``[B, *in] -> [B, *out]`` (in PyTorch also an ``nn.Module``); the
        operator applies to each output component."""
_SECOND_PROBES = """probes per sample of a stochastic method (default: as many as the caller's
        probes, else 16; a budget of ``n`` or more is the exact sum, as the divergence's); each is
        one Taylor direction (two for ``weighted_laplacian`` with ``A``)."""
_LAPLACIAN_METHOD = """``"exact"`` (one Taylor sweep of the ``n`` unit directions),
        ``"sparse"`` (exact, one direction per color of a diagonal coloring of the detected
        per-sample Hessian pattern), ``"auto"`` (exact: sparse when the colors are at most
        half of ``n``, never stochastic), or an estimate: ``"hutchinson"`` (``v^T H v`` of
        random probes, one direction each), ``"stde"`` (STDE, Shi et al. 2024: ``n H_ii`` at
        ``num_probes`` coordinates drawn without replacement; exact when it reaches ``n``;
        best when the diagonal dominates), or from Hessian-vector products (scalar ``u``):
        ``"hutch++"``, ``"xtrace"``, ``"probing"``. ``"hutchinson"`` with ``return_stderr``
        below ``n`` probes takes the probes' Hessian-vector products instead (scalar ``u``,
        2 probes at least), whose images give an error bar that holds."""
_WEIGHTED_METHOD = """``"exact"`` or ``"auto"`` (the directions above), or ``"hutchinson"``:
        ``(S v)^T H (S v)`` for random ``v`` in ``r`` dimensions with a factor, ``v^T H A v``
        (two directions) with ``A``; with ``return_stderr`` below the exact budget, from the
        Hessian-vector products ``H v`` (scalar ``u``), as the Laplacian's."""
_DIAGONAL_METHOD = """``"exact"``, ``"sparse"``, ``"auto"`` (sparse when the colors are at most
        half of ``n``) or ``"hutchinson"`` (Bekas-Kokiopoulou-Saad)."""
_ONE_ARGNUM = (
    ("argnums", "position of the differentiated array argument (one: the pattern is its own)."),
)
_DIV_MODE = (
    (
        "mode",
        """the passes: ``"fwd"`` (JVPs, columns ``J v``), ``"rev"`` (VJPs, rows ``u^T J``: one
        per output element for ``"exact"``, ``u^T J u`` per probe for a stochastic method) or
        ``"auto"`` (the faster for the framework and the program: JVPs in JAX, but VJPs through
        a ``custom_vjp``; VJPs in PyTorch, but JVPs for a convolution network). Choose
        ``"rev"`` for an operation without a forward derivative.""",
    ),
)
_FROBENIUS_METHOD = (
    "method",
    """``"exact"`` (one batched pass per input element, or per output element in reverse),
        ``"sparse"`` (exact, one pass per color of a column or row coloring of the detected
        pattern: same-colored columns share no nonzero row, so the compressed columns' norms
        add up), ``"auto"`` (exact: sparse when it saves passes, never stochastic) or
        ``"hutchinson"`` (``E ||v^T J||^2 = ||J||_F^2``, one pass per probe, see ``mode``;
        with ``num_probes`` at least the probes' size, the exact result from that many
        coordinate passes).""",
)
_LOGDET_MODE = (
    "mode",
    """the passes of ``"exact"``: ``"fwd"`` (JVPs ``J v``), ``"rev"`` (VJPs ``v^T J``) or
        ``"auto"`` (the faster for the framework and the program); ``"slq"`` runs one of each
        per Lanczos step.""",
)
_NORM_MODE = (
    "mode",
    """the passes: ``"fwd"`` (JVPs ``J v``), ``"rev"`` (VJPs ``v^T J``) or ``"auto"``. The
        exact methods read the same norm either way (``"auto"``: the faster for the framework
        and the program). ``"hutchinson"`` estimates ``||J||_F^2`` by ``||v^T J||^2`` from
        VJPs with ``"rev"`` and ``"auto"`` (RNODE's recipe, Finlay et al. 2020: one VJP per
        probe gives ``v^T J v`` and ``||v^T J||^2``; probes have the output's shape), by
        ``||J v||^2`` from JVPs with ``"fwd"`` (probes of the input's shape). Both are
        unbiased; ``"auto"`` is always the first, in every framework and at every size, so the
        same probes give the same value (it refuses a function without a reverse derivative,
        such as a JAX ``while_loop``: pass ``"fwd"``).""",
)
_FROBENIUS_RAISES = (
    _COUPLED_ALWAYS.replace("``u``", "``f``"),
    _OPTION_NO_COUPLING,
    _ARG_RAISES,
    """MissingKeyError: a stochastic method's function was called without its randomness
        first.""",
)
_FROBENIUS_PROBES = (
    "num_probes",
    """probes per sample of ``"hutchinson"`` (default 16; at least 2 for a standard error).""",
)
_STDERR_PROBES = """NumProbesError: ``num_probes`` is not a positive integer, or a standard error
        with one probe."""
_LOGDET_METHOD = (
    "method",
    """``"exact"`` or ``"auto"`` (the per-sample Jacobians, as :func:`jacobian` computes them,
        and their LU: ``slogdet``), or ``"slq"``: stochastic Lanczos quadrature on ``J^T J``
        (Ubaru, Chen & Saad 2017), ``log|det J| = tr log(J^T J) / 2``, one JVP and one VJP per
        Lanczos step and probe, differentiable; for large ``n``.""",
)
_LOGDET_PROBES = (
    "num_probes",
    """probes per sample of ``"slq"`` (default 16; at least 2 for a standard error).""",
)
_LANCZOS_STEPS = (
    "lanczos_steps",
    """Lanczos steps per probe of ``"slq"`` (default ``min(n, 30)``): the quadrature is exact
        for polynomials of degree ``2 * lanczos_steps - 1`` of ``J^T J``'s eigenvalues; its
        error falls geometrically for a well-conditioned ``J``, about like ``1 /
        lanczos_steps`` on networks' ill-conditioned ones (docs/calibration.md).""",
)


@dataclass(frozen=True)
class _Doc:
    summary: str
    returns: str
    raises: tuple[str, ...]
    stochastic: bool = False  # its function may take a stochastic method's randomness first
    own_args: tuple[tuple[str, str], ...] = ()  # (name, text) replacing the shared text

    def text(self, parameters: Sequence[str]) -> str:
        lines = [inspect.cleandoc(self.summary), "", "Args:"]
        own = dict(self.own_args)
        lines += [
            f"    {name}: {_flat(own[name] if name in own else ARGS[name])}" for name in parameters
        ]
        returns = self.returns + ("\n" + _RANDOMNESS if self.stochastic else "")
        lines += ["", "Returns:", f"    {_flat(returns)}", "", "Raises:"]
        lines += [f"    {_flat(text)}" for text in self.raises]
        return "\n".join(lines)


def _flat(text: str) -> str:
    """A fragment's continuation lines indented under its first line (8 spaces)."""
    first, *rest = (textwrap.dedent(line) for line in inspect.cleandoc(text).splitlines())
    return "\n".join([first, *(f"        {line}" for line in rest)])


_DOCS: dict[str, _Doc] = {
    "jacobian": _Doc(
        "Per-sample Jacobian of a batched function.",
        """A function with ``f``'s signature returning the per-sample Jacobians, shape
        ``(B, *out_sample, *in_sample)`` (``(*out, *in)`` with ``batch_axis=None``).""",
        (_COUPLED, _OPTION, _ARG_RAISES),
    ),
    "jacobian_from_pattern": _Doc(
        """Per-sample Jacobian of a batched function, from its given sparsity pattern.

        The staged form of ``jacobian(f, mode="sparse")``: one pass per color of ``pattern``'s
        column (or row) coloring, and no detection at the call (as asdex's
        ``jacobian_from_coloring``).""",
        """A function with ``f``'s signature returning the per-sample Jacobians, shape
        ``(B, *out_sample, *in_sample)``.""",
        (_PATTERN, _ARG_RAISES),
        own_args=_ONE_ARGNUM,
    ),
    "divergence": _Doc(
        "Per-sample divergence (trace of the per-sample Jacobian) of a batched function.",
        "A function with ``f``'s signature returning the per-sample divergence, shape ``(B,)``.",
        _DIV_RAISES,
        stochastic=True,
        own_args=_DIV_MODE,
    ),
    "value_and_divergence": _Doc(
        """``f``'s output and its per-sample divergence from one shared forward computation.

        As ``jax.value_and_grad`` and ``torch.func.grad_and_value`` pair them.""",
        """A function with ``f``'s signature returning ``(value, div)`` (``((value, aux),
        div)`` with ``has_aux``; ``div`` as :func:`divergence` returns it).""",
        _DIV_RAISES,
        stochastic=True,
        own_args=_DIV_MODE,
    ),
    "divergence_from_pattern": _Doc(
        """Exact per-sample divergence of a batched function, from its given sparsity pattern.

        The staged form of ``divergence(f, method="sparse")``: one pass per color of
        ``pattern``'s diagonal coloring, and no detection at the call.""",
        "A function with ``f``'s signature returning the per-sample divergence, shape ``(B,)``.",
        (
            _PATTERN,
            """NonSquareJacobianError: output and input samples differ in shape.""",
            _ARG_RAISES,
        ),
        own_args=_ONE_ARGNUM,
    ),
    "grad_divergence": _Doc(
        """Per-sample gradient of the divergence w.r.t. the input.

        For a batch-independent ``f``, ``div_b`` depends only on ``x_b``, so the gradient of
        ``sum_b div_b`` holds every per-sample gradient at once: exact, not scaled by ``1/B``,
        with no ``B^2`` work (for ``coupling="exact"``, the gradient of each sample's
        diagonal-block trace w.r.t. the whole batch, summed over samples). Computed with the
        framework's gradient (``jax.grad``, ``torch.func.grad``), so it stays differentiable
        w.r.t. parameters.""",
        "A function with ``f``'s signature returning the gradients, shape ``(B, *in_sample)``.",
        _DIV_RAISES,
        stochastic=True,
        own_args=_DIV_MODE,
    ),
    "laplacian": _Doc(
        """Per-sample Laplacian of each output component of ``u: [B, *in] -> [B, *out]``.

        ``"exact"`` reads it from one second-order Taylor sweep of the unit basis (the forward
        Laplacian of Li et al. 2023, collapsed Taylor mode of Dangel et al. 2025), not from
        ``n`` Hessian-vector products; ``"sparse"`` sweeps the indicators of a diagonal
        coloring of the detected per-sample Hessian pattern (exact, ``#colors`` directions).""",
        """A function with ``u``'s signature returning the per-sample Laplacians, with the
        shape of ``u``'s output (``(B,)`` for ``(B,)``, ``(B, 1)`` for ``(B, 1)``).""",
        _SECOND_RAISES,
        stochastic=True,
        own_args=(("u", _U_ANY), ("method", _LAPLACIAN_METHOD), ("num_probes", _SECOND_PROBES)),
    ),
    "weighted_laplacian": _Doc(
        """Per-sample ``tr(A H) = sum_ij A_ij d2u/dx_i dx_j`` of each output component of ``u``.

        The second-order part of a linear PDE operator: a diffusion with covariance ``A``
        (Fokker-Planck, Kolmogorov, Black-Scholes), the "weighted Laplacian" of Dangel et al.
        (2025). Given a factor ``S`` of ``A = S S^T``, one Taylor sweep of its ``r`` columns;
        given ``A``, ``2n`` directions ``e_i +- A e_i`` (polarization: linear in ``A``, so
        differentiable w.r.t. ``A`` everywhere, and only ``A``'s symmetric part counts, as
        ``H`` is symmetric).""",
        """A function with ``u``'s signature returning ``tr(A H)`` per sample, with the shape of
        ``u``'s output.""",
        (_COEFFICIENT, *_SECOND_RAISES),
        stochastic=True,
        own_args=(
            ("u", _U_ANY),
            ("argnums", "position of the differentiated array argument (one)."),
            ("method", _WEIGHTED_METHOD),
            ("num_probes", _SECOND_PROBES),
        ),
    ),
    "bilaplacian": _Doc(
        """Per-sample bi-Laplacian ``sum_ij d^4u/dx_i^2 dx_j^2`` of each output component of ``u``.

        The operator of the Kirchhoff plate and of biharmonic problems. ``"exact"`` (and
        ``"auto"``): the Laplacian of the Laplacian, a collapsed Taylor sweep of the unit basis
        through the collapsed sweep of the unit basis (``n^2`` second-order terms, no Hessian
        is formed). ``"hutchinson"``: for Gaussian ``v``, ``E[(v . grad)^4 u] = 3 Delta^2 u``;
        each probe gives ``(v . grad)^4 u / 3``; their mean is unbiased, but no error bar
        holds (the terms are heavy-tailed). It draws its probes from a key or generator: the
        caller's probes are refused (unbiased only if Gaussian, which cannot be checked).""",
        """A function with ``u``'s signature returning the per-sample bi-Laplacians, with the
        shape of ``u``'s output.""",
        _SECOND_RAISES,
        stochastic=True,
        own_args=(
            ("u", _U_ANY),
            (
                "method",
                """``"exact"``, ``"auto"`` (exact) or ``"hutchinson"`` (Gaussian
                directions).""",
            ),
            ("num_probes", 'Gaussian probes per sample of ``"hutchinson"`` (default 16).'),
            (
                "return_stderr",
                """return ``(result, stderr)``: 0 for the exact methods; ``"hutchinson"``
                refuses it (fourth powers of Gaussian probes: their spread covered 0.69-0.93
                of the draws even at 64 probes, docs/calibration.md).""",
            ),
        ),
    ),
    "derivative": _Doc(
        """Per-sample mixed partial ``d^|alpha| u / dx_alpha`` of each output component of ``u``.

        ``alpha`` is a tuple of flat per-sample input indices with repetition: ``(0, 0, 1)`` is
        ``d^3u/dx0^2 dx1``; orders 1 to 4. Exact: the combination of the ``|alpha|``-th
        directional derivatives along integer directions supported on ``alpha``'s indices
        that equals the mixed partial (Griewank, Utke & Walther 2000), computed as
        :func:`differential_operator` computes one term.""",
        """A function with ``u``'s signature returning the per-sample mixed partials, with the
        shape of ``u``'s output.""",
        (_MULTI_INDEX, *_SECOND_RAISES),
        own_args=(("u", _U_ANY),),
    ),
    "differential_operator": _Doc(
        """Per-sample linear differential operator ``sum_t c_t d^{alpha_t} u`` up to fourth order.

        ``terms`` is a sequence of pairs ``(c, alpha)``: ``alpha`` as in :func:`derivative`,
        ``c`` a number, a per-sample array ``(B,)`` (batch first), or a function of one input
        sample returning a scalar (a variable coefficient, evaluated on each sample, not
        differentiated). ``"exact"`` (and ``"auto"``): the terms grouped by order, each order's
        distinct directions carrying their summed weights; order 1 is one JVP, order 2 one
        collapsed Taylor sweep, orders 3 and 4 one collapsed Taylor sweep of that order (JAX:
        each direction's lower Taylor coefficients, the top one summed over the directions;
        PyTorch: a second-order sweep of the second-order sweep along each direction).
        ``"auto"`` with number coefficients, where the Hessian's pattern has a diagonal
        coloring (at most half the inputs' colors): the pure powers ``d^k u/dx_i^k`` of one
        color are one direction, so a separable ``u``'s diagonal terms (a sum over particles)
        take its colors' directions, not one per input. ``"hutchinson"`` and ``"stde"`` (the
        same estimator): order 1 and an order with one direction are exact; the budget
        ``num_probes`` is split over the other orders by their weights' mass (2 probes each at
        least), and an order whose distinct directions fit in its share is computed exactly
        (its directions leave the budget, the rest is split again); in each remaining order,
        its share of (direction, weight) pairs is drawn per sample with probabilities ``p_j``
        proportional to ``|w_j| |v_j|^d`` (``w_j``'s number coefficients), each giving
        ``w_j (v_j . grad)^d u / p_j`` (unbiased).""",
        """A function with ``u``'s signature returning the operator per sample, with the
        shape of ``u``'s output.""",
        (
            _MULTI_INDEX,
            _OPERATOR_COEFFICIENT,
            """NumProbesError: ``num_probes`` is not a positive integer, probes were passed
        rather than randomness, or ``return_stderr=True`` with a stochastic method below the
        budget that computes every order exactly (named in the message).""",
            *_SECOND_RAISES,
        ),
        stochastic=True,
        own_args=(
            ("u", _U_ANY),
            (
                "method",
                """``"exact"``, ``"auto"`` (exact) or ``"hutchinson"`` / ``"stde"``
                (sampled directions).""",
            ),
            (
                "num_probes",
                """(direction, weight) pairs drawn per sample of a stochastic method, split over
                the sampled orders (default 16).""",
            ),
            (
                "return_stderr",
                """return ``(result, stderr)``: 0 for the exact methods, and for the
                stochastic ones where the budget computes every order exactly; below that
                budget ``NumProbesError`` names it (a sampled order's terms take few values or
                are heavy-tailed: their spread is no error bar that holds, see
                docs/calibration.md).""",
            ),
        ),
    ),
    "hessian": _Doc(
        """Per-sample Hessian of a scalar-per-sample function ``u: [B, *in] -> [B]``.

        The per-sample Jacobian of the per-sample gradient (forward-over-reverse); ``mode``
        works as in :func:`jacobian` on that gradient (``"sparse"``: one pass per color of the
        detected Hessian pattern).""",
        """A function with ``u``'s signature returning the per-sample Hessians, shape
        ``(B, *in, *in)`` (``(*in, *in)`` with ``batch_axis=None``).""",
        (_COUPLED_ALWAYS, _OPTION, _ARG_RAISES),
    ),
    "hessian_diagonal": _Doc(
        """The diagonal ``d2u/dx_i^2`` of the per-sample Hessians of a scalar-per-sample ``u``.

        ``"exact"``: each term of one Taylor sweep of the unit basis; ``"sparse"``:
        Hessian-vector products with the indicators of a diagonal coloring of the detected
        Hessian pattern (each ``(H v_c)_i``, ``i`` of color ``c``, is ``H_ii``);
        ``"hutchinson"``: the estimator of Bekas, Kokiopoulou & Saad (2007), the mean of
        ``v * H v`` over random probes (unbiased for ``E[v v^T] = I``); its ``stderr``
        bounds each entry's variance by ``2 mean (H v)_i^2`` and needs 3 probes or more.""",
        """A function with ``u``'s signature returning the diagonals, shaped as the
        differentiated input (``(B, *in)``).""",
        _SECOND_RAISES,
        stochastic=True,
        own_args=(("method", _DIAGONAL_METHOD), ("num_probes", _SECOND_PROBES)),
    ),
    "squared_frobenius_norm": _Doc(
        """Per-sample **squared** Frobenius norm ``||J_b||_F^2 = sum_ij (dy_i/dx_j)^2``.

        The Jacobian penalty of regularized CNFs (RNODE: Finlay et al. 2020), of Jacobian
        regularization and contractive autoencoders. Exact by coloring: with a column coloring,
        ``sum_c ||J s_c||^2 = ||J||_F^2`` in one pass per color; or Hutchinson's unbiased
        ``||v^T J||^2`` (``||J v||^2`` with ``mode="fwd"``). For the norm itself take the square root of the exact result.""",
        """A function with ``f``'s signature returning ``||J_b||_F^2``, shape ``(B,)`` (with
        ``return_stderr``, ``(norms, stderr)``).""",
        (*_FROBENIUS_RAISES, _STDERR_PROBES),
        stochastic=True,
        own_args=(_FROBENIUS_METHOD, _NORM_MODE, _FROBENIUS_PROBES),
    ),
    "value_divergence_and_frobenius": _Doc(
        """``f``'s output, its per-sample divergence and squared Frobenius norm from the same
        passes: the regularized CNF's dynamics in one call.

        Each pass pushes one seed ``v`` and keeps both ``v^T J v`` and ``||v^T J||^2`` (VJPs;
        ``||J v||^2`` with ``mode="fwd"``), as RNODE's training loop does by hand with one VJP
        per probe: with
        ``"hutchinson"`` both are estimated from the same probes; exactly (``"exact"``,
        ``"sparse"``), the coloring is of the pattern plus its diagonal, so that each pass also
        reads the diagonal entries of its own elements.""",
        """A function with ``f``'s signature returning ``(value, div, sq_frobenius)``
        (``(value, aux)`` in place of ``value`` with ``has_aux``; with ``return_stderr`` each of
        ``div`` and ``sq_frobenius`` is ``(estimate, stderr)``).""",
        (
            *_FROBENIUS_RAISES,
            """NonSquareJacobianError: output and input samples differ in shape.""",
            _STDERR_PROBES,
        ),
        stochastic=True,
        own_args=(
            ("argnums", "position of the differentiated array argument (one)."),
            _FROBENIUS_METHOD,
            _NORM_MODE,
            _FROBENIUS_PROBES,
        ),
    ),
    "log_abs_det": _Doc(
        """Per-sample ``log|det J_b|`` of a square per-sample Jacobian.

        The change of volume of a normalizing flow or free-form flow. Exact from the per-sample
        Jacobians (chunked passes, dense or by coloring) and their LU, or estimated by
        stochastic Lanczos quadrature for large ``n``; a singular ``J_b`` gives ``-inf``
        (exact).""",
        """A function with ``f``'s signature returning ``log|det J_b|``, shape ``(B,)`` (with
        ``return_stderr``, ``(values, stderr)``: the stderr of ``"slq"`` covers its probes'
        randomness and, below ``n`` Lanczos steps, the quadrature's bias, gauged by the gap to
        the rule of half the steps, which assumes that bias falls steadily with the steps (from
        8 steps: fewer are refused; it can still fall short where ``J`` is very ill-conditioned,
        0.25 at 8 steps for condition 1e6; ``lanczos_steps = n`` is exact). In float32,
        ``J^T J`` resolves no singular value of ``J`` below about ``3e-4`` of the largest: at
        condition 1e4 the bar covered 0.87-0.89 at the default steps (1.00 in float64); SLQ
        wants float64 there (docs/calibration.md).""",
        (
            *_FROBENIUS_RAISES,
            """NonSquareJacobianError: output and input samples differ in shape.""",
            """NumProbesError: ``lanczos_steps`` is not in ``1 .. n``, or a standard error with one
        probe or with fewer than 8 Lanczos steps below ``n``.""",
        ),
        stochastic=True,
        own_args=(_LOGDET_METHOD, _LOGDET_MODE, _LOGDET_PROBES, _LANCZOS_STEPS),
    ),
    "sparsity": _Doc(
        """The per-sample Jacobian sparsity of a batched function, as a transform.

        Detection interprets the traced program (the jaxpr in JAX, the ATen graph traced on
        fake tensors in PyTorch): values are never used, except constants baked into the
        function, so the pattern holds for every input of these shapes. It never misses a true
        nonzero; operations without a rule are assumed dense (with a warning). divjac's options
        are given here, ``f``'s arguments at the call: ``sparsity(f)(x, key=k)`` passes ``key``
        to ``f``.""",
        """A function with ``f``'s signature returning the
        :class:`~divjac.jax.SparsityPattern` of ``f`` at these arguments' shapes: the
        per-sample CSR pattern, its colorings and ``is_batch_independent`` (a coupled function
        is reported, not refused).""",
        (_ARG_RAISES,),
    ),
    "sparse_jacobian": _Doc(
        """Per-sample Jacobian as a sparse matrix batch of shape ``(B, n_out, n_in)``.

        A ``BCOO`` array in JAX, a sparse COO or CSR tensor in PyTorch. Only the detected
        nonzeros are stored, and they are computed with one pass per color of the column (or
        row) coloring: a 64x64 blur with an 11x11 kernel needs about 121 passes instead of
        4096, and no ``H*W x H*W`` dense array is formed.""",
        """A function with ``f``'s signature returning the sparse per-sample Jacobians (one
        ``(n_out, n_in)`` matrix with ``batch_axis=None``).""",
        (_COUPLED, _OPTION, _ARG_RAISES),
    ),
}


def text(name: str, parameters: Sequence[str]) -> str:
    """The shared docstring of the public transform ``name`` with these ``parameters``."""
    return _DOCS[name].text(parameters)
