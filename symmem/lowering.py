"""Lowering: (graph, policy) -> :class:`~symmem.plan.Plan`, PyTorch eager semantics.

Every node's rule (:mod:`symmem.rules`) gives its footprint under the policy; lowering
turns the footprints into the events of one steady-state training step (an iteration
after the first, with ``zero_grad(set_to_none=True)``):

- **states**: parameters, the master copy, optimizer states and step counters (one
  storage per parameter tensor, ``count`` of them for a repeated block's; a frozen
  parameter has only itself), a GradScaler's scale and growth tracker, and the batch (the
  graph's inputs, held by the training loop for the whole step);
- **forward**: a :class:`~symmem.plan.Compute` per node: its output (none for a view),
  the new tensors it saves, what it reads, and who holds what: autograd holds what the
  node saves until the node's backward has run; autocast's cache holds the half-precision
  copy of a weight until forward ends; the model's outputs are referenced until forward
  ends and the loss for the whole step;
- **backward**: the loss's gradient (a 0-dim tensor of ones; under a GradScaler the scaled
  loss and its gradient, held through backward, and the loss's made from them), then per node in reverse
  order the gradients it allocates (input gradients of a new storage, or the output's
  gradient handed on; a parameter's gradient when backward first reaches it; a second
  gradient of a tied weight summed out of place), a mark, the output gradient freed when
  nothing refers to it any more, and autograd's release of what the node saved;
- **optimizer**: the step's temporaries, per optimizer and implementation, over the
  trainable parameters (after a GradScaler's ``unscale_``).

A :class:`~symmem.graph.Repeat` is lowered as three copies, each between
:class:`~symmem.plan.Begin` and :class:`~symmem.plan.End`: the first iteration (its input
comes from outside), a middle one and the last (its output goes outside). Each middle
iteration is alike, so the counter extrapolates copy 2 over the ``count - 2`` middle
iterations; a first iteration that turns a float32 input into the compute dtype (autocast)
is simply a copy that differs.
"""
from __future__ import annotations

import sympy as sp

from .dtypes import dtype_bytes
from .footprints import Instance, trace
from .graph import Graph, Repeat
from .plan import (AUTOGRAD, CACHE, LOCAL, LOOP, OUTPUTS, Alloc, Backward, Begin, Compute, End, Free, Hold, Key,
                   Mark, Plan, Release)
from .policy import Policy
from .policy.quantize import QUANTIZE
from .symbols import B_g, B_m, B_o, B_w

__all__ = ["lower", "autograd", "weight_bytes", "grad_bytes", "own_dtype"]

ZERO = sp.Integer(0)


def weight_bytes(p) -> sp.Expr:
    """A parameter's storage: ``numel * B_w``, or in its own dtype, or its quantized layout
    (an (out, in) weight, :mod:`symmem.policy.quantize`)."""
    if p.dtype is None:
        return p.numel * B_w
    q = QUANTIZE.get(p.dtype)
    if q is not None and q.nbytes is not None:
        return q.nbytes(*p.shape)
    return p.numel * dtype_bytes(p.dtype)


def grad_bytes(p) -> sp.Expr:
    """A trainable parameter's gradient: in its own dtype (``B_g`` for the precision's)."""
    return p.numel * (B_g if p.dtype is None else dtype_bytes(p.dtype))


