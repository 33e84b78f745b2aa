"""Tensor and sequence parallelism (Megatron-LM): the plan of one tensor-parallel rank.

Megatron splits each transformer layer over ``t`` ranks (Shoeybi et al. 2019; Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4):

- **Column-parallel** linears (the query, key and value projections, the MLP's first layers:
  ``c_attn``, ``q_proj``, ``gate_proj``, ``up_proj``, ``fc1``, ``wi`` ...) keep ``1/t`` of their
  output features: weight and bias ``/ t``, their output ``/ t``.
- **Row-parallel** linears (the attention output and the MLP's last layer: ``c_proj``,
  ``o_proj``, ``down_proj``, ``fc2``, ``wo`` ...) keep ``1/t`` of their input features: weight
  ``/ t``, the bias whole; their output is all-reduced, whole on every rank.
- Everything between them (the heads, ``a / t`` of them, and everything attention keeps of
  them, the MLP's activation) is ``/ t``; the rest of the layer (norms, dropout masks,
  residuals, the column-parallel layers' input) is whole on every rank. Per layer, with
  2-byte activations: ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` (their Table 2).
- The vocabulary is split too (``VocabParallelEmbedding``, a column-parallel output layer,
  the cross entropy on ``V / t`` logits): every parameter with ``V`` rows and every value of
  width ``V`` after the output layer is ``/ t``.

**Sequence parallelism** (``sp``) splits the rest of the layer along the sequence: every
value of the layer is then ``/ t`` (``34*s*b*h/t + 5*a*s^2*b/t``, Table 2). Each
column-parallel layer all-gathers its input (a whole ``b*s*h`` buffer while it runs, again
in its backward; it saves the shard), each row-parallel layer reduce-scatters its output (a
whole buffer while it runs) and all-gathers its output's gradient in backward. The layers'
input (the embeddings' output, scattered along the sequence) is split too; the rest outside
the layers is as without ``sp``.

The rules trace the whole layer; :func:`apply` divides the bytes of one rank: the split
parameters' storages (weights, gradients, master copy, optimizer states, autocast copies; the
optimizer's temporaries recomputed from the split shapes), the split nodes' values, saved
tensors and gradients, and their scratch (a split linear's term by term: its input's gradient,
its weight's and its bias's).
The degree stays the symbol ``t`` (bound where it is a number). Beside data parallelism each
tensor-parallel rank is what ZeRO and FSDP shard (:mod:`symmem.passes.shard`, which runs after
this pass): its own parameters (:func:`local_shapes`) are what ZeRO-3 and FSDP gather and pad
(torchtitan's FSDP2 over the data-parallel dimension of a 2-D mesh). Assumed: the linears named
below are split as Megatron (or ``torch.distributed.tensor.parallel``'s ColwiseParallel /
RowwiseParallel plan) splits them; a fused QKV projection gathers its input once, separate
ones each gather it (the same bytes at the moment of the peak). T5's relative position bias
(one table of ``a`` heads) and a mixture of experts' experts (expert parallelism splits
those) are counted whole.
"""
from __future__ import annotations

from dataclasses import replace

import sympy as sp

from ..errors import ConfigError
from ..graph import Node, Param, Repeat
from ..plan import Alloc, Backward, Compute, Free, Key, Mark, Plan, flat
from ..requirements import Requirement
from ..symbols import BYTE_SYMBOLS, V, a, k, t

__all__ = ["prepare", "apply", "COLUMN", "ROW", "sharded_nodes", "local_shapes"]

#: Module names (the end of a parameter's name before ``.weight``/``.bias``) of the
#: column-parallel linears, as Megatron and the models' tensor-parallel plans split them.
COLUMN = ("c_attn", "c_fc", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "query_key_value",
          "dense_h_to_4h", "fc1", "query", "key", "value", "intermediate.dense", "q", "k", "v",
          "wi", "wi_0", "wi_1", "w1", "w3")
#: ... and of the row-parallel ones (a longer name is matched first: BERT's
#: ``attention.output.dense`` and ``output.dense`` are row-parallel, ``intermediate.dense`` column).
ROW = ("c_proj", "o_proj", "down_proj", "out_proj", "dense_4h_to_h", "fc2", "attention.dense",
       "attention.output.dense", "output.dense", "o", "wo", "w2")
_LINEAR = ("linear",)
#: Keys of the parameters' own storages, named by the parameter: split where it is.
_PARAM_KINDS = ("param", "grad", "master", "state", "step", "cast", "gathered", "prefetched")
_BYTES = frozenset(BYTE_SYMBOLS)


