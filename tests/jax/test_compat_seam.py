"""JAX's private and version-dependent API is read in one module only: ``divjac/jax/_compat.py``.

The rule, checked on the syntax tree of every module of ``src/divjac`` but the seam:

- no import of, and no attribute path through, a private JAX module: ``jax._src``,
  ``jax.interpreters``, ``jax.extend`` (the jaxpr types, whose classes JAX 0.12 merged),
  ``jax.core`` (its ``Tracer``), ``jax.lib``, ``jaxlib``;
- no call of ``Primitive.get_bind_params`` (JAX's internal re-binding protocol);
- no string naming a JAX tracer class (``"JVPTracer"``, ``"BatchTracer"``: private classes,
  recognized by name);
- in a module that imports JAX, no subscript or ``.get`` with a string key naming a parameter of
  :data:`divjac.jax._compat.VERSIONED_PARAMS` (the nested programs of a call, a loop or a
  ``cond``, and how a loop splits its operands: ``num_consts`` became ``ft_in`` in JAX 0.12).
  Modules that do not import JAX (the framework-free rules of ``divjac._core``) hold their own
  parameters by those names and are not checked for them.

Other strings (docstrings, messages, module names to trust) are not checked.
"""

from __future__ import annotations

import ast
import functools
import gc
import re
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import divjac
from divjac.jax import _compat
from divjac.jax._compat import VERSIONED_PARAMS

ROOT = Path(divjac.__file__).parent
SEAM = ROOT / "jax" / "_compat.py"
PRIVATE = ("jax._src", "jax.interpreters", "jax.extend", "jax.core", "jax.lib", "jaxlib")


def _private(dotted: str) -> bool:
    return any(dotted == p or dotted.startswith(p + ".") for p in PRIVATE)


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` of an attribute path from a name, ``None`` for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _imports_jax(tree: ast.Module) -> bool:
    return any(
        (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "jax" for a in n.names))
        or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "jax")
        for n in ast.walk(tree)
    )


def _key(node: ast.AST) -> str | None:
    """The string key of ``x["key"]`` or ``x.get("key", ...)``."""
    if isinstance(node, ast.Subscript):
        key = node.slice
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and node.args
    ):
        key = node.args[0]
    else:
        return None
    return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None


def violations(source: str) -> list[str]:
    """What the rule finds in one module's source (``line: what``)."""
    tree = ast.parse(source)
    params = _imports_jax(tree)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            module = node.module or ""
            names = [f"{module}.{a.name}" for a in node.names]
            if _private(module) or any(_private(n) for n in names):
                found.append(f"{line}: from {module} import ...")
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if node.attr == "get_bind_params":
                found.append(f"{line}: .get_bind_params")
            elif dotted is not None and _private(dotted) and not _private(dotted.rsplit(".", 1)[0]):
                found.append(f"{line}: {dotted}")  # the shortest private path only
        elif isinstance(node, ast.Constant) and re.fullmatch(r"[A-Z]\w*Tracer", str(node.value)):
            found.append(f"{line}: {node.value!r}")
        if params and _key(node) in VERSIONED_PARAMS:
            found.append(f"{line}: parameter {_key(node)!r}")
    return found


def test_no_private_jax_name_outside_the_seam():
    modules = sorted(p for p in ROOT.rglob("*.py") if p != SEAM)
    assert len(modules) > 50
    found = {
        str(path.relative_to(ROOT)): v
        for path in modules
        if (v := violations(path.read_text(encoding="utf-8")))
    }
    assert not found, f"route these through divjac/jax/_compat.py: {found}"


def test_the_rule_finds_each_kind_of_private_use():
    """Each clause of the rule catches what it names (and leaves the public API alone)."""
    source = """
import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax._src.config import trace_context
import jaxlib
from jax import lax

def f(eqn, p):
    jax.core.Tracer, jax.interpreters.ad, jax.lax.scan, jnp.sin
    eqn.primitive.get_bind_params(eqn.params)
    eqn.params["num_consts"], p.get("call_jaxpr"), eqn.params["dimension_numbers"]
    type(p).__name__ == "BatchTracer", "a Tracer leaked"
"""
    found = [v.split(": ", 1)[1] for v in violations(source)]
    assert sorted(found) == sorted(
        [
            "from jax.extend import ...",
            "from jax._src.config import ...",
            "import jaxlib",
            "jax.core",
            "jax.interpreters",
            ".get_bind_params",
            "parameter 'num_consts'",
            "parameter 'call_jaxpr'",
            "'BatchTracer'",
        ]
    )
    # A module without JAX keeps its own parameters by those names (divjac._core's rules).
    assert violations("def rule(op):\n    return op.params['branches']\n") == []


def test_scan_parts_split_a_scans_operands():
    """``[*consts, *carry, *xs]``: the captured array, the closed-over argument and the loop
    input are constants, the carry read by the body is carried (the one passed through
    untouched is forwarded, not carried), on every JAX (0.12 describes them by flat trees)."""
    captured = jnp.arange(4.0)

    def f(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        def body(c, xi):
            return (c[0] * xi + w + captured, c[1]), (c[0], c[1] * 2)

        return jax.lax.scan(body, (x, x), jnp.ones((3, 4)), reverse=True)

    eqn = jax.make_jaxpr(f)(jnp.ones(4), jnp.ones(4)).jaxpr.eqns[-1]
    parts = _compat.scan_parts(eqn)
    assert (parts.n_consts, parts.n_carry, parts.length, parts.reverse) == (3, 1, 3, True)
    body, consts = _compat.open_jaxpr(parts.body)
    assert len(body.invars) == len(eqn.invars) and not consts
    assert eqn.invars[-1].aval.shape == (3, 4)


def test_a_program_without_its_constants_pins_none_and_rebuilds():
    """What the eager program cache keeps of a closed program holds no reference to its
    captured arrays (JAX 0.12's ``closed.jaxpr`` is the program itself, constants included)."""
    weights = jnp.arange(3.0) + 1.0
    alive = weakref.ref(weights)
    closed = jax.make_jaxpr(functools.partial(jnp.multiply, weights))(jnp.ones(3))
    bare, consts = _compat.without_consts(closed), list(closed.consts)
    want = _compat.jaxpr_as_fun(closed)(jnp.ones(3))
    got = _compat.jaxpr_as_fun(_compat.closed_jaxpr(bare, consts))(jnp.ones(3))
    np.testing.assert_allclose(got[0], want[0])
    del weights, closed, consts, want, got
    gc.collect()
    assert alive() is None, "the bare program keeps the captured array alive"
    assert bare is not None
