"""The operator graph: a node is the value it defines (as in torch.fx).

A :class:`Graph` is an ordered list of items: :class:`Node` (one operator, its
inputs, parameters and attributes, with the symbolic shape its rule gives) and
:class:`Repeat` (a body graph applied ``count`` times, ``count`` usually the
symbol ``L``: the body is analysed once). Parameters are :class:`Param`
objects; using the same ``Param`` twice ties the weight (it is counted once).
Buffers (:meth:`Graph.buffer`: rotary tables, running statistics) are tensors of the
model without gradient or optimizer state; inputs (:meth:`Graph.input`) are the batch.

A repeated block carries one value from iteration to iteration (the hidden states), or
several (``repeat(L, body, (x, bias))``); what its body reads from outside (an attention
mask, an encoder's output) is read by every iteration.

Attributes that policies read: a node's own (``g.add(..., key=value)``), those of a scope
(``with g.scope(recompute="attention"): ...`` gives every node added inside them), and
those of a range of layers of a repeated block (:meth:`Graph.annotate_layers`); passes
split a block where its layers' attributes differ (:meth:`Graph.split_layers`) or group
its layers (:meth:`Graph.grouped`).

Shapes are inferred when a node is added, from the op's rule in
:mod:`symmem.rules`, so a wrong wiring fails at build time with a
:class:`~symmem.errors.ShapeError` naming the node. :class:`Requirement` records what
must hold of the symbols for the formulas to hold (``s <= s_max``).

Listing format (``str(graph)``)::

    name  op  (input, …)  shape  [params]

one line per node; a :class:`Repeat` is a line ``name  repeat x count  (carried)  shape``
followed by its body, indented four spaces. ``graph.describe(policy)`` adds, after a
node that saves tensors for backward, what it saves (from the rules, under ``policy``)::

    name  op  (input, …)  shape  [params]  saves: label[ = value] (numel x bytes), …
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import sympy as sp

from .errors import ConfigError, ShapeError
from .requirements import Requirement
from .symbols import B_w

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["Param", "Node", "Repeat", "Graph", "Requirement"]

Shape = tuple[sp.Expr, ...]


def _numel(shape: Shape) -> sp.Expr:
    return sp.Mul(*shape) if shape else sp.Integer(1)


@dataclass(frozen=True)
class Param:
    """A named tensor of the model's weights. Tying = using the same Param object twice.
    ``trainable`` False: frozen (``requires_grad=False``): no gradient, no optimizer state,
    and the ops that read it save only what the other inputs' gradients need. ``dtype``
    None: stored in the precision's dtype for its role (priced ``B_w``, its gradient ``B_g``,
    its optimizer state ``B_o``); else a dtype of its own for all three (``"float32"``: peft's
    adapters in a half-precision model), or a quantized format of a frozen weight (``"int4"``,
    ``"int8"``: :mod:`symmem.policy.quantize`)."""
    name: str
    shape: Shape
    trainable: bool = True
    dtype: str | None = None

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
    """``body`` applied ``count`` times. Iteration ``i + 1`` receives what iteration ``i``
    returned (``output``, one value or several), the first receives ``carried`` from
    outside; the last's values are named ``names`` outside (the first is the Repeat's
    ``name``). ``layer_attrs``: ((start, stop, attrs), ...), attributes of a range of
    layers (iterations ``start`` to ``stop - 1``; ``stop`` None for the last)."""
    name: str
    count: sp.Expr
    body: "Graph"
    carried: tuple[str, ...]
    output: tuple[str, ...]
    shape: Shape = ()
    names: tuple[str, ...] = ()
    layer_attrs: tuple = ()

    @property
    def externals(self) -> tuple[str, ...]:
        return self.body.externals

    @property
    def carries(self) -> tuple[str, ...]:
        """The body's carry nodes, one per carried value, in order."""
        return tuple(n.name for n in self.body.items if isinstance(n, Node) and n.op == "carry")

    def layers_with(self, key: str):
        """((start, stop, value), ...) of the layer ranges that set attribute ``key``."""
        return tuple((a, z, dict(at)[key]) for a, z, at in self.layer_attrs if key in dict(at))

    @property
    def loop_of(self) -> str:
        """The block whose layers this block walks again (its body reads each layer's values
        through :meth:`Graph.recorded`: a Python loop over what an output recorder kept), or ""
        for a block of layers. Passes that act on layers (recomputation, layer ranges) leave
        such a loop alone."""
        return next((n.attr("block") for n in self.body.items if isinstance(n, Node) and n.op == "recorded"), "")