def _module(p: Param) -> str:
    return p.name.rsplit(".", 1)[0] if p.name.endswith((".weight", ".bias")) else p.name


def _kind(node: Node) -> str | None:
    """"column", "row" or None for a node of a repeated block."""
    if node.op not in _LINEAR or not node.params:
        return None
    module = _module(node.params[0])
    for kind, names in (("row", ROW), ("column", COLUMN)):
        for name in sorted(names, key=len, reverse=True):
            if module == name or module.endswith("." + name):
                return kind
    return None


def _check(graph, policy) -> None:
    par = policy.parallel
    if par.offload_params:
        raise ConfigError("tp", str(par.tp), "1 with parameter offload (offloaded shards of split parameters "
                          "are not modelled yet)", "Leave --tp out, or offload the optimizer only.")
    if not sharded_nodes(graph)[1]:
        raise ConfigError("tp", str(policy.parallel.tp), f"1 for {graph.name}: it has no attention or MLP "
                          "layer that Megatron splits (symmem.passes.tensor.COLUMN, ROW)", "Leave --tp out.")
    for name, on in (("lora", policy.lora), ("quantize", policy.quantize != "none"), ("fp8", policy.prec.fp8)):
        if on:
            raise ConfigError("tp", str(policy.parallel.tp), f"1 with {name} (tensor parallelism of "
                              f"{name} layers is not modelled yet)", f"Leave --tp or --{name} out.")


def _blocks(graph):
    for item in graph.items:
        if isinstance(item, Repeat):
            yield item
            yield from _blocks(item.body)


def sharded_nodes(graph) -> tuple[set, dict, set]:
    """(the nodes whose values are split over the tensor-parallel ranks, {node: "column" |
    "row"} for the split linears (the layers' and the output layer), the names of every node
    of the repeated blocks).
    Inside a block: each column-parallel linear and whatever depends on it up to the
    row-parallel linears; outside: the output layer (a linear of width ``V``) and the values
    of width ``V`` after it."""
    split, kinds, inside = set(), {}, set()
    for rep in _blocks(graph):
        body = [n for n in rep.body.items if isinstance(n, Node)]
        inside.update(n.name for n in body)
        kinds.update({n.name: kind for n in body if (kind := _kind(n))})
        region = {n.name for n in body if kinds.get(n.name) == "column"}
        for n in body:                       # in order: a node reading the region joins it
            if n.name not in region and kinds.get(n.name) != "row" and any(i in region for i in n.inputs):
                region.add(n.name)
        if rep.body.outputs and region & set(rep.body.outputs):
            raise ConfigError("tp", "a layer", "row-parallel layers closing every column-parallel one",
                              f"{sorted(region & set(rep.body.outputs))[0]!r} leaves the layer split: "
                              "this model's linears are not all named in symmem.passes.tensor.")
        split |= region
    vocab = set()
    for n in graph.items:
        if not isinstance(n, Node):
            continue
        wide = bool(n.shape) and n.shape[-1] == V
        if wide and (n.op in _LINEAR or any(i in vocab for i in n.inputs)):
            vocab.add(n.name)
            if n.op in _LINEAR:             # the output layer: column-parallel over the vocabulary
                kinds[n.name] = "column"
    return split | vocab, kinds, inside


def prepare(graph, policy):
    """The graph as it is (the rules trace whole shapes; :func:`apply` divides the bytes),
    after refusing what is not modelled with tensor parallelism."""
    if policy.parallel.splits("tp"):
        _check(graph, policy)
    return graph


def local_shapes(graph) -> dict:
    """{parameter name: its shape on one tensor-parallel rank} for every split parameter (what
    ZeRO-3 and FSDP then shard and gather)."""
    return _split_params(graph, sharded_nodes(graph)[1])


def _split_params(graph, kinds: dict) -> dict:
    """{parameter name: its shape on one rank} for every split parameter: a column-parallel
    linear's weight (output rows) and bias, a row-parallel one's weight (input columns), and
    every parameter with ``V`` rows (the vocabulary)."""
    out = {}
    for rep in _blocks(graph):
        for n in rep.body.items:
            if not (isinstance(n, Node) and n.name in kinds):
                continue
            conv1d = bool(n.attr("conv1d"))     # GPT-2's Conv1D keeps its weight (in, out)
            for p in n.params:
                if p.name.endswith(".bias"):
                    if kinds[n.name] == "column":
                        out[p.name] = (p.shape[0] / t,) + tuple(p.shape[1:])
                    continue
                dim = (1 if conv1d else 0) if kinds[n.name] == "column" else (0 if conv1d else 1)
                out[p.name] = tuple(x / t if i == dim else x for i, x in enumerate(p.shape))
    for p, _ in graph.params():
        if p.shape and V in p.shape and p.name not in out:
            out[p.name] = tuple(x / t if x == V else x for x in p.shape)
    return out


