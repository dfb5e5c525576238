"""The passes of a call: the JVPs or VJPs of the batch-first function, on ``torch.func`` or
torch's autograd tape.

Passes run together under ``torch.func.vmap``: VJPs pull a batch of cotangents through one
``torch.func.vjp`` (``chunk_size`` at a time); JVPs are pushed by ``torch.func.jvp`` inside the
``vmap``, a chunk at a time. Module parameters are ordinary captured tensors: results stay on the
autograd graph, so a loss built on a divergence backpropagates to them (``loss.backward()``),
and everything composes with ``torch.func`` transforms. Device and dtype follow the
differentiated input. Passes read their own entries with masks.

Random operations of the function (dropout in training mode) draw once per call, whatever the
chunking: every evaluation of the function starts from the state torch's global generators had
when the passes started, so every pass differentiates the same forward pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
from torch.utils.checkpoint import checkpoint

from .._backend import Finish, Linear, Point, Seed
from .._core.plan import Chunks
from .._errors import OptionError
from ._compat import pytree
from ._compile_setup import compiling
from ._kernels import differentiable_kernels, without_overlap
from ._traced import Traced

__all__: list[str] = []

R = TypeVar("R")


class Passes(Linear):
    """The JVP (or VJP) of the batch-first function, run as vmapped ``torch.func`` passes.

    The function is evaluated by the passes (the VJP's forward pass is shared by all of them);
    ``value`` and ``aux`` are those of the first run.
    """

    def __init__(self, point: Point[Traced], reverse: bool) -> None:
        self._point = point
        self._reverse = reverse
        self._g: Callable[[torch.Tensor], Any] = point.g
        self._aux_of: Callable[[Any], Any] | None = None
        if point.has_aux:
            self._g, self._aux_of = split_aux(point.g)
        self._vjp: Any = None
        self._traced = point.traced
        self._rng = Generators(point.xb.device) if self._traced.draws_random else None

    def _keep(self, y: torch.Tensor, aux: Any) -> None:
        if self.value is None:
            self.value, self.aux = y, aux

    def passes(
        self, inputs: torch.Tensor, seed: Seed, finish: Finish, chunks: Chunks, *, shared: bool
    ) -> torch.Tensor:
        point = self._point
        xb, B = without_overlap(point.xb), point.batch_size
        g, aux_of = self._g, self._aux_of
        n_passes = int(inputs.shape[0])

        def tangent(t: torch.Tensor) -> torch.Tensor:
            # Materialized: batched matmuls of a stride-0 (expanded) tangent fall back to bmm
            # and copies under vmap, ~7% slower on an MLP.
            return t.expand(B, *t.shape).contiguous() if shared else t

        traced = self._traced
        # Under torch.compile no batch normalization runs (_check_compilable).
        quiet = contextlib.nullcontext() if compiling() else traced.running_stats()
        attention, fused, rnn, norms, layouts, scatters = differentiable_kernels(
            traced, forward=not self._reverse
        )
        chunk = chunks.size
        n_chunks = -(-n_passes // chunk)
        checkpointed = _checkpointed(chunks, _pass_contexts(traced, forward=not self._reverse))
        with quiet, attention, fused, rnn, norms, layouts, scatters:
            if self._reverse:
                if self._vjp is None:
                    pulled: Any = torch.func.vjp(g, xb, has_aux=aux_of is not None)
                    y, vjp_fn, aux = pulled if aux_of is not None else (*pulled, None)
                    self._vjp = vjp_fn
                    self._keep(y, aux_of(aux) if aux_of is not None else None)
                vjp_fn = self._vjp

                def pull(c: torch.Tensor) -> torch.Tensor:
                    t = seed(c)
                    return finish(c, t, vjp_fn(tangent(t))[0])

                if not n_passes:
                    return _no_passes(pull, inputs)
                if traced.forward_less:  # one by one, as _Tape says why
                    return torch.stack([pull(c) for c in inputs])
                if n_chunks == 1:
                    return torch.func.vmap(pull)(inputs)
                pulls = checkpointed(torch.func.vmap(pull))
                return torch.cat(
                    [pulls(inputs[lo : lo + chunk]) for lo in range(0, n_passes, chunk)]
                )
            auxes: list[Any] = []

            def push(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                t = seed(c)
                result: Any = torch.func.jvp(g, (xb,), (tangent(t),), has_aux=aux_of is not None)
                if aux_of is not None:
                    auxes.append(result[2])
                return result[0], finish(c, t, result[1])

            # The value is the same in every pass (out_dims None); chunks are run one by one,
            # as vmap's own chunk_size cannot return an unbatched output. Random operations
            # draw once per chunk (shared by its passes), and every chunk the same numbers.
            out_dims: Any = (None, 0)  # torch's annotation says int | tuple[int, ...]
            pushes = torch.func.vmap(push, out_dims=out_dims, randomness="same")
            pushes = checkpointed(pushes)
            parts = []
            for lo in range(0, max(n_passes, 1), chunk):  # no pass: one empty chunk (the value)
                if self._rng is not None:
                    self._rng.rewind()
                if n_passes:
                    y, part = pushes(inputs[lo : lo + chunk])
                else:
                    y, one = push(inputs.new_zeros(inputs.shape[1:]))
                    part = one[None][:0]
                parts.append(part)
            self._keep(y, aux_of(auxes[0]) if aux_of is not None else None)
            return torch.cat(parts) if len(parts) > 1 else parts[0]


class Generators:
    """The state of torch's global generators (the CPU's, and that of the input's device) when
    the passes of a call start. Every evaluation of the function is rewound to it, so it draws
    what the first one drew, and leaves them where one evaluation does."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._module: Any = None
        if device.type not in ("cpu", "meta"):
            self._module = torch.get_device_module(device.type)
        self._cpu = torch.get_rng_state()
        self._own = None if self._module is None else self._module.get_rng_state(device)

    def rewind(self) -> None:
        torch.set_rng_state(self._cpu)
        if self._own is not None:
            self._module.set_rng_state(self._own, self._device)


class Tape(Linear):
    """The VJP of the batch-first function on torch's autograd tape, as FFJORD's code does it:
    one forward pass, then ``torch.autograd.grad`` per chunk of cotangents (batched by
    ``vmap``, or one by one for a few). Graphs with an operation that has no forward
    derivative (``cdist``, a ``torch.library`` custom operation) pull every cotangent one by
    one: the backward kernels of such operations are not composed of differentiable
    operations, and their batching rules are wrong (``cdist``'s in torch 2.13) or missing (the
    in-place arithmetic of the chunked ``linear_cross_entropy``'s backward). Outside ``torch.func`` transforms this is
    the fast way to pull rows: ``torch.func.vjp`` wraps every operation of the forward pass,
    an overhead per operation that rivals the compute of a small function (FFJORD's ODE
    function; ``bench_ffjord``).

    With grad mode on (as the caller has it), the passes are on the autograd graph
    (``create_graph``): a loss on the result backpropagates to the parameters and the input.
    With it off, nothing is kept on the graph. The function is evaluated once, so a random
    operation (dropout) draws once.
    """

    def __init__(self, point: Point[Traced]) -> None:
        self._point = point
        self._traced = point.traced
        self._tape: tuple[torch.Tensor, torch.Tensor, bool] | None = None

    def _record(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        point = self._point
        xb = point.xb
        # On the graph only when something the caller has requires grad (the input, an
        # argument or a captured parameter); else the results carry no graph, as torch.func's.
        create = on_graph(point)
        with contextlib.nullcontext() if torch.is_grad_enabled() else torch.enable_grad():
            x = xb if xb.requires_grad else xb.detach().requires_grad_()
            out = point.g(x)
        y, aux = out if point.has_aux else (out, None)
        if create:
            self.value, self.aux = y, aux
        else:
            self.value = y.detach()
            self.aux = (
                None
                if aux is None
                else pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, aux)
            )
        return x, y, create

    def _pull(
        self, tape: tuple[torch.Tensor, torch.Tensor, bool], cotangent: torch.Tensor
    ) -> torch.Tensor:
        x, y, create = tape
        if not y.requires_grad:  # the output depends on neither x nor parameters
            return x.new_zeros(x.shape)
        if cotangent.dtype != y.dtype:
            cotangent = cotangent.to(y.dtype)
        (pulled,) = torch.autograd.grad(
            y,
            x,
            cotangent,
            retain_graph=True,
            create_graph=create,
            allow_unused=True,
        )
        if pulled is None:  # no gradient reached x
            if self._traced.custom_ops:
                raise OptionError(
                    "divjac: the function's output depends on its input through "
                    f"{', '.join(sorted(self._traced.custom_ops))}, a torch.library custom "
                    "operation, but torch's autograd gives the input no gradient through it. "
                    "Its Python wrapper may have decided, under torch.func.vmap, that nothing "
                    "requires grad (batched tensors report requires_grad=False; torch 2.13's "
                    "chunked linear_cross_entropy computes no input gradient then): call it "
                    "outside vmap (batch_axis instead), or use its reference path "
                    "(linear_cross_entropy with options=None)."
                )
            return x.new_zeros(x.shape)
        return pulled

    def passes(
        self, inputs: torch.Tensor, seed: Seed, finish: Finish, chunks: Chunks, *, shared: bool
    ) -> torch.Tensor:
        B = self._point.batch_size

        def one(c: torch.Tensor) -> torch.Tensor:
            t = seed(c)
            return finish(c, t, self._pull(tape, t.expand(B, *t.shape) if shared else t))

        def pulled(cs: torch.Tensor) -> torch.Tensor:
            count = int(cs.shape[0])
            if count == 1:  # (a view, not a copy: the single probe of Hutchinson's estimate)
                return one(cs[0]).unsqueeze(0)
            if count <= _ONE_BY_ONE or traced.forward_less:
                return torch.stack([one(cs[i]) for i in range(count)])
            # batched backward passes: torch.func's vmap over autograd (is_grads_batched's own
            # vmap lacks batching rules for some backward kernels, GroupNorm's among them)
            return torch.func.vmap(one)(cs)

        traced = self._traced
        parts: list[torch.Tensor] = []
        attention, fused, rnn, norms, layouts, scatters = differentiable_kernels(traced)
        with traced.running_stats(), attention, fused, rnn, norms, layouts, scatters:
            if self._tape is None:
                self._tape = self._record()
            tape = self._tape
            n_passes = int(inputs.shape[0])
            if not n_passes:
                return _no_passes(one, inputs)
            chunk = chunks.size
            run = _checkpointed(chunks, _pass_contexts(traced))(pulled)
            for lo in range(0, n_passes, chunk):
                parts.append(run(inputs if chunk >= n_passes else inputs[lo : lo + chunk]))
        return torch.cat(parts) if len(parts) > 1 else parts[0]


def _no_passes(pull: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
    """The result of no passes (``inputs`` holds none): ``pull`` of a zero pass, sliced to none.
    ``vmap`` over an empty batch fails in some kernels (``linalg.det``'s) and in reshapes the
    function makes of an empty sample (``reshape(-1)``)."""
    return pull(inputs.new_zeros(inputs.shape[1:]))[None][:0]


def on_graph(point: Point[Traced]) -> bool:
    """Whether the results of the passes at ``point`` go on the autograd graph: grad mode is
    on and something the caller has requires grad (the input, an argument or a captured
    parameter)."""
    return torch.is_grad_enabled() and (
        point.xb.requires_grad
        or point.traced.captures_grad()
        or any(
            isinstance(a, torch.Tensor) and a.requires_grad
            for a in pytree.tree_leaves((point.args, point.kwargs))
        )
    )


def recomputed(point: Point[Traced]) -> bool:
    """Whether the backward recomputes each chunk of passes at ``point``: their results go on
    the autograd graph, outside ``torch.compile`` (whose partitioner chooses what to recompute)."""
    return not compiling() and on_graph(point)


def _checkpointed(
    chunks: Chunks,
    contexts: Callable[[], Sequence[contextlib.AbstractContextManager[Any]]] | None = None,
) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """A wrapper of the work of one chunk (a function of its tensors) where ``chunks`` are
    checkpointed (:meth:`~divjac._call.Call.chunk`: results on the autograd graph, in chunks
    that bound their memory; the identity elsewhere, and under ``torch.compile``, whose
    partitioner chooses what to recompute): ``torch.utils.checkpoint``
    keeps a chunk's result and its inputs, not its graph, and the backward recomputes the
    chunk with the random numbers it drew, within ``contexts()`` (the kernels and frozen
    running statistics that the chunk ran within). Peak memory then follows the chunk size
    (one chunk's graph at a time, and the function's own, which a tape keeps), at the cost of
    computing every chunk twice when a gradient is taken."""
    if not chunks.checkpointed or compiling():  # (planned ahead of dynamo's trace)
        return lambda run: run

    @contextlib.contextmanager
    def recomputing() -> Any:
        with contextlib.ExitStack() as stack:
            for context in contexts() if contexts is not None else ():
                stack.enter_context(context)
            yield

    def context_fn() -> tuple[
        contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]
    ]:
        return contextlib.nullcontext(), recomputing()

    def wrap(run: Callable[..., R]) -> Callable[..., R]:
        def checkpointed(*tensors: Any) -> R:
            return cast(R, checkpoint(run, *tensors, use_reentrant=False, context_fn=context_fn))

        return checkpointed

    return wrap


def _pass_contexts(
    traced: Traced, *, forward: bool = False
) -> Callable[[], tuple[contextlib.AbstractContextManager[Any], ...]]:
    """The contexts the passes run within (for their recomputation), made anew per call."""
    return lambda: (traced.running_stats(), *differentiable_kernels(traced, forward=forward))


# Chunks of up to this many passes pull their cotangents one by one (no vmap to set up).
_ONE_BY_ONE = 4


def split_aux(
    g: Callable[[torch.Tensor], Any],
) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], Any]]:
    """``g`` returning ``(y, tensor leaves of aux)`` (what ``torch.func`` passes through) and
    the function that puts the aux back together with its other leaves (strings, numbers)."""
    box: list[Any] = []

    def tensors_only(xb: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        y, aux = g(xb)
        leaves, treedef = pytree.tree_flatten(aux)
        box[:] = [(leaves, treedef)]
        return y, [a for a in leaves if isinstance(a, torch.Tensor)]

    def rebuild(tensors: list[torch.Tensor]) -> Any:
        leaves, treedef = box[0]
        it = iter(tensors)
        return pytree.tree_unflatten(
            [next(it) if isinstance(a, torch.Tensor) else a for a in leaves], treedef
        )

    return tensors_only, rebuild