@dataclass
class Graph:
    """A model's operator graph plus the numeric bindings of its symbols."""
    name: str
    bindings: dict = field(default_factory=dict)
    items: list = field(default_factory=list)
    parent: "Graph | None" = None
    externals: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    requirements: tuple = ()  # (Requirement, …): must hold where the formulas are evaluated
    _shapes: dict = field(default_factory=dict)
    _params: dict = field(default_factory=dict)
    _taken: set = field(default_factory=set)   # every value name, bodies included (shared)
    _scope: dict = field(default_factory=dict)
    locals: tuple = ()        # ((value, until), …): a value the model's code keeps until a node ran
    attention: str | None = None   # the attention kernel the model asks for (a config's attn_implementation)
    # can its repeated blocks be checkpointed (transformers' gradient checkpointing)? A string:
    # every layer only (recompute="full"), and why no other mode is modelled
    checkpointing: bool | str = True

    # ----- building ---------------------------------------------------------------
    def param(self, name: str, shape, trainable: bool = True, dtype: str | None = None) -> Param:
        """Declare a parameter (a name may be declared once per graph)."""
        if name in self._params:
            raise ConfigError("parameter name", name, "a name not used before in this graph",
                              "Reuse the returned Param object to tie weights.")
        p = Param(name, tuple(sp.sympify(d) for d in shape), trainable, dtype)
        self._params[name] = p
        return p

    def input(self, name: str, shape, dtype: str = "int64", requires_grad: bool = False) -> str:
        """A tensor of the batch (token ids, labels, an attention mask; or a float tensor in
        tests): on the device for the whole step, as the training loop holds it."""
        return self.add("input", name=name, shape=tuple(sp.sympify(d) for d in shape), dtype=dtype,
                        requires_grad=requires_grad)

    def buffer(self, name: str, shape, dtype: str = "float32") -> str:
        """A tensor of the model that is not trained (a rotary table, running statistics):
        it exists for the whole step, with no gradient and no optimizer state."""
        return self.add("input", name=name, shape=tuple(sp.sympify(d) for d in shape), dtype=dtype,
                        requires_grad=False, buffer=True)

    def add(self, op: str, *inputs: str, params=(), name: str | None = None, **attrs) -> str:
        """Add ``op`` applied to ``inputs``; returns the name of the value it defines. The
        attributes of the enclosing scopes (:meth:`scope`) are added to ``attrs``."""
        from .rules import infer_shape
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
        attrs = {**self._scope, **attrs}
        node = Node(name, op, tuple(inputs), tuple(params), tuple(sorted(attrs.items())))
        shape = tuple(sp.sympify(d) for d in infer_shape(node, shapes))
        node = Node(node.name, op, node.inputs, node.params, node.attrs, shape)
        self.items.append(node)
        self._shapes[name] = shape
        self._taken.add(name)
        return name

    @contextlib.contextmanager
    def scope(self, **attrs):
        """Every node added inside ``with g.scope(key=value):`` gets these attributes (a
        recomputation region, a precision override); scopes nest."""
        saved = self._scope
        self._scope = {**saved, **attrs}
        try:
            yield self
        finally:
            self._scope = saved

    def hold(self, value: str, until: str) -> None:
        """``value`` stays referenced until node ``until`` has run, though nothing reads it in
        between: a local variable of the model's Python code (Hugging Face's ``causal_mask``
        lives until the base model returns). Both are values of this graph (of one block's
        body: then in every iteration)."""
        for v in (value, until):
            if v not in self._shapes:
                raise ConfigError("value to hold", v, f"a value defined in {self.name!r} itself")
        self.locals = self.locals + ((value, until),)

    def require(self, lhs, rhs, reason: str, kind: str = "at most") -> None:
        """Record that ``lhs <= rhs`` (or, ``kind="divides"``, that ``lhs`` divides ``rhs``)
        must hold for any values the model is evaluated at."""
        self.requirements = self.requirements + (Requirement(sp.sympify(lhs), sp.sympify(rhs), reason, kind),)

    def recorded(self, block: str, value: str, name: str) -> str:
        """``value`` of the repeated block ``block``, read again by the same iteration of the
        block this graph is the body of: a list a forward hook filled layer by layer, walked by a
        loop after the layers ran (transformers' output recorder keeps each layer's router
        logits; the load-balancing loss loops over them). The tensor itself: nothing allocated,
        its gradient handed to the layer's value. Both blocks must have the same count."""
        root = self
        while root.parent is not None:
            root = root.parent
        _, rep = root._repeat_item(block)
        shape = rep.body._shapes.get(value)
        if shape is None or any(n.name == value and n.op == "carry" for n in rep.body.items):
            raise ConfigError("recorded value", value, f"a value computed in the body of block {block!r}")
        return self.add("recorded", name=name, block=block, value=value, shape=shape)

    def output(self, value: str) -> str:
        """Mark ``value`` as returned by the forward pass (e.g. the logits in a model's
        output object): it stays alive until forward ends; in a repeated body, each iteration's
        (the router logits a recorder kept, :meth:`recorded`). The last node is the loss."""
        self.shape(value)
        self.outputs = self.outputs + (value,)
        return value

    def repeat(self, count, body: Callable, x, name: str = "layers"):
        """Apply ``body(graph, x) -> y`` ``count`` times (``count`` may be a symbol).

        ``x`` is a value's name, or a tuple of names for a block that carries several values
        (then ``body`` receives and returns tuples of the same length). The body is built
        once in a child graph; values of the enclosing graph that it reads are kept alive
        across all iterations. Returns the name of the final output (``name``), or a tuple
        of names (``name``, ``name.1``, ...) for several."""
        if name in self._taken:
            raise ConfigError("repeat name", name, "a name not used before in this graph")
        count = sp.sympify(count)
        if count.is_number and not (count.is_integer and count > 0):
            raise ConfigError("repeat count", count, "a positive integer or a symbol")
        several = isinstance(x, (tuple, list))
        xs = tuple(x) if several else (x,)
        for v in xs:
            if self._lookup_shape(v) is None:
                raise ConfigError(f"input of repeat {name!r}", v, "the name of a value defined earlier in the graph")
        names = tuple(name if i == 0 else f"{name}.{i}" for i in range(len(xs)))
        for n in names[1:]:
            if n in self._taken:
                raise ConfigError("repeat output name", n, "a name not used before in this graph")
        child = Graph(name=name, parent=self, _taken=self._taken)
        carries = tuple(f"{name}/in" if i == 0 else f"{name}/in{i}" for i in range(len(xs)))
        self._taken.update(names + carries)
        for i, (v, c) in enumerate(zip(xs, carries)):
            child._shapes[c] = self._lookup_shape(v)
            child.items.append(Node(c, "carry", (v,), attrs=(("index", i),), shape=child._shapes[c]))
        ys = body(child, carries if several else carries[0])
        ys = tuple(ys) if several else (ys,)
        if len(ys) != len(xs):
            raise ShapeError(name, f"{len(ys)} values", f"the body to return as many values as it receives ({len(xs)})")
        for v, y in zip(xs, ys):
            if child._shapes.get(y) != self._lookup_shape(v):
                raise ShapeError(name, child._shapes.get(y), f"the body to return its input's shape {self._lookup_shape(v)}")
        rep = Repeat(name, count, child, xs, ys, self._lookup_shape(xs[0]), names)
        if rep.loop_of:        # a loop over a block's layers: as many iterations as it has layers
            _, layers = self._repeat_item(rep.loop_of)
            if sp.expand(layers.count - count) != 0:
                raise ConfigError(f"count of repeat {name!r}", count, f"the count of the block it walks, "
                                  f"{rep.loop_of!r} ({layers.count})")
        self.items.append(rep)
        for n, v in zip(names, xs):
            self._shapes[n] = self._lookup_shape(v)
        return names if several else names[0]

    def annotate_layers(self, block: str, start: int, stop: int | None = None, **attrs) -> None:
        """Give layers ``start`` to ``stop - 1`` of the repeated block ``block`` attributes
        (``stop`` None: to the last layer), e.g. ``checkpoint=True``; passes read them."""
        i, rep = self._repeat_item(block)
        if not (isinstance(start, int) and start >= 0 and (stop is None or (isinstance(stop, int) and stop > start))):
            raise ConfigError("layer range", (start, stop), "0 <= start < stop (stop None for the last layer)")
        self.items[i] = replace(rep, layer_attrs=rep.layer_attrs + ((start, stop, tuple(sorted(attrs.items()))),))

    def _repeat_item(self, block: str):
        for i, item in enumerate(self.items):
            if isinstance(item, Repeat) and item.name == block:
                return i, item
        blocks = tuple(item.name for item in self.items if isinstance(item, Repeat))
        from .errors import UnknownName
        raise UnknownName("repeated block", block, blocks)

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

    def param_count(self, trainable_only: bool = False) -> sp.Expr:
        """Total parameter elements N (tied weights once); ``trainable_only``: those not frozen."""
        return sp.expand(sum((p.numel * m for p, m in self.params() if p.trainable or not trainable_only),
                             sp.Integer(0)))

    def buffers(self) -> list[tuple[Node, sp.Expr]]:
        """Buffer nodes with multiplicity (one in a repeated body counts ``count`` times)."""
        out = []
        for item in self.items:
            if isinstance(item, Repeat):
                out += [(n, m * item.count) for n, m in item.body.buffers()]
            elif item.op == "input" and item.attr("buffer"):
                out.append((item, sp.Integer(1)))
        return out

    def repeats(self) -> list[Repeat]:
        """The repeated blocks, in order."""
        return [item for item in self.items if isinstance(item, Repeat)]

    def layer_blocks(self) -> list[Repeat]:
        """The repeated blocks of layers, in order: the repeats but the loops over what a block's
        layers recorded (:attr:`Repeat.loop_of`)."""
        return [rep for rep in self.repeats() if not rep.loop_of]

    def nodes(self):
        """Every node, those of the repeated bodies included (each once)."""
        return (n for g in self.graphs() for n in g.items if isinstance(n, Node))

    # ----- rewriting: new graphs, this one unchanged ------------------------------
    def _copy(self, items) -> "Graph":
        g = Graph(self.name, dict(self.bindings))
        for item in items:
            g.items.append(item)
            for n, sh in _defines(item):
                g._shapes[n] = sh
        g.outputs, g.requirements, g.locals = self.outputs, self.requirements, self.locals
        g.attention, g.checkpointing = self.attention, self.checkpointing
        g._taken = set(g._shapes) | self._taken
        return g

    def rewritten(self, rewrite: Callable) -> "Graph":
        """This graph with each node handed to ``rewrite(node, sub)`` (bodies of repeated
        blocks included), as torch.fx's transformer rewrites a graph. A rewrite that returns
        True has replaced the node: it added the replacement to ``sub`` (a scratch graph that
        sees every value defined before the node; the replacement's last node takes the
        node's name and shape, and ``sub.hold`` keeps values as :meth:`hold` does) or, adding
        nothing, removed the node. A node that still reads a removed value is an error; the
        holds of removed values go with them."""
        return self._rewritten(rewrite, None, set())

    def _rewritten(self, rewrite, parent, removed: set) -> "Graph":
        g = Graph(self.name, dict(self.bindings), parent=parent, externals=self.externals,
                  outputs=self.outputs, requirements=self.requirements, attention=self.attention,
                  checkpointing=self.checkpointing)
        g._taken = set(self._taken) if parent is None else parent._taken
        g._params = dict(self._params)
        holds = list(self.locals)
        for item in self.items:
            if isinstance(item, Repeat):
                body = item.body._rewritten(rewrite, g, removed)
                body.externals = tuple(x for x in item.body.externals if x not in removed)
                item = replace(item, body=body)
            else:
                sub = _Scratch(self.name, parent=g)
                if rewrite(item, sub):
                    if sub.items and (sub.items[-1].name, sub.items[-1].shape) != (item.name, item.shape):
                        raise ShapeError(item.name, sub.items[-1].shape,
                                         f"a replacement whose last node is {item.name!r} of shape {item.shape}")
                    if not sub.items:
                        removed.add(item.name)
                    g._params.update(sub._params)      # parameters the replacement declared
                    for n in sub.items:
                        if n.name != item.name and n.name in g._taken:
                            raise ConfigError("node name", n.name, "a name not used before in this graph")
                        g.items.append(n)
                        g._shapes[n.name] = n.shape
                        g._taken.add(n.name)
                    holds += sub.locals
                    continue
                reads = [x for x in item.inputs if x in removed]
                if reads:
                    raise ConfigError(f"input of node {item.name!r}", reads[0], "a value the rewrite kept")
            g.items.append(item)
            for n, sh in _defines(item):
                g._shapes[n] = sh
        g.locals = tuple((v, u) for v, u in holds if v not in removed and u not in removed)
        for v, u in g.locals:
            for x in (v, u):
                if x not in g._shapes:
                    raise ConfigError("value to hold", x, f"a value defined in {self.name!r} itself")
        return g

    def with_params(self, fn: Callable) -> "Graph":
        """This graph with every parameter ``p`` replaced by ``fn(p)`` (a frozen copy, say),
        in its nodes and its repeated bodies; tied weights stay tied (``fn`` sees one name)."""
        cache: dict = {}

        def new(p):
            if p.name not in cache:
                cache[p.name] = fn(p)
            return cache[p.name]

        def rewrite(node, sub) -> bool:
            if not node.params:
                return False
            sub.items.append(replace(node, params=tuple(new(p) for p in node.params)))
            return True

        out = self.rewritten(rewrite)
        for g in out.graphs():
            g._params = {n: new(p) for n, p in g._params.items()}
        return out

    def graphs(self):
        """This graph and every repeated body in it, nested ones too."""
        yield self
        for item in self.items:
            if isinstance(item, Repeat):
                yield from item.body.graphs()

    def unrolled(self) -> "Graph":
        """The same graph with every Repeat of a numeric count written out. Each node of
        iteration ``i`` of block ``name`` gets the attribute ``layer="name.i"`` and the
        attributes of the layer ranges holding ``i``, so that passes see the same layers."""
        items, locals_ = [], ()
        for item in self.items:
            if isinstance(item, Node):
                items.append(item)
                continue
            n = sp.sympify(item.count).subs(self.bindings)
            if not n.is_Integer:
                raise ConfigError("repeat count", item.count, "a number (bind it) to unroll")
            prev, held = item.carried, ()
            for i in range(int(n)):
                nodes, prev, kept = _renamed_body(item, f"{item.name}.{i}", f"{item.name}.{i}.", prev)
                held += kept
                extra = {"layer": f"{item.name}.{i}"}
                for start, stop, attrs in item.layer_attrs:
                    stop = n if stop is None else sp.sympify(stop).subs(self.bindings)
                    if start <= i < stop:
                        extra.update(dict(attrs))
                items += [replace(nd, attrs=tuple(sorted({**dict(nd.attrs), **extra}.items()))) for nd in nodes]
            items += [Node(n_, "carry", (p,), shape=self._shapes[n_]) for n_, p in zip(item.names, prev)]
            locals_ += held
        g = self._copy(items)
        g.locals = g.locals + locals_
        return g

    def with_bound_counts(self) -> "Graph":
        """The same graph with each repeated block's count replaced by its bound value (its
        iterations then written out where fewer than three), and a requirement that the
        count symbols keep those values."""
        items, reqs = [], []
        for item in self.items:
            if isinstance(item, Repeat):
                n = sp.sympify(sp.sympify(item.count).xreplace(self.bindings))
                if n.is_Integer and n != item.count:
                    for x in sp.sympify(item.count).free_symbols:
                        v = sp.sympify(self.bindings.get(x, x))
                        reqs += [Requirement(x, v, f"the formulas were derived for {x} = {v} layers"),
                                 Requirement(v, x, f"the formulas were derived for {x} = {v} layers")]
                    item = replace(item, count=n)
            items.append(item)
        g = self._copy(items)
        g.requirements = g.requirements + tuple(dict.fromkeys(reqs))
        return g

    def with_shared_layers(self, block: str) -> "Graph":
        """The layers of the repeated block ``block`` share one set of weights, as ALBERT's
        do (Lan et al. 2019): its parameters are counted once, not once per layer; each
        layer still computes, and saves for backward, its own activations, and backward
        sums the layers' gradients into one per weight."""
        i, rep = self._repeat_item(block)
        body = replace(rep.body, items=list(rep.body.items), _shapes=dict(rep.body._shapes), _params={})
        clash = [n for n in rep.body._params if n in self._params]
        if clash:
            raise ConfigError("parameter name", clash[0], f"a name the block {block!r} does not share with "
                              "the rest of the model")
        g = self._copy(self.items[:i] + [replace(rep, body=body)] + self.items[i + 1:])
        g._params = {**self._params, **rep.body._params}
        return g

    def split_layers(self, block: str, at) -> "Graph":
        """The block ``block`` as consecutive blocks split before each layer index in ``at``
        (numbers, or expressions in the block's count): block ``name[a:z]`` holds layers
        a to z - 1 and its own copy of the body (names prefixed by ``name[a:z]/``); the
        last values keep the block's names. Each part holds at least one layer (recorded
        as requirements). The parts carry no layer attributes: the caller knows which part
        is which range."""
        i, rep = self._repeat_item(block)
        bounds = [sp.Integer(0)] + [sp.sympify(a) for a in at] + [rep.count]
        items, prev, reqs = [], rep.carried, []
        for a, z in zip(bounds, bounds[1:]):
            part = Graph.part_name(block, a, z, rep.count)
            body, outputs = _body_copy(rep, part, prev)
            items.append(Repeat(part, sp.expand(z - a), body, prev, outputs, rep.shape,
                                tuple(f"{part}" if k == 0 else f"{part}.{k}" for k in range(len(rep.names)))))
            prev = items[-1].names
            reqs.append(Requirement(sp.expand(a + 1), z, f"the part {part!r} of block {block!r} holds a layer"))
        items += [Node(n_, "carry", (p,), shape=self._shapes[n_]) for n_, p in zip(rep.names, prev)]
        g = self._copy(self.items[:i] + items + self.items[i + 1:])
        g.requirements = g.requirements + tuple(r for r in reqs if not (r.lhs - r.rhs).is_number)
        return g

    @staticmethod
    def part_name(block: str, a, z, count) -> str:
        """The name :meth:`split_layers` gives the part of ``block`` holding layers a to z - 1."""
        return f"{block}[{_fmt_index(a, count)}:{_fmt_index(z, count)}]"

    def grouped(self, block: str, k: int) -> "Graph":
        """The block ``block`` with ``k`` consecutive layers as one iteration: a block of
        ``count / k`` iterations whose body is ``k`` layers (values ``name/j:...`` for the
        ``j``-th). ``k`` must divide the count (recorded as a requirement)."""
        i, rep = self._repeat_item(block)
        body = Graph(rep.body.name, parent=self, externals=rep.body.externals)
        body._taken = self._taken
        carries = [n for n in rep.body.items if isinstance(n, Node) and n.op == "carry"]
        body.items = list(carries)
        for c in carries:
            body._shapes[c.name] = c.shape
        prev = tuple(c.name for c in carries)
        for j in range(k):
            nodes, prev, kept = _renamed_body(rep, f"{rep.name}/{j}", f"{j}.", prev)
            body.locals += kept
            body.items += nodes
            for n in nodes:
                body._shapes[n.name] = n.shape
            body._params.update({f"{j}.{p.name}": replace(p, name=f"{j}.{p.name}") for p in rep.body._params.values()})
        new = Repeat(rep.name, sp.expand(rep.count / k), body, rep.carried, prev, rep.shape, rep.names)
        g = self._copy(self.items[:i] + [new] + self.items[i + 1:])
        g.require(k, rep.count, f"the block {block!r} is recomputed {k} layers at a time", kind="divides")
        return g

    def to_networkx(self) -> "nx.DiGraph":
        """A DiGraph of values; a Repeat appears as one node with its body attached."""
        import networkx as nx      # only here: importing it costs a tenth of a second
        G = nx.DiGraph(name=self.name)
        for item in self.items:
            if isinstance(item, Repeat):
                G.add_node(item.name, op="repeat", count=item.count, body=item.body.to_networkx(),
                           shape=item.shape)
                for e in item.carried + item.externals:
                    G.add_edge(e, item.name)
                for n in item.names[1:]:
                    G.add_node(n, op="output", shape=self._shapes[n])
                    G.add_edge(item.name, n)
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
                yield f"{indent}{item.name}  repeat x {item.count}  ({', '.join(item.carried)})  {_fmt(item.shape)}"
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
        A Repeat's body is listed once, indented, under ``name  repeat x count``. An
        ``attention`` node is listed as the model wrote it: what it saves depends on the
        attention kernel, whose operators replace it in ``estimate(graph, policy).prepared``."""
        saved = self._saved(policy)
        out = []
        for line, (_, item) in zip(self._lines(""), self._walk_items(0)):
            sv = saved.get(item.name) if isinstance(item, Node) else None
            if isinstance(item, Node) and item.op == "attention":
                line += "  saves: what its kernel saves (est.prepared.describe() lists the kernel's operators)"
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
        node's rule saves for backward under ``policy`` (a Repeat's body in its first
        iteration), from :func:`symmem.footprints.trace`."""
        from .footprints import trace
        from .policy import Policy
        root = self
        while root.parent is not None:      # a body's inputs are defined by its parents
            root = root.parent
        tr = trace(root, policy or Policy(), strict=False)
        out = {}
        for inst in tr.instances():
            if inst.copy > 1 or inst.node.name in out:
                continue
            rows = []
            for sv in inst.fp.saved:
                if sv.ref.startswith("in"):
                    v = inst.inputs[int(sv.ref[2:])]
                    info = tr.info[v]
                    rows.append((sv.label, inst.node.inputs[int(sv.ref[2:])], info.numel, info.dtype.nbytes))
                elif sv.ref.startswith("param:"):
                    prm = inst.node.params[int(sv.ref[6:])]
                    rows.append((sv.label, prm.name, prm.numel, B_w))
                elif sv.ref == "out":
                    rows.append((sv.label, inst.node.name, inst.fp.out.numel, inst.fp.out.dtype.nbytes))
                else:
                    rows.append((sv.label, None, sv.numel, sv.dtype.nbytes))
            out[inst.node.name] = rows
        return out

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(f"Graph({self.name})" if cycle else self.describe())

    def _repr_html_(self) -> str:
        from .policy import Policy
        from .printing import html_escape as esc, html_table, values_text
        policy = Policy()
        saved = self._saved(policy)
        rows, depths = [], []
        for depth, item in self._walk_items(0):
            if isinstance(item, Repeat):
                rows.append([f"<b>{esc(item.name)}</b>", f"repeat &times; {esc(str(item.count))}",
                             esc(", ".join(item.carried)), esc(_fmt(item.shape)), "", ""])
            else:
                sv = "<br>".join(esc(_fmt_saved(*t)) for t in saved.get(item.name, ()))
                rows.append([esc(item.name), esc(item.op), esc(", ".join(item.inputs)), esc(_fmt(item.shape)),
                             esc(", ".join(p.name for p in item.params)), sv])
            depths.append(depth)
        binds = values_text(self.bindings)
        return (f"<div><p><b>{esc(self.name)}</b>" + (f" ({esc(binds)})" if binds else "")
                + f"; saved tensors under the default policy ({esc(policy.precision)}, "
                f"{esc(policy.device)}; <code>graph.describe(policy)</code> for another)</p>"
                + html_table(("name", "op", "inputs", "shape", "params", "saves for backward"), rows, indent=depths)
                + "</div>")