def apply(plan: Plan, graph, policy) -> Plan:
    if not policy.parallel.splits("tp"):
        return plan
    split, kinds, inside = sharded_nodes(graph)
    shapes = _split_params(graph, kinds)
    sp_on = policy.parallel.sp
    # under sp, the layers' input (the embeddings' output, scattered along the sequence) too
    entering = {x for rep in _blocks(graph) for x in rep.carried}
    scaled = split | (inside | entering if sp_on else set())
    computes = {(e.node, e.copy): e for e in _forward(plan) if isinstance(e, Compute)}
    sizes = {e.out: e.out_bytes for e in computes.values() if e.out is not None}

    def split_input(node: str) -> bool:
        """A split linear's input: split for a row-parallel one, and for every one under sp
        (the column-parallel layer keeps the sequence shard it gathers from)."""
        return kinds[node] == "row" or sp_on

    def div(key: Key, nbytes):
        """A storage's bytes on one rank."""
        if key.kind in _PARAM_KINDS:
            return nbytes / t if key.name in shapes and key.kind != "step" else nbytes
        if key.kind == "scalar":        # a Python number autograd keeps: whole on every rank
            return nbytes
        node = _node_of(key.name)
        if key.kind == "saved" and node in kinds:    # a split linear's saved input
            return nbytes / t if split_input(node) else nbytes
        return nbytes / t if node in scaled else nbytes

    def extra(node: str, label: str, x):
        """A moment's scratch: a split linear's by its terms, another node's whole."""
        if node not in kinds:
            return x / t if node in scaled else x
        return _linear_scratch(x, kinds[node], bias_only="bias" in label)

    def event(e, group=None):
        if isinstance(e, Compute):
            if e.node in kinds:
                temp = e.temp / t if split_input(e.node) else e.temp
            else:
                temp = e.temp / t if e.node in scaled else e.temp
            if sp_on and e.node in inside and kinds.get(e.node) == "column" and e.reads:   # all-gathered
                temp += sizes.get(e.reads[0], 0)
            if sp_on and e.node in inside and kinds.get(e.node) == "row" and e.out is not None:
                temp += e.out_bytes                                      # before reduce-scatter
            return replace(e, out_bytes=div(e.out, e.out_bytes) if e.out is not None else e.out_bytes,
                           new=tuple((key, div(key, nb)) for key, nb in e.new), temp=temp)
        if isinstance(e, (Alloc, Free)):
            return replace(e, nbytes=div(e.key, e.nbytes))
        if isinstance(e, Mark):
            node = _node_of(e.node)
            ex = tuple((r, extra(node, e.node, x)) for r, x in e.extra)
            if sp_on and group is not None and node == group.node and node in inside:
                gathered = _gathered(computes.get((group.node, group.copy)), kinds.get(node), sizes)
                if gathered is not None:
                    ex = ex + (("transient", gathered),)
            return replace(e, extra=ex)
        if isinstance(e, Backward):
            return replace(e, events=tuple(event(x, e) for x in e.events))
        return e

    def phase(events):
        return tuple(event(e) for e in events)

    later = tuple(replace(mb, forward=phase(mb.forward), backward=phase(mb.backward)) for mb in plan.later)
    reqs = tuple(Requirement(t, x, why, "divides") for x, why in _divisors(graph))
    what = "sequence parallel" if sp_on else "tensor parallel"
    note = (f"{what} over t = {policy.parallel.tp} (Megatron): the split linears' weights, the heads, the "
            f"MLP's activation and the vocabulary / t" + ("; the rest of each layer / t along the sequence, "
                                                          "with whole all-gather and reduce-scatter buffers"
                                                          if sp_on else ""))
    states = tuple(replace(e, nbytes=div(e.key, e.nbytes)) if isinstance(e, Alloc) else e for e in plan.states)
    return replace(plan, states=states, forward=phase(plan.forward), backward=phase(plan.backward),
                   later=later, optimizer=_optimizer(plan, graph, policy, shapes),
                   components=_components(plan, graph, shapes), requirements=plan.requirements + reqs,
                   notes=plan.notes + (note,))


