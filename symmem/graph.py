"""The operator graph: a node is the value it defines (as in torch.fx).

A :class:`Graph` is an ordered list of items: :class:`Node` (one operator, its
inputs, parameters and attributes, with the symbolic shape its rule gives) and
:class:`Repeat` (a body graph applied ``count`` times, ``count`` usually the
symbol ``L``: the body is analysed once). Parameters are :class:`Param`
objects; using the same ``Param`` twice ties the weight (it is counted once).

Shapes are inferred when a node is added, from the op's rule in
:mod:`symmem.rules`, so a wrong wiring fails at build time with a
:class:`~symmem.errors.ShapeError` naming the node.

Listing format (``str(graph)``)::

    name  op  (input, …)  shape  [params]

one line per node; a :class:`Repeat` is a line ``name  repeat x count  (carried)  shape``
followed by its body, indented four spaces. ``graph.describe(policy)`` adds, after a
node that saves tensors for backward, what it saves (from the rules, under ``policy``)::

    name  op  (input, …)  shape  [params]  saves: label[ = value] (numel x bytes), …
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import networkx as nx
import sympy as sp

from .errors import ConfigError, ShapeError

__all__ = ["Param", "Node", "Repeat", "Graph"]

Shape = tuple[sp.Expr, ...]


def _numel(shape: Shape) -> sp.Expr:
    return sp.Mul(*shape) if shape else sp.Integer(1)


@dataclass(frozen=True)
class Param:
    """A named trainable tensor. Tying = using the same Param object twice."""
    name: str
    shape: Shape

    @property
    def numel(self) -> sp.Expr:
        return _numel(self.shape)


@dataclass(frozen=True)
class Node:
    """One operator application; ``name`` is also the name of the value it defines."""
    name: str
    op: str
    inputs: tuple[str, ...]
    params: tuple[Param, ...] = ()
    attrs: tuple[tuple[str, object], ...] = ()
    shape: Shape = ()

    def attr(self, key: str, default=None):
        return dict(self.attrs).get(key, default)

    @property
    def numel(self) -> sp.Expr:
        return _numel(self.shape)


@dataclass(frozen=True)
class Repeat:
    """``body`` applied ``count`` times; its one carried input is ``carried``."""
    name: str
    count: sp.Expr
    body: "Graph"
    carried: str          # the outer value fed to the first iteration
    output: str           # the body's output value (fed to the next iteration)
    shape: Shape = ()

    @property
    def externals(self) -> tuple[str, ...]:
        return self.body.externals


@dataclass
class Graph:
    """A model's operator graph plus the numeric bindings of its symbols."""
    name: str
    bindings: dict = field(default_factory=dict)
    items: list = field(default_factory=list)
    parent: "Graph | None" = None
    externals: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    requirements: tuple = ()  # ((lhs, rhs, reason), …): lhs <= rhs must hold when evaluated
    _shapes: dict = field(default_factory=dict)
    _params: dict = field(default_factory=dict)
    _taken: set = field(default_factory=set)   # every value name, bodies included (shared)

    # ----- building ---------------------------------------------------------------
    def param(self, name: str, shape) -> Param:
        """Declare a parameter (a name may be declared once per graph)."""
        if name in self._params:
            raise ConfigError("parameter name", name, "a name not used before in this graph",
                              "Reuse the returned Param object to tie weights.")
        p = Param(name, tuple(sp.sympify(d) for d in shape))
        self._params[name] = p
        return p

    def input(self, name: str, shape, dtype: str = "int64", requires_grad: bool = False) -> str:
        """A tensor given to the model (token ids, labels; or a float tensor in tests)."""
        return self.add("input", name=name, shape=tuple(sp.sympify(d) for d in shape), dtype=dtype,
                        requires_grad=requires_grad)

    def add(self, op: str, *inputs: str, params=(), name: str | None = None, **attrs) -> str:
        """Add ``op`` applied to ``inputs``; returns the name of the value it defines."""
        from .rules import infer_shape  # rules import graph types; import late
        name = name or f"{op}_{len(self.items)}"
        if name in self._taken:
            raise ConfigError("node name", name, "a name not used before in this graph")
        shapes = []
        for i in inputs:
            sh = self._lookup_shape(i)
            if sh is None:
                raise ConfigError(f"input of node {name!r}", i, "the name of a value defined earlier in the graph")
            if i not in self._shapes and i not in self.externals:
                self.externals = self.externals + (i,)
            shapes.append(sh)
        node = Node(name, op, tuple(inputs), tuple(params), tuple(sorted(attrs.items())))
        shape = tuple(sp.sympify(d) for d in infer_shape(node, shapes))
        node = Node(node.name, op, node.inputs, node.params, node.attrs, shape)
        self.items.append(node)
        self._shapes[name] = shape
        self._taken.add(name)
        return name

    def require(self, lhs, rhs, reason: str) -> None:
        """Record that ``lhs <= rhs`` must hold for any values the model is evaluated at."""
        self.requirements = self.requirements + ((sp.sympify(lhs), sp.sympify(rhs), reason),)

    def output(self, value: str) -> str:
        """Mark ``value`` as returned by the forward pass (e.g. the logits in a model's
        output object): it stays alive until forward ends. The last node is the loss."""
        self.shape(value)
        self.outputs = self.outputs + (value,)
        return value

    def repeat(self, count, body: Callable[["Graph", str], str], x: str, name: str = "layers") -> str:
        """Apply ``body(graph, x) -> y`` ``count`` times (``count`` may be a symbol).

        The body is built once in a child graph; names inside it are local to it.
        Values of the enclosing graph that the body reads are kept alive across
        all iterations. Returns the name of the final output value (``name``).
        """
        if name in self._taken:
            raise ConfigError("repeat name", name, "a name not used before in this graph")
        count = sp.sympify(count)
        if count.is_number and not (count.is_integer and count > 0):
            raise ConfigError("repeat count", count, "a positive integer or a symbol")
        child = Graph(name=name, parent=self, _taken=self._taken)
        self._taken.update({name, f"{name}/in"})
        child._shapes[f"{name}/in"] = self._shapes[x]
        child.items.append(Node(f"{name}/in", "carry", (x,), shape=self._shapes[x]))
        y = body(child, f"{name}/in")
        if child._shapes.get(y) != self._shapes[x]:
            raise ShapeError(name, child._shapes.get(y), f"the body to return its input's shape {self._shapes[x]}")
        self.items.append(Repeat(name, count, child, x, y, self._shapes[x]))
        self._shapes[name] = self._shapes[x]
        return name

    def _lookup_shape(self, value: str):
        g = self
        while g is not None:
            if value in g._shapes:
                return g._shapes[value]
            g = g.parent
        return None

    # ----- reading ----------------------------------------------------------------
    def shape(self, value: str) -> Shape:
        sh = self._lookup_shape(value)
        if sh is None:
            raise ShapeError(self.name, value, "a value defined in this graph")
        return sh

    def params(self) -> list[tuple[Param, sp.Expr]]:
        """Distinct parameters with multiplicity (a Param in a repeated body counts ``count`` times)."""
        out: dict[str, tuple[Param, sp.Expr]] = {}
        for item in self.items:
            if isinstance(item, Repeat):
                for p, m in item.body.params():
                    mult = m * item.count if p.name in item.body._params else m
                    out.setdefault(p.name, (p, mult))
            else:
                for p in item.params:
                    out.setdefault(p.name, (p, sp.Integer(1)))
        return list(out.values())

    def param_count(self) -> sp.Expr:
        """Total trainable elements N (tied weights once)."""
        return sp.expand(sum((p.numel * m for p, m in self.params()), sp.Integer(0)))

    def unrolled(self) -> "Graph":
        """The same graph with every Repeat of a numeric count written out."""
        g = Graph(self.name, dict(self.bindings))
        for item in self.items:
            if isinstance(item, Node):
                g.items.append(item)
                g._shapes[item.name] = item.shape
                continue
            n = sp.sympify(item.count).subs(self.bindings)
            if not n.is_Integer:
                raise ConfigError("repeat count", item.count, "a number (bind it) to unroll")
            prev = item.carried
            for i in range(int(n)):
                ren = {f"{item.name}/in": prev}
                for node in item.body.items[1:]:
                    new = f"{item.name}.{i}/{node.name.split('/', 1)[1]}"
                    ren[node.name] = new
                    params = tuple(Param(f"{item.name}.{i}.{p.name}", p.shape)
                                   if p.name in item.body._params else p for p in node.params)
                    g.items.append(Node(new, node.op, tuple(ren.get(x, x) for x in node.inputs),
                                        params, node.attrs, node.shape))
                    g._shapes[new] = node.shape
                prev = ren[item.output]
            g.items.append(Node(item.name, "carry", (prev,), shape=item.shape))
            g._shapes[item.name] = item.shape
        g.outputs, g.requirements = self.outputs, self.requirements
        return g

    def peeled(self, name: str) -> "Graph":
        """The same graph with the first iteration of Repeat ``name`` written out (its
        parameters renamed ``name.0.*``) before a Repeat of ``count - 1`` iterations.

        For a block whose first iteration differs from the rest, e.g. one that turns its
        float32 input into bfloat16 under autocast: every later iteration is then alike.
        The result holds for ``count >= 2`` (recorded as a requirement)."""
        g = Graph(self.name, dict(self.bindings))
        for item in self.items:
            if not (isinstance(item, Repeat) and item.name == name):
                g.items.append(item)
                g._shapes[getattr(item, "name")] = item.shape
                continue
            ren = {f"{name}/in": item.carried}
            for node in item.body.items[1:]:
                new = f"{name}.0/{node.name.split('/', 1)[1]}"
                ren[node.name] = new
                params = tuple(Param(f"{name}.0.{p.name}", p.shape) if p.name in item.body._params else p
                               for p in node.params)
                g.items.append(Node(new, node.op, tuple(ren.get(x, x) for x in node.inputs),
                                    params, node.attrs, node.shape))
                g._shapes[new] = node.shape
            body = Graph(item.body.name, parent=g, externals=item.body.externals,
                         _shapes=item.body._shapes, _params=item.body._params)
            body.items = [Node(f"{name}/in", "carry", (ren[item.output],), shape=item.shape)] + item.body.items[1:]
            g.items.append(Repeat(name, item.count - 1, body, ren[item.output], item.output, item.shape))
            g._shapes[name] = item.shape
            g.require(2, item.count, f"the block {name!r} treats its first iteration differently "
                                     "(its input's dtype changes), so it is written out")
        g.outputs, g.requirements = self.outputs, self.requirements + g.requirements
        g._taken = set(g._shapes)
        return g

    def to_networkx(self) -> nx.DiGraph:
        """A DiGraph of values; a Repeat appears as one node with its body attached."""
        G = nx.DiGraph(name=self.name)
        for item in self.items:
            if isinstance(item, Repeat):
                G.add_node(item.name, op="repeat", count=item.count, body=item.body.to_networkx(),
                           shape=item.shape)
                for e in (item.carried,) + item.externals:
                    G.add_edge(e, item.name)
            else:
                G.add_node(item.name, op=item.op, shape=item.shape,
                           params=[p.name for p in item.params], attrs=dict(item.attrs))
                for i in item.inputs:
                    if i in self._shapes:
                        G.add_edge(i, item.name)
        return G

    def __str__(self) -> str:
        return "\n".join(self._lines(""))

    def _lines(self, indent: str):
        for item in self.items:
            if isinstance(item, Repeat):
                yield f"{indent}{item.name}  repeat x {item.count}  ({item.carried})  {_fmt(item.shape)}"
                yield from item.body._lines(indent + "    ")
            else:
                ps = f"  [{', '.join(p.name for p in item.params)}]" if item.params else ""
                yield f"{indent}{item.name}  {item.op}  ({', '.join(item.inputs)})  {_fmt(item.shape)}{ps}"

    # ----- display ----------------------------------------------------------------
    def describe(self, policy=None) -> str:
        """The listing of ``str(graph)`` with, after each node that saves tensors for
        backward, what it saves under ``policy`` (default ``Policy()``), from the rules::

            name  op  (input, …)  shape  [params]  saves: label[ = value] (numel x bytes), …

        ``= value`` names the graph value whose storage the saved tensor is (it costs no
        new memory); ``bytes`` is per element (``B_a`` until a precision binds it).
        A Repeat's body is listed once, indented, under ``name  repeat x count``."""
        saved = self._saved(policy)
        out = []
        for line, (_, item) in zip(self._lines(""), self._walk_items(0)):
            sv = saved.get(item.name) if isinstance(item, Node) else None
            out.append(line + ("  saves: " + ", ".join(_fmt_saved(*t) for t in sv) if sv else ""))
        return "\n".join(out)

    def _walk_items(self, depth: int):
        """(depth, item) in listing order (the order of ``_lines``)."""
        for item in self.items:
            yield depth, item
            if isinstance(item, Repeat):
                yield from item.body._walk_items(depth + 1)

    def _saved(self, policy=None) -> dict:
        """node name -> [(label, value or None, numel, bytes per element), …]: what each
        node's rule saves for backward under ``policy``, as the schedule prepares it (a
        Repeat's body once, with the carried input)."""
        from .policy import Policy
        from .schedule import _Prepared
        root = self
        while root.parent is not None:      # a body's inputs are defined by its parents
            root = root.parent
        prep = _Prepared(root, policy or Policy(), strict=False)
        out = {}
        for name, fp in prep.fp.items():
            node = prep.nodes[name]
            rows = []
            for sv in fp.saved:
                if sv.ref.startswith("in"):
                    v = node.inputs[int(sv.ref[2:])]
                    rows.append((sv.label, v, prep.info[v].numel, prep.info[v].dtype.nbytes))
                elif sv.ref == "out":
                    rows.append((sv.label, node.name, fp.out.numel, fp.out.dtype.nbytes))
                else:
                    rows.append((sv.label, None, sv.numel, sv.dtype.nbytes))
            out[name] = rows
        return out

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(f"Graph({self.name})" if cycle else self.describe())

    def _repr_html_(self) -> str:
        import html
        from .policy import Policy
        esc, policy = html.escape, Policy()
        saved = self._saved(policy)
        head = "".join(f"<th style='text-align:left'>{c}</th>"
                       for c in ("name", "op", "inputs", "shape", "params", "saves for backward"))
        rows = []
        for depth, item in self._walk_items(0):
            pad = f" style='text-align:left;padding-left:{0.5 + 1.5 * depth}em'"
            if isinstance(item, Repeat):
                cells = [f"<b>{esc(item.name)}</b>", f"repeat &times; {esc(str(item.count))}",
                         esc(item.carried), esc(_fmt(item.shape)), "", ""]
            else:
                sv = "<br>".join(esc(_fmt_saved(*t)) for t in saved.get(item.name, ()))
                cells = [esc(item.name), esc(item.op), esc(", ".join(item.inputs)), esc(_fmt(item.shape)),
                         esc(", ".join(p.name for p in item.params)), sv]
            rows.append(f"<tr><td{pad}>{cells[0]}</td>"
                        + "".join(f"<td style='text-align:left'>{c}</td>" for c in cells[1:]) + "</tr>")
        binds = ", ".join(f"{k} = {v}" for k, v in self.bindings.items())
        return (f"<div><p><b>{esc(self.name)}</b>" + (f" ({esc(binds)})" if binds else "")
                + f"; saved tensors under the default policy ({esc(policy.precision)}, "
                f"{esc(policy.device)}; <code>graph.describe(policy)</code> for another)</p>"
                f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>")


def _fmt(shape: Shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def _fmt_saved(label, value, numel, nbytes) -> str:
    """``label[ = value] (numel x bytes)``: one saved tensor in ``Graph.describe``."""
    return f"{label}{f' = {value}' if value else ''} ({numel} x {nbytes})"