def own_dtype(params) -> dict:
    """Byte symbols rebound for parameters that all carry one dtype of their own (peft's float32
    adapters in a half-precision model): their optimizer states and step temporaries are in it,
    as torch keeps them in the dtype of what they step."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) == 1 and None not in dtypes:
        nbytes = dtype_bytes(dtypes.pop())
        return {B_o: nbytes, B_w: nbytes}
    return {}


def _block(rep: Repeat) -> str:
    """The holder of the values a repeated block reads from outside, until it ends."""
    return f"block:{rep.name}"


def autograd(node: str, copy: int = 0) -> str:
    """The holder of what ``node`` (in ``copy``) saved for backward."""
    return AUTOGRAD + (f"{node}#{copy}" if copy else node)


def lower(graph: Graph, policy: Policy) -> Plan:
    """The plan of one steady-state training step of ``graph`` under ``policy``."""
    return _Lowering(graph, policy).plan()


class _Lowering:
    def __init__(self, graph: Graph, policy: Policy):
        self.graph, self.policy = graph, policy
        t = trace(graph, policy)
        self.order, self.info, self.storage, self.copies = t.order, t.info, t.storage, t.copies
        self.requirements = list(graph.requirements) + t.requirements
        self._outer = t.outer
        self.order_last = [i for i in self.order if isinstance(i, Instance)][-1]   # the loss
        # the model's Python locals (Graph.hold): held from the value's node to ``until``'s
        self.locals: dict = {}        # (node, copy) -> [(value, holder) to hold there]
        self.until: dict = {}         # (node, copy) -> [holders to release after it]
        scopes = [(graph, (0,))] + [(rep.body, range(1, t.copies[rep.name] + 1)) for rep in graph.repeats()]
        for g, copies in scopes:
            for value, until in g.locals:
                for c in copies:
                    # one holder per (value, until): a value two locals refer to lives until both let go
                    holder = f"{LOCAL}{value}>{until}" + (f"#{c}" if c else "")
                    # (a block's output held outside it: its last iteration's value)
                    self.locals.setdefault(self._where(value) if c == 0 else (value, c), []).append(holder)
                    self.until.setdefault((until, c), []).append(holder)
        # the values the model returns (held until forward ends): a repeated body's, each iteration's
        self.outputs = {o for g in graph.graphs() for o in g.outputs}

    def _where(self, value: str):
        """Where the outer value ``value`` is defined (a block's output: its last copy)."""
        return self._outer.get(value, (value, 0))

    # ----- the plan ----------------------------------------------------------------------
    def plan(self) -> Plan:
        states, components = self._states()
        forward, loss = self._forward()
        backward = self._backward(loss)
        return Plan(self.graph.name, tuple(states), tuple(forward), tuple(backward),
                    tuple(self._optimizer()), components, self.storage[loss],
                    tuple(self.requirements))

    def _states(self):
        graph, policy = self.graph, self.policy
        params = graph.params()
        # frozen, or inference: no gradient, master or state
        trained = [(p, m) for p, m in params if p.trainable and policy.mode != "inference"]
        # the master copy: of the trainable weights in the precision's dtype
        M = self.master = sp.expand(sp.Add(*(p.numel * m for p, m in trained if p.dtype is None)))
        tensors = sp.expand(sp.Add(*(m for _, m in trained)))
        opt, prec = policy.opt, policy.prec

        def state(p):       # in the parameter's own dtype where it has one
            return opt.state_bytes(p).xreplace(own_dtype([p]))
        buffers = [(node, m, self.info[(node.name, 0 if m == 1 else 1)].nbytes) for node, m in graph.buffers()]
        # one Add of all the terms: a running sum flattens again at each term (quadratic in the
        # parameters: T5's with its layer count bound, every layer's written out)
        components = {"params": sp.expand(sp.Add(*(weight_bytes(p) * m for p, m in params))),
                      "grads": sp.expand(sp.Add(*(grad_bytes(p) * m for p, m in trained))),
                      "master": M * B_m if prec.master else ZERO,
                      "optimizer": sp.expand(sp.Add(*(state(p) * m for p, m in trained))
                                             + (4 * tensors if policy.step_on_device else 0)
                                             + (opt.shared if trained else 0)),
                      "buffers": sp.expand(sp.Add(*(nb * m for _, m, nb in buffers)))}
        events = []
        for p, m in params:
            events.append(Alloc(Key("param", p.name), weight_bytes(p), "params", m))
            if not p.trainable or policy.mode == "inference":
                continue
            if prec.master and p.dtype is None:
                events.append(Alloc(Key("master", p.name), p.numel * B_m, "master", m))
            if state(p) != 0:
                events.append(Alloc(Key("state", p.name), state(p), "optimizer", m))
            if policy.step_on_device:
                events.append(Alloc(Key("step", p.name), sp.Integer(4), "optimizer", m))
        if opt.shared and trained:     # one set for the optimizer (bitsandbytes' quantization maps)
            events.append(Alloc(Key("state", f"{opt.name} shared"), opt.shared, "optimizer"))
        if prec.scaler and policy.mode != "inference":     # torch.amp.GradScaler: its float32 scale and int32 growth tracker
            events.append(Alloc(Key("state", "grad scaler"), sp.Integer(8), "optimizer"))
            components["optimizer"] += 8
        for node, m, nbytes in buffers:
            events.append(Alloc(Key("value", node.name), nbytes, "buffers", m))
        for inst in self.order:
            if isinstance(inst, Instance) and inst.node.op == "input" and not inst.node.attr("buffer"):
                events.append(Alloc(inst.out, inst.fp.out.nbytes, "batch"))
        return events, components

    def _forward(self):
        events, cast_seen = [], set()
        entering = None
        for inst in self.order:
            if not isinstance(inst, Instance):
                kind, rep, c = inst
                events.append(Begin(rep.name, c, rep.count) if kind == "begin" else End(rep.name, c))
                if kind == "begin" and c == 1:   # what the block reads from outside lives through it
                    entering = [Hold(self.storage[self._where(v)], _block(rep)) for v in rep.externals]
                if kind == "end" and c == self.copies[rep.name]:
                    events.append(Release(_block(rep)))
                    # a local held until the block's value: released when its last layer returns
                    events += [Release(holder) for holder in self.until.get((rep.name, 0), ())]
                continue
            fp, holder = inst.fp, autograd(inst.name, inst.copy)
            new, holds, late, brief = [], [], [], []
            for sv in fp.saved:
                key = self._saved_key(inst, sv)
                if sv.ref == "new":
                    new.append((key, sv.nbytes))
                    if sv.after:
                        late.append(key)
                    if sv.brief:
                        brief.append(key)
                holds.append(Hold(key, LOOP if sv.graph else holder))
            for name, numel, dtype in fp.casts:      # autocast caches one copy per weight
                key = Key("cast", name, next(k.copy for k in inst.params if k.name == name))
                if key not in cast_seen:
                    cast_seen.add(key)
                    new.append((key, numel * dtype.nbytes))
                    holds.append(Hold(key, CACHE))
            is_input = inst.node.op == "input"
            out = None if (fp.alias is not None or is_input) else inst.out
            reads = tuple(dict.fromkeys(self.storage[i] for i in inst.inputs))
            if inst.name in self.outputs:
                holds.append(Hold(inst.out, OUTPUTS))
            if inst is self.order_last:      # the loss: the training loop keeps it for the whole step
                holds.append(Hold(inst.out, LOOP))
            holds += [Hold(inst.out, holder) for holder in self.locals.get((inst.name, inst.copy), ())]
            if entering:
                holds, entering = holds + entering, None
            events.append(Compute(inst.name, out, fp.out.nbytes if out else ZERO, tuple(new), reads,
                                  tuple(holds), fp.fwd_temp, inst.copy, late=tuple(late), brief=tuple(brief)))
            events += [Release(holder) for holder in self.until.get((inst.name, inst.copy), ())]
        events += [Release(OUTPUTS), Release(CACHE)]
        return events, (self.order_last.name, self.order_last.copy)

    def _saved_key(self, inst: Instance, sv) -> Key:
        if sv.ref.startswith("in"):
            return self.storage[inst.inputs[int(sv.ref[2:])]]
        if sv.ref == "out":
            return inst.out
        if sv.ref.startswith("param:"):    # a weight itself: no new memory, but packed by the hooks
            return inst.params[int(sv.ref[6:])]
        if sv.ref.startswith("cast:"):
            name = sv.ref[5:]
            return Key("cast", name, next(k.copy for k in inst.params if k.name == name))
        return Key("saved" if sv.hooked else "scalar", f"{inst.name}:{sv.label}", inst.copy)

    def _backward(self, loss):
        """Gradients flow from the loss back; ``grads`` maps a value to its gradient's
        storage, ``refs`` counts the values whose gradient a storage still is."""
        gkey, nbytes = Key("vgrad", *loss), self.info[loss].nbytes
        held = [gkey]
        if self.policy.prec.scaler:
            # scaler.scale(loss).backward(): the scaled loss lives through backward, and
            # torch.autograd.backward holds its gradient; the loss's own is made from it
            held = [Key("value", "loss * scale"), Key("vgrad", "loss * scale")]
        events = [Alloc(k, nbytes, "transient") for k in held]
        if gkey not in held:
            events.append(Alloc(gkey, nbytes, "transient"))
        # torch.autograd.backward holds the root gradient (grad_tensors_) until it returns
        grads, refs, seen = {loss: gkey}, {gkey: 2 if gkey in held else 1}, set()
        self._kept = {}       # gradient storages a parameter's gradient keeps as a view
        for inst in reversed(self.order):
            if not isinstance(inst, Instance):
                kind, rep, c = inst
                events.append(End(rep.name, c) if kind == "begin" else Begin(rep.name, c, rep.count))
            elif (inst.name, inst.copy) in grads:     # else no gradient reaches this value
                events.append(self._node_backward(inst, grads, refs, seen))
        events += [Free(k, nbytes, "transient") for k in held]
        return events

    def _node_backward(self, inst: Instance, grads: dict, refs: dict, seen: set) -> Backward:
        me, fp, out = (inst.name, inst.copy), inst.fp, []
        g = grads[me]

        def hand(value, key):
            grads[value] = key
            refs[key] = refs.get(key, 0) + 1

        extra, news, late_extra = ZERO, [], {}
        for i, (v, mode) in enumerate(zip(inst.inputs, fp.grads)):
            if mode is None or not self.info[v].requires_grad:
                continue
            if v in grads:                # a second consumer: accumulated into the first
                if mode == "new" and i in fp.late_inputs:    # when its cast-back node makes it
                    late_extra[i] = self.info[v].nbytes
                else:
                    extra += self.info[v].nbytes if mode == "new" else 0
            elif mode == "pass":
                hand(v, g)
            else:                         # "new", or "slice" arriving first
                news.append((i, v))

        def allocate(when: str, only=None):
            """The input and parameter gradients this node makes ``when``: "now" (its kernels),
            "reduced" (the engine sums a broadcast bias's), "late" (the cast-back node of
            ``only``, ("in" | "param", index)); returns the bytes of a tied weight's second
            gradient."""
            for i, v in news:
                if (i in fp.late_inputs) == (when == "late") and when != "reduced" and only in (None, ("in", i)):
                    key = Key("vgrad", *v)
                    out.append(Alloc(key, self.info[v].nbytes, "transient"))
                    hand(v, key)
            tied = ZERO
            for i, (p, key) in enumerate(zip(inst.node.params, inst.params)):
                kind = "late" if fp.late_param(i) else "reduced" if i in fp.reduced_params else "now"
                if kind != when or not p.trainable or only not in (None, ("param", i)):
                    continue     # a frozen weight gets no gradient
                if key in seen:           # a tied weight: a second gradient, added in below
                    tied += grad_bytes(p)
                elif i == fp.grad_view_param:     # the output's gradient becomes it (no new bytes)
                    seen.add(key)
                    self._kept[g] = Key("grad", key.name, key.copy)
                else:
                    seen.add(key)
                    out.append(Alloc(Key("grad", key.name, key.copy), grad_bytes(p), "grads"))
            return tied

        tied = allocate("now")
        if fp.leaf:                       # AccumulateGrad makes the output's gradient the leaf's .grad
            self._kept[g] = Key("grad", inst.name, inst.copy)
        # under autocast a bias's half-precision gradient is among the kernels' temporaries
        # (bwd_temp) but the engine makes it after them, summing the output's gradient
        # (validate_outputs); a checkpoint's recomputed tensors are gone by then
        summed = sum((half for kind, j, half in fp.cast_back if kind == "param" and j in fp.reduced_params), ZERO)
        out.append(Mark("backward", inst.name, (("transient", fp.bwd_temp - summed + extra + tied),), inst.copy))
        if fp.reduced_params:
            tied += allocate("reduced")
            out.append(Mark("backward", f"{inst.name} (bias gradient)",
                            (("transient", fp.bwd_temp + extra + tied),), inst.copy))
        refs[g] -= 1                      # the output's gradient has been used
        del grads[me]
        if refs[g] == 0:
            out.append(Free(g, self._grad_bytes(g), "transient"))
            if g in self._kept:           # a parameter's gradient keeps the storage
                out.append(Alloc(self._kept.pop(g), self._grad_bytes(g), "grads"))
        out.append(Release(autograd(inst.name, inst.copy)))
        left = sum((half for *_, half in fp.cast_back), ZERO)
        other = fp.bwd_temp - left
        for kind, j, half in fp.cast_back:  # one at a time, each half copy freed before the next
            tied += allocate("late", (kind, j))
            joined = late_extra.get(j, ZERO) if kind == "in" else ZERO
            out.append(Mark("backward", f"{inst.name} (cast back)", (("transient", other + left + tied + joined),),
                            inst.copy))
            left -= half
        if tied != 0:                     # the engine sums the two gradients out of place
            out.append(Mark("backward", f"{inst.name} (tied gradient sum)", (("transient", 2 * tied),),
                            inst.copy))
        return Backward(inst.name, inst.copy, tuple(out), inst.params, g)

    def _grad_bytes(self, key: Key):
        return self.info[(key.name, key.copy)].nbytes

    def _optimizer(self):
        """The step's events. With a master copy, the gradients are first cast to the master
        dtype (one copy of all of them, held through the step) and the optimizer updates the
        master weights; their new values are then copied into the weights in place. Then the
        optimizer's own temporaries, for its implementation (:mod:`symmem.policy.optimizer`)."""
        policy, graph = self.policy, self.graph
        events = []
        if policy.prec.scaler:
            # scaler.step: unscale_ makes 1/scale through float64 (two 8-byte tensors), then
            # found_inf and the per-device copies; found_inf is held until update()
            events += [Mark("optimizer", "grad scaler unscale_", (("transient", sp.Integer(16)),)),
                       Alloc(Key("value", "found_inf"), sp.Integer(4), "transient")]
        trained = [(p, m) for p, m in graph.params() if p.trainable]
        if policy.prec.master:           # the master copy's gradients (counted in _states)
            events.append(Alloc(Key("master grads", "all"), self.master * B_m, "transient"))
        order = [p for p in _param_order(graph.items) if p.trainable]
        rebind = own_dtype([p for p, _ in trained])
        for where, temp in policy.opt.step_temps(policy.impl, order, trained, policy.device):
            events.append(Mark("optimizer", where, (("transient", temp.xreplace(rebind)),)))
        if policy.prec.scaler:
            events.append(Free(Key("value", "found_inf"), sp.Integer(4), "transient"))
        return events


def _param_order(items, seen=None) -> list:
    """Parameters in the order the optimizer meets them; a repeated body's own twice (its
    shared ones, :meth:`~symmem.graph.Graph.with_shared_layers`, once)."""
    seen = set() if seen is None else seen
    out = []
    for item in items:
        if isinstance(item, Repeat):
            body = _param_order(item.body.items, set(seen))
            seen.update(p.name for p in body)
            out += body + [p for p in body if p.name in item.body._params]   # shared weights once
        else:
            for p in item.params:
                if p.name not in seen:
                    seen.add(p.name)
                    out.append(p)
    return out