def _node_of(name: str) -> str:
    """The node a storage or a moment belongs to: ``h/attn/scores`` of
    ``h/attn/scores:left operand`` or ``h/mlp.c_fc (cast back)``."""
    return name.split(":")[0].split(" (")[0]


def _linear_scratch(x, kind: str, bias_only: bool):
    """A split linear's backward scratch, term by term: the terms in ``b`` are its input's
    gradient (split for a row-parallel layer), the others its parameters' gradients in half
    precision before the cast back (the weight's, of two dimensions, split; the bias's, of one,
    split for a column-parallel layer)."""
    from ..symbols import b
    out = sp.Integer(0)
    for term in sp.Add.make_args(sp.expand(x)):
        if b in term.free_symbols:
            out += term / t if kind == "row" else term
            continue
        dims = sum(n for base, n in term.as_powers_dict().items() if base.is_Symbol and base not in _BYTES)
        out += term / t if dims >= 2 or (kind == "column" and not bias_only) else term
    return out


def _components(plan: Plan, graph, shapes: dict) -> dict:
    """The model states of one rank: each split parameter's weights, gradient, master copy and
    optimizer state at ``1/t``."""
    from ..lowering import grad_bytes
    comps = dict(plan.components)
    for e in plan.states:
        if isinstance(e, Alloc) and e.key.name in shapes and e.key.kind in ("param", "master", "state"):
            comps[e.role] = sp.expand(comps[e.role] - e.nbytes * e.count * (1 - 1 / t))
    for p, m in graph.params():
        if p.name in shapes and p.trainable and "grads" in comps:
            comps["grads"] = sp.expand(comps["grads"] - grad_bytes(p) * m * (1 - 1 / t))
    return comps


def _optimizer(plan: Plan, graph, policy, shapes: dict) -> tuple:
    """The step's events with one rank's parameters: the master gradients and the
    optimizer's temporaries recomputed from the split shapes."""
    from ..lowering import _param_order, own_dtype
    from ..symbols import B_m
    local = {p.name: replace(p, shape=shapes[p.name]) if p.name in shapes else p for p, _ in graph.params()}
    trained = [(local[p.name], m) for p, m in graph.params() if p.trainable]
    order = [local[p.name] for p in _param_order(graph.items) if p.trainable]
    temps = iter(policy.opt.step_temps(policy.impl, order, trained, policy.device))
    rebind = own_dtype([p for p, _ in trained])
    master = sp.expand(sum((p.numel * m for p, m in trained if p.dtype is None), sp.Integer(0)))
    out = []
    for e in plan.optimizer:
        if isinstance(e, Alloc) and e.key == Key("master grads", "all"):
            e = replace(e, nbytes=master * B_m)
        elif isinstance(e, Mark) and e.phase == "optimizer" and e.node != "grad scaler unscale_":
            where, temp = next(temps)
            e = replace(e, node=where, extra=(("transient", temp.xreplace(rebind)),))
        out.append(e)
    return tuple(out)


def _forward(plan: Plan):
    """Every forward event, of every micro-batch."""
    yield from flat(plan.forward)
    for mb in plan.later:
        yield from flat(mb.forward)


def _gathered(compute, kind, sizes: dict):
    """The whole buffer a split linear's backward gathers under sequence parallelism: a
    column-parallel layer's input again, a row-parallel layer's output gradient (``compute``:
    the layer's forward)."""
    if compute is None:
        return None
    if kind == "column" and compute.reads:
        return sizes.get(compute.reads[0])
    if kind == "row" and compute.out is not None:
        return compute.out_bytes
    return None


def _divisors(graph) -> list:
    """What t must divide: the heads and the key-value heads. Not the vocabulary: Megatron pads
    it to a multiple of 128 * t (``--make-vocab-size-divisible-by``) and symmem counts V / t
    rows a rank, fewer than the padded table by less than 128 rows (GPT-2's 50,257 at t = 8:
    6,282.125 counted, 6,288 padded)."""
    syms = set()
    for p, _ in graph.params():
        for dim in p.shape:
            syms |= sp.sympify(dim).free_symbols
    out = [(a, "Megatron splits the attention heads over the tensor-parallel ranks")]
    if k in syms:
        out.append((k, "the key-value heads are split over the tensor-parallel ranks"))
    return out