class _Scratch(Graph):
    """Where :meth:`Graph.rewritten` builds one node's replacement: names are checked
    against the whole graph's, holds may name a node defined later (the replacement
    cannot see it yet)."""

    def __init__(self, name, parent):
        super().__init__(name, parent=parent)

    def hold(self, value: str, until: str) -> None:
        self.locals = self.locals + ((value, until),)


def _fmt(shape: Shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def _fmt_saved(label, value, numel, nbytes) -> str:
    """``label[ = value] (numel x bytes)``: one saved tensor in ``Graph.describe``."""
    return f"{label}{f' = {value}' if value else ''} ({numel} x {nbytes})"


def _defines(item):
    """(name, shape) of the values an item defines outside itself."""
    if isinstance(item, Repeat):
        return [(n, item.body._lookup_shape(o)) for n, o in zip(item.names, item.output)]
    return [(item.name, item.shape)]


def _renamed_body(rep: Repeat, prefix: str, param_prefix: str, carried: tuple, sep: str = "/"):
    """The body of ``rep`` written out once: value ``name/x`` renamed ``prefix/x`` (with
    ``sep`` between), and so is an attribute naming one (``weights_until``); its parameters
    ``param_prefix + name``, its carry nodes reading ``carried``. Returns the nodes, the
    names of the copy's outputs and the body's held locals (:meth:`Graph.hold`) renamed."""
    ren = dict(zip(rep.carries, carried))
    for node in rep.body.items:
        if node.name not in ren:
            ren[node.name] = prefix + sep + (node.name.split("/", 1)[1] if "/" in node.name else node.name)
    nodes = []
    for node in rep.body.items:
        if node.name in rep.carries:
            continue
        params = tuple(replace(p, name=param_prefix + p.name) if p.name in rep.body._params else p
                       for p in node.params)
        attrs = tuple((k, ren.get(v, v) if isinstance(v, str) else v) for k, v in node.attrs)
        nodes.append(Node(ren[node.name], node.op, tuple(ren.get(x, x) for x in node.inputs), params, attrs,
                          node.shape))
    return nodes, tuple(ren[o] for o in rep.output), tuple((ren[v], ren[u]) for v, u in rep.body.locals)


def _body_copy(rep: Repeat, name: str, inputs: tuple) -> "Graph":
    """A copy of ``rep``'s body for a block called ``name`` that receives ``inputs``:
    values and carry nodes renamed ``name/...``, parameters ``name.param``. Returns the body
    and the names of its outputs."""
    body = Graph(name, parent=rep.body.parent, externals=rep.body.externals)
    carried = tuple(name + c[len(rep.name):] for c in rep.carries)
    body.items = [Node(c, "carry", (x,), attrs=n.attrs, shape=n.shape)
                  for c, x, n in zip(carried, inputs, [n for n in rep.body.items if n.name in rep.carries])]
    nodes, outputs, body.locals = _renamed_body(rep, name, f"{name}.", carried)
    body.items += nodes
    for n in body.items:
        body._shapes[n.name] = n.shape
    body._params = {p.name: p for n in nodes for p in n.params if p.name.startswith(f"{name}.")}
    return body, outputs


def _fmt_index(x, count) -> str:
    """A layer index in a part's name: empty for the first (0) and for the count."""
    x = sp.sympify(x)
    return "" if x == 0 or sp.expand(x - count) == 0 else str(x)
