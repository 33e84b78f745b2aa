"""Data parallelism, ZeRO, FSDP and offload: the plan of one data-parallel rank.

All data-parallel ranks run alike, so the plan of one is the estimate. Beside tensor
parallelism (its pass runs first) a rank's parameters are its tensor-parallel split ones
(:func:`symmem.passes.tensor.local_shapes`): those are sharded, padded and gathered. ``n`` is
the shard degree: the symbol ``d`` (bound to ``dp`` where it is a number), or a hybrid group's
``shard_size``. Formulas stay symbolic in ``d``. Under ZeRO a sharded tensor of ``N`` elements
is counted ``N / n``: exact where ``n`` divides; otherwise DeepSpeed pads each flat partition
to a multiple of ``n`` (at most ``n - 1`` elements more, not counted). FSDP2 pads each
parameter's first dimension, ``ceiling(dim0 / n)`` rows a rank, and so do the formulas
(below): exact at any ``n``.

What each layout changes, as the libraries allocate it:

- **DDP** (``zero=0``, ``dp > 1``; ``torch/nn/parallel/distributed.py`` and
  ``torch/csrc/distributed/c10d/reducer.cpp``): the Reducer allocates its buckets at
  construction, flat per dtype, ``bucket_cap_mb=25`` MiB each and the first 1 MiB
  (``_DEFAULT_FIRST_BUCKET_BYTES``); with ``gradient_as_bucket_view=False`` (the default)
  each gradient is copied into its bucket and back, so the buckets are a second copy of
  every trainable gradient, held for the whole run. The cap only groups parameters: the
  buckets hold ``sum(grads)`` bytes whatever it is. Counted in ``grads`` (twice the gradients).
- **ZeRO-1** (DeepSpeed ``runtime/zero/stage_1_and_2.py``): the master copy and the
  optimizer states sharded (``/ n``), and the step's temporaries (the float32 gradients of
  the partition, the optimizer's own) with them.
- **ZeRO-2**: + gradients. With ``contiguous_gradients`` (DeepSpeed's default) each gradient
  is copied into the "ipg" bucket as its hook fires and the full one freed
  (``reduce_independent_p_g_buckets_and_remove_grads``); the rank keeps its partition. The
  transient buffer counted: ``backward()`` allocates ``ipg_buffer``, one flat tensor of
  ``reduce_bucket_size`` elements (``reduce_bucket``, default 5e8) in the gradients' dtype,
  for the whole backward pass (a second one with ``overlap_comm``, not modelled). ZeRO-1 has
  none: DeepSpeed's engine turns ``contiguous_gradients`` off at stage 1
  (``runtime/engine.py``, ``_configure_zero_optimizer``), and the full gradients stay until
  the step.
- **ZeRO-3** (``runtime/zero/stage3.py``): + parameters. The parameters of the unit being
  computed (one iteration of the repeated block: a decoder layer) are gathered whole for its
  forward and again for its backward, and freed after; ``prefetch`` more units (1) are
  gathered ahead of it, but for the last unit run. The parameters outside the repeated block
  (embeddings, final norm, output layer) form the root unit, whole from the start of forward
  to the end of backward. A layer written out of its repeated block (T5's first block of each
  stack, which makes the position bias: :func:`written_out`) is a unit as an iteration is.
  Each unit's full gradients live until its backward has run, then
  are reduce-scattered into the rank's partition, a flat buffer made at initialisation
  (``grad_partitions_flat_buffer``, held always, as is stage 3's ipg bucket: one flat tensor
  of ``reduce_bucket`` elements). Assumed:
  ``stage3_param_persistence_threshold=0`` (DeepSpeed's default 1e5 keeps smaller parameters,
  biases and norms, whole on every rank) and a unit gathered whole (DeepSpeed gathers per
  submodule, with a prefetch bucket of 5e7 elements: for larger layers this is an upper bound).
- **FSDP full** (FSDP2's ``fully_shard`` on every layer and the root, the root with its default
  ``reshard_after_forward``; ``torch/distributed/fsdp/_fully_shard``): per-parameter shards,
  each parameter's dim 0 padded to a multiple of ``n`` (``_fsdp_param.py``:
  ``ceiling(dim0 / n)`` rows a rank, :func:`padded_rows`); parameters, gradients, optimizer
  states and the master copy counted as rank 0's, the largest (the optimizer sees the
  unpadded local rows: rank 0 holds ``ceiling(dim0 / n)`` of them); each rank keeps a step
  counter per parameter, not sharded. The formulas carry ``ceiling(dim0 / d)``: where ``d``
  divides every dim 0 they are ZeRO-3's ``N / d`` (``ceiling(x) = x``). What is gathered and
  reduced is padded: a unit's all-gather output (one flat tensor, ``all_gather_copy_in``; the
  input a slice of it) and its unsharded parameters are ``n * ceiling(dim0 / n)`` rows each.
  Forward (``_fsdp_param_group.py``, ``wait_for_unshard``): the unit's output is copied out
  into the unsharded parameters and kept in ``comm_ctx.all_gather_state`` until the next
  unit's copy-out (the root's until the first layer's, the last layer's until the root's
  post-forward, the end of forward); the root is not resharded after forward (fully_shard's
  default for the root), so it is whole until its post-backward at the end of backward; a
  layer is freed at its end. Backward: the root's pre-backward all-gathers the first unit
  run (``default_prefetch``: one unit, whatever ``prefetch`` >= 1 says; more needs
  ``set_modules_to_backward_prefetch``, not modelled; ``prefetch`` = 0: each unit gathered at
  its own pre-backward), each unit's pre-backward copies its output out
  (the output freed right after: not kept in backward) and all-gathers the next; its
  post-backward reshards, then reduce-scatters: the previous unit's reduce-scatter input is
  let go, this unit's gradients copied, padded, into one flat input (``chunk_cat``) kept in
  ``comm_ctx.reduce_scatter_states`` until the next unit reduces (the root's until the end of
  backward), the gradient shards (the reduce-scatter output) kept and the whole gradients
  freed. The step runs on the local shards: the optimizer's temporaries of
  ``ceiling(dim0 / n)``-row parameters. No ipg bucket. Checked against measured FSDP2 runs
  (a two-layer Llama, SGD and AdamW, ``tests/test_dist_measured.py``). Gathered, reduced and
  stepped in the precision's own dtypes, but for a half-precision model with a float32 master
  copy (``bf16-master``, ``fp16-master``): under FSDP that is ``MixedPrecisionPolicy(
  param_dtype=bfloat16, reduce_dtype=float32)`` (torchtitan's default), the model float32 and
  its float32 shards the master copy (no other). Each all-gather first casts the rank's shards
  into one flat half-precision tensor (``flat_foreach_copy_input``, the unit's ``1 / n``,
  until the all-gather is issued); the gathered units, the activations and the unsharded
  gradients are half precision; the reduce-scatter input (``chunk_cat`` casts) and the
  gradient shards are float32, stepped as they are (no cast copy); the buffers are not cast
  (the rotary's ``inv_freq`` stays float32). Checked the same way, every all-gather's moment
  included (``test_llama_fsdp2_mixed_precision_is_symmems_bf16_master``). ``reduce_dtype``
  ``bf16`` (or ``fp16``: ``MixedPrecisionPolicy(reduce_dtype=)`` the parameters' dtype, as
  llama-recipes and fms-fsdp set it): the reduce-scatter's input and output in it, the output
  cast to the float32 gradient shards (both beside each other until ``foreach_reduce``
  returns). Measured: the phases' maxima and each unit's ``chunk_cat`` moment. At the cast
  ``foreach_reduce``'s loop variable (``for i, (fsdp_param, unsharded_grad) in ...``) still
  holds the unit's last gradient, that of its module's last registered parameter (a decoder
  layer's ``post_attention_layernorm``, the root's ``lm_head``): the graph does not record
  registration order, so this is counted for the experts' unit only (32 and 3,168 bytes at
  the cast's moments of a two-layer Llama, never a phase's maximum there).
- **FSDP beside expert parallelism** (``ep``; transformers' FSDP2 with expert parallelism,
  torchtitan's units): each layer's experts module is a unit nested in the layer's, its
  parameters (the rank's ``E / e`` experts) sharded and padded over the ``n / e`` ranks that
  hold the same experts; the rest over ``n``. In forward the layer's all-gather output is let
  go at the experts' copy-out and the experts' is kept until the next layer's; in backward a
  layer's pre-backward prefetches its experts, the experts' pre-backward the next layer, and
  the experts' post-backward (when their inputs' gradients are made) reshards and
  reduce-scatters them; ``foreach_reduce``'s loop variable keeps the unit's last gradient
  (``down_proj``'s) until it returns, beside the reduce-scatter output. Where ``dp = ep``
  (numbers) each rank holds its experts whole: FSDP2's one-rank path gathers nothing (the
  unsharded parameters are copied from the shards) and divides the gradients into a copy
  (``reduce_output.copy_(input / factor)``); symbolic degrees require ``2 e <= d``. Measured
  (``tests/test_expert_measured.py``).
- **FSDP grad-op** (``reshard_after_forward=False``, SHARD_GRAD_OP): as full, but a unit
  gathered in forward stays whole until its backward has run (all of them at the end of
  forward: ZeRO-2's peak), and nothing is gathered in backward.
- **FSDP hybrid** (HYBRID_SHARD): full sharding over ``shard_size`` ranks (8: one node of
  eight GPUs, an assumption), replicated across nodes.
- **Offload** ``optimizer``: the master copy, optimizer states and step counters live on the
  host and the step runs there (ZeRO-Offload): the device keeps no optimizer temporaries and,
  from stage 2, no gradient partition (it is copied to the host, in float32). ``params``
  (stage 3, FSDP full or hybrid): the parameter shards live on the host and are gathered
  to the device per unit; FSDP's ``CPUOffload(offload_params=True)`` moves the gradients and
  the optimizer too. The host bytes are the component ``host``.
"""
from __future__ import annotations

from dataclasses import replace

import sympy as sp

from . import tensor
from ..lowering import grad_bytes, weight_bytes
from ..graph import Node
from ..plan import Alloc, Backward, Begin, Compute, End, Free, Key, Mark, Plan
from ..requirements import Requirement
from ..symbols import B_a, B_g, B_m, B_w, d

__all__ = ["prepare", "apply", "unit_bytes", "padded_rows", "written_out"]

ZERO = sp.Integer(0)


def prepare(graph, policy):
    return graph


def written_out(graph) -> dict:
    """{layer: its parameters} for each layer written out of its repeated block (T5's first
    block of each stack, which makes the position bias: its nodes' ``layer`` attribute and
    names under it): ZeRO-3 and FSDP gather it as a unit of its own, like an iteration."""
    layers = {n.attr("layer") for n in graph.items if isinstance(n, Node) and n.attr("layer")}
    out = {}
    for layer in sorted(layers):
        params = {p.name: p for n in graph.nodes() if n.name.startswith(layer + "/") for p in n.params}
        out[layer] = list(params.values())
    return out


def unit_bytes(graph, factor=None, local=None) -> tuple[dict, sp.Expr, dict, sp.Expr]:
    """(weight bytes of one iteration of each repeated block by name, and of each layer
    written out of one (:func:`written_out`), of the root's params, gradient bytes likewise):
    the units ZeRO-3 and FSDP gather. ``factor(p)``: each parameter's bytes times it (FSDP2's
    padding: :func:`padded_rows`); ``local``: {name: parameter} as one tensor-parallel rank
    holds it, where it is split."""
    f = factor or (lambda p: 1)
    local = local or {}
    units, grads, inner = {}, {}, set()
    for rep in graph.repeats():
        own = [local.get(p.name, p) for p, _ in rep.body.params() if p.name in rep.body._params]
        inner.update(p.name for p in own)
        units[rep.name] = sp.expand(sum((weight_bytes(p) * f(p) for p in own), ZERO))
        grads[rep.name] = sp.expand(sum((grad_bytes(p) * f(p) for p in own if p.trainable), ZERO))
    for layer, params in written_out(graph).items():
        own = [local.get(p.name, p) for p in params]
        inner.update(p.name for p in own)
        units[layer] = sp.expand(sum((weight_bytes(p) * f(p) for p in own), ZERO))
        grads[layer] = sp.expand(sum((grad_bytes(p) * f(p) for p in own if p.trainable), ZERO))
    root = [local.get(p.name, p) for p, _ in graph.params() if p.name not in inner]
    return (units, sp.expand(sum((weight_bytes(p) * f(p) for p in root), ZERO)),
            grads, sp.expand(sum((grad_bytes(p) * f(p) for p in root if p.trainable), ZERO)))


def padded_rows(p, n) -> sp.Expr:
    """FSDP2's shard of parameter ``p`` over ``n`` ranks as a fraction of it: dim 0 padded to
    a multiple of ``n``, ``ceiling(dim0 / n)`` rows a rank (``_fsdp_param.py``,
    ``padded_sharded_param_size``), the largest rank's (rank 0's) share of the unpadded rows
    too. ``ceiling(dim0 / n) / dim0``: ``1 / n`` where ``n`` divides ``dim0``."""
    if not p.shape:
        return 1 / sp.sympify(n)
    dim0 = p.shape[0]
    return sp.ceiling(dim0 / n) / dim0


def apply(plan: Plan, graph, policy) -> Plan:
    par = policy.parallel
    if par.data_single or policy.mode == "inference":
        return plan
    if par.ddp:
        return _ddp(plan, par)
    return _Shard(plan, graph, policy).rewrite()


def _ddp(plan: Plan, par) -> Plan:
    buckets = plan.components.get("grads", ZERO)
    if buckets == 0:
        return plan
    comps = dict(plan.components, grads=sp.expand(2 * buckets))
    note = (f"DDP over dp = {par.dp}: the Reducer's buckets (gradient_as_bucket_view=False) hold a second "
            f"copy of the gradients, {buckets}")
    return replace(plan, states=plan.states + (Alloc(Key("ddp buckets", "all"), buckets, "grads"),),
                   components=comps, notes=plan.notes + (note,))


class _Shard:
    """The rewrite of one plan for ZeRO 1-3 or FSDP."""

    def __init__(self, plan: Plan, graph, policy):
        self.plan, self.policy, self.par = plan, policy, policy.parallel
        par = self.par
        self.n = par.shard_degree
        self.stage = par.stage
        self.fsdp = par.fsdp is not None
        #: "unit": gathered per unit in forward and in backward; "keep": gathered in forward,
        #: whole until the unit's backward (FSDP grad-op); None: parameters never sharded
        self.gather = "keep" if par.fsdp == "grad-op" else "unit" if self.stage == 3 else None
        self.graph = graph
        # each parameter as one rank holds it before sharding: a tensor-parallel rank's split
        shapes = tensor.local_shapes(graph) if par.splits("tp") else {}
        self.local = {p.name: replace(p, shape=shapes[p.name]) for p, _ in graph.params() if p.name in shapes}
        self.params = [(self.local.get(p.name, p), m) for p, m in graph.params()]
        #: expert parallelism beside FSDP: each layer's experts module a unit of its own (its
        #: parameters' names), sharded over the n / e ranks holding the same experts
        self.experts = _expert_params(graph) if self.fsdp and par.splits("ep") else set()
        self.n_e = self.n / par.ep
        if self.fsdp:     # FSDP2: per-parameter shards, dim 0 padded; gathered and reduced padded
            self.param = {p.name: p for p, _ in self.params}
            self.units, self.root, *_ = unit_bytes(graph, lambda p: self._degree(p.name) * padded_rows(
                p, self._degree(p.name)), self.local)
        else:
            self.units, self.root, *_ = unit_bytes(graph, local=self.local)
        self._experts_unit(graph)
        self.bucket = ZERO if self.fsdp else sp.Integer(par.reduce_bucket) * B_g
        self.scattering = None    # FSDP: the reduce-scatter input kept until the next unit reduces
        #: FSDP2's MixedPrecisionPolicy(param_dtype=half, reduce_dtype=float32): a half-precision
        #: model with a float32 master copy, sharded by FSDP (``bf16-master``, ``fp16-master``)
        self.mp = self.fsdp and policy.fsdp_mixed
        #: ... with reduce_dtype the half dtype: the reduce-scatter in it, its output cast to float32
        self.reduce_half = self.mp and par.reduce_dtype != "fp32"

    def _experts_unit(self, graph) -> None:
        """Each layer's experts as a unit of their own: its bytes gathered (``expert_unit``; the
        layers' units less them), the blocks holding one, whether every rank holds its experts
        whole (``dp = ep``: FSDP2's one-rank mesh, no all-gather output), the all-gather output's
        bytes, and the module's last parameter (gate_up_proj, then down_proj)."""
        from ..lowering import _param_order
        xs = [p for p, _ in self.params if p.name in self.experts]
        self.expert_unit = sp.expand(sum((weight_bytes(p) * self.n_e * padded_rows(p, self.n_e) for p in xs), ZERO))
        self.expert_blocks = _blocks_with(graph, self.experts) if xs else set()
        self.units = {k: sp.expand(v - self.expert_unit) if k in self.expert_blocks else v
                      for k, v in self.units.items()}
        par = self.par
        self.whole_experts = bool(xs) and isinstance(par.dp, int) and par.dp == par.ep
        self.expert_output = ZERO if self.whole_experts else self.expert_unit
        self.last_expert = ([p.name for p in _param_order(graph.items) if p.name in self.experts] or [None])[-1]

    def _master(self, nbytes):
        """``nbytes`` priced in the master dtype (float32) under FSDP's mixed precision: the
        shards, their gradients, the reduce-scatter and the buffers (FSDP casts the
        parameters it gathers, not the buffers) stay in the model's own float32."""
        return nbytes.xreplace({B_w: B_m, B_g: B_m, B_a: B_m}) if self.mp else nbytes

    def _degree(self, name: str):
        """The ranks parameter ``name`` is sharded over: ``n``, or ``n / e`` for an expert's
        beside expert parallelism (the ranks holding the same experts)."""
        return self.n_e if name in self.experts else self.n

    def _shard(self, name: str, nbytes):
        """A rank's part of the storage ``nbytes`` of parameter ``name`` (its state, gradient):
        FSDP2's padded rows, else ``/ n``."""
        p = self.param.get(name) if self.fsdp else None
        return nbytes / self.n if p is None else nbytes * padded_rows(p, self._degree(name))

    # ----- states ---------------------------------------------------------------------------
    def rewrite(self) -> Plan:
        plan, par, n = self.plan, self.par, self.n
        comps = dict(plan.components)
        host = ZERO
        master_grads = comps.get("master", ZERO)     # the step's float32 copy of the gradients
        states = []
        for e in plan.states:
            if self.mp and isinstance(e, Alloc) and e.role in ("params", "buffers"):
                e = replace(e, nbytes=self._master(e.nbytes))
            if self.mp and isinstance(e, Alloc) and e.role == "master":
                continue            # the float32 shards are the parameters
            if isinstance(e, Alloc) and e.role in ("master", "optimizer") and self.stage >= 1:
                if par.offload_optimizer:
                    continue
                if not (self.fsdp and e.key.kind == "step"):    # FSDP2: each rank steps every parameter
                    e = replace(e, nbytes=self._shard(e.key.name, e.nbytes))
            elif isinstance(e, Alloc) and e.role == "params" and self.gather is not None:
                if par.offload_params:
                    continue
                e = replace(e, nbytes=self._shard(e.key.name, e.nbytes))
            states.append(e)
        shard = {k: sp.expand(comps.get(k, ZERO) / n) for k in ("params", "grads", "master", "optimizer")}
        if self.fsdp:     # the sums of the padded shards (and whole step counters)
            for k in ("params", "master", "optimizer"):
                shard[k] = sp.expand(sum((e.count * (e.nbytes if e.key.kind == "step" else
                                                     self._shard(e.key.name, e.nbytes))
                                          for e in plan.states if isinstance(e, Alloc) and e.role == k), ZERO))
            shard["grads"] = sp.expand(sum((self._master(grad_bytes(p)) * m * padded_rows(p, self._degree(p.name))
                                            for p, m in self.params if p.trainable), ZERO))
            master_grads = shard["master"] if master_grads != 0 and not self.mp else ZERO
            if self.mp:
                shard["params"], shard["master"] = self._master(shard["params"]), ZERO
                comps["buffers"] = self._master(comps.get("buffers", ZERO))
        if par.offload_optimizer:
            host += shard["master"] + shard["optimizer"]
            # the gradient partition the host steps with, in the master dtype (float32) when there is one
            host += ((master_grads if self.fsdp else master_grads / n) if master_grads != 0
                     else shard["grads"])
            comps["master"] = comps["optimizer"] = ZERO
        else:
            comps["master"], comps["optimizer"] = shard["master"], shard["optimizer"]
        if self.gather is not None:
            comps["params"] = ZERO if par.offload_params else shard["params"]
            host += shard["params"] if par.offload_params else 0
        device_grads = self.stage >= 2 and not par.offload_optimizer
        if self.stage >= 2:
            comps["grads"] = shard["grads"] if device_grads else ZERO
        if self.stage == 3 and not self.fsdp and device_grads:   # stage3.py: grad_partitions_flat_buffer
            states.append(Alloc(Key("grad partition", "stage 3"), shard["grads"], "grads"))
        if self.stage == 3 and self.bucket != 0:     # stage3.py's ipg bucket: made at initialisation
            states.append(Alloc(Key("ipg bucket", "stage 3"), self.bucket, "transient"))
        if host != 0:
            comps["host"] = sp.expand(host)
        layers = set(written_out(self.graph)) if self.gather is not None else set()
        forward = _unbracketed(self._forward(_bracketed(plan.forward, layers)))
        backward = _unbracketed(self._backward(_bracketed(plan.backward, layers), device_grads))
        optimizer = self._optimizer(plan.optimizer)
        requirements = plan.requirements
        if self.experts:
            ep = sp.sympify(par.ep)
            requirements += (Requirement(ep, d, "the experts are sharded over the d / e ranks holding the same ones",
                                         "divides"),)
            if not self.whole_experts:     # one rank a set of experts (dp = ep, numbers) is derived apart
                requirements += (Requirement(2 * ep, d, "the formulas are FSDP2's for the experts sharded over "
                                             "d / e >= 2 ranks (give dp = ep as numbers for one rank)"),)
        if par.fsdp == "hybrid":       # d ranks in groups of shard_size: the formulas need it to divide
            requirements += (Requirement(sp.Integer(par.shard_size), d,
                                         f"FSDP hybrid shards within groups of shard_size = {par.shard_size} ranks",
                                         "divides"),)
        note = (f"{par.describe()}: per rank, sharded over n = {n}"
                + (f"; host {sp.expand(host)}" if host != 0 else ""))
        return replace(plan, states=tuple(states), forward=forward, backward=backward, optimizer=optimizer,
                       components=comps, requirements=requirements, notes=plan.notes + (note,))

    # ----- forward and backward -------------------------------------------------------------
    def _last_copies(self, events, phase):
        """The (block, copy) run last in this phase: no unit after it to prefetch."""
        begins = [(e.block, e.copy) for e in events if isinstance(e, Begin)]
        return begins[-1] if begins else None

    def _prefetch(self, phase: str) -> int:
        """Units gathered ahead: DeepSpeed prefetches both ways; FSDP2 in backward only by
        default (``FSDPState._pre_backward``'s ``default_prefetch``; forward prefetch needs
        ``set_modules_to_forward_prefetch``)."""
        return 0 if self.fsdp and phase == "forward" else self.par.prefetch

    def _gathered(self, block: str, phase: str, last: bool) -> list:
        """Alloc events of a unit gathered at its start (ZeRO-3)."""
        unit, out = self.units[block], []
        out.append(Alloc(Key("gathered", f"{block} ({phase})"), unit, "params"))
        if self._prefetch(phase) and not last:
            out.append(Alloc(Key("prefetched", f"{block} ({phase})"), self._prefetch(phase) * unit, "params"))
        return out

    def _forward(self, events) -> tuple:
        if self.gather is None:
            return events
        if self.fsdp:
            return self._forward_fsdp(events)
        last = self._last_copies(events, "forward")
        out = [Alloc(Key("gathered", "root"), self.root, "params")]
        current = None
        for e in events:
            if isinstance(e, Begin):
                out.append(e)
                current = (e.block, e.copy)
                out += self._gathered(e.block, "forward", current == last)
                continue
            if isinstance(e, End):
                unit = self.units[e.block]
                if self._prefetch("forward") and current != last:
                    out.append(Free(Key("prefetched", f"{e.block} (forward)"), self._prefetch("forward") * unit,
                                    "params"))
                if self.gather == "unit":
                    out.append(Free(Key("gathered", f"{e.block} (forward)"), unit, "params"))
                out.append(e)
                continue
            out.append(e)
        return tuple(out)

    def _forward_fsdp(self, events) -> tuple:
        """FSDP2's forward (``_fsdp_param_group.py``): each unit's all-gather output, one flat
        tensor of the unit padded, is copied out into the unsharded parameters and kept in
        ``comm_ctx.all_gather_state`` until the next unit's copy-out (the last one's until the
        root's post-forward, the end of forward); the root's parameters stay whole to the end
        of backward (its default), each layer's are freed at its end (full shard) or stay whole
        until its backward (grad-op)."""
        root = Key("all-gather output", "root")
        out = [Alloc(root, self.root, "params"), *self._copy_in("forward", "root", self.root),
               Alloc(Key("gathered", "root"), self.root, "params"), Mark("forward", "all-gather root")]
        held = (root, self.root)      # the all-gather output kept outside a block
        prev = ZERO
        first, last = self._expert_span(events, Compute)
        e_block, tail = None, {}      # {block: the all-gather output its iteration ends with}
        for i, e in enumerate(events):
            if i in first:            # the experts' pre-forward: the layer's output let go after its copy-out
                block, unit, xu, ag = e_block, self.units[e_block], self.expert_unit, self.expert_output
                out += [Alloc(Key("all-gather output", f"{block}.experts (forward)"), ag, "params"),
                        *(self._copy_in("forward", f"{block}.experts", xu, n=self.n_e) if ag != 0 else ()),
                        Alloc(Key("gathered", f"{block}.experts (forward)"), xu, "params"),
                        Mark("forward", f"all-gather {block}.experts"),
                        Free(Key("all-gather output", f"{block} (forward)"), unit, "params")]
                tail[block] = ag
            if i in last:             # the experts' post-forward: resharded (full shard)
                out.append(e)
                if self.gather == "unit":
                    out.append(Free(Key("gathered", f"{e_block}.experts (forward)"), self.expert_unit, "params"))
                continue
            if isinstance(e, Begin):
                e_block = e.block
                unit = self.units[e.block]
                if held is not None:
                    out.append(Free(held[0], held[1], "params"))
                    prev, held = held[1], None
                out += [e, Alloc(Key("all-gather output", f"{e.block} (forward)"), unit, "params"),
                        *self._copy_in("forward", e.block, unit, (("params", prev),)),
                        Alloc(Key("gathered", f"{e.block} (forward)"), unit, "params"),
                        # the copy-out: the previous unit's output is let go after it
                        Mark("forward", f"all-gather {e.block}", (("params", prev),))]
                continue
            if isinstance(e, End):
                unit = self.units[e.block]
                if self.gather == "unit":
                    out.append(Free(Key("gathered", f"{e.block} (forward)"), unit, "params"))
                # the output lives on into the next unit: freed here (an allocation that
                # outlived its iteration would be counted once per layer), counted at the next
                # iteration's copy-out, or held again after the block's last (nothing may come
                # between two copies of a block)
                ends = tail.get(e.block, unit)
                out += [Free(Key("all-gather output", f"{e.block} (forward)"), ends, "params"), e]
                nxt = events[i + 1] if i + 1 < len(events) else None
                if isinstance(nxt, Begin) and nxt.block == e.block:
                    prev = ends
                else:
                    held = (Key("all-gather output", f"{e.block} (held)"), ends)
                    out.append(Alloc(held[0], ends, "params"))
                continue
            out.append(e)
        if held is not None:
            out.append(Free(held[0], held[1], "params"))
        return tuple(out)

    def _expert_span(self, events, kind) -> tuple[set, set]:
        """The indices of the first and the last event of each iteration's experts module
        (``Compute`` in forward, ``Backward`` in backward) where it is a unit of its own."""
        first, last, seen = set(), set(), None
        if not self.experts:
            return first, last
        from ..models.mixtral import in_ep_experts
        for i, e in enumerate(events):
            if isinstance(e, kind) and in_ep_experts(e.node):
                if seen is None:
                    first.add(i)
                seen = i
            elif isinstance(e, End) and seen is not None:
                last.add(seen)
                seen = None
        return first, last

    def _copy_in(self, phase: str, block: str, unit, extra=(), n=None) -> list:
        """Under mixed precision, the moment of a unit's all-gather: its rank's shards are
        first cast into one flat half-precision tensor (``_get_param_all_gather_inputs``'s
        ``flat_foreach_copy_input``), the unit's ``1 / n``, held beside the all-gather output
        until ``foreach_all_gather`` returns; in float32 the shards are sent as they are."""
        if not self.mp:
            return []
        return [Mark(phase, f"all-gather copy-in {block}", tuple(extra) + (("transient", unit / (n or self.n)),))]

    def _backward_fsdp(self, events, device_grads: bool) -> tuple:
        """FSDP2's backward: a unit's all-gather is issued by the pre-backward of the one
        before it in backward (the root's for the first: ``default_prefetch``), its output
        freed right after its copy-out (in backward it is not kept); the post-backward
        reshards (frees the unsharded parameters), then reduce-scatters (:meth:`_reduce`).
        The root reshards and reduces last."""
        out, full, current = [], {}, None
        begins = [(e.block, e.copy) for e in events if isinstance(e, Begin)]
        ahead = self.gather == "unit" and self._prefetch("backward") > 0
        if ahead and begins:          # the root's pre-backward prefetches the first unit
            first = self.units[begins[0][0]]
            at = 1 if events and isinstance(events[0], Alloc) else 0
            out += list(events[:at]) + [Alloc(Key("all-gather output", f"{begins[0][0]} (prefetched)"),
                                              first, "params"),
                                        *self._copy_in("backward", begins[0][0], first)]
            events = events[at:]
        i = 0
        xfirst, xlast = self._expert_span(events, Backward)
        experts, inside = [], False     # the experts' whole gradients, reduced at their post-backward

        def prefetch(k):    # the all-gather the k-th unit's pre-backward issues: the next unit's
            if not ahead or k + 1 >= len(begins):
                return []
            nxt = begins[k + 1][0]
            return [Alloc(Key("all-gather output", f"{nxt} (prefetched)"), self.units[nxt], "params"),
                    *self._copy_in("backward", nxt, self.units[nxt])]
        for j, e in enumerate(events):
            inside = inside or j in xfirst
            if j in xfirst and self.gather == "unit":   # the experts' pre-backward
                block, xu, ag = current[0], self.expert_unit, self.expert_output
                own = Key("all-gather output", f"{block}.experts (backward)")
                if not ahead and ag != 0:
                    out += [Alloc(own, ag, "params"), *self._copy_in("backward", f"{block}.experts", xu, n=self.n_e)]
                out += [Alloc(Key("gathered", f"{block}.experts (backward)"), xu, "params"),
                        Mark("backward", f"all-gather {block}.experts"), Free(own, ag, "params"), *prefetch(i - 1)]
            if j in xlast:       # the experts' post-backward: resharded, then reduced
                e, made = _full_grads(e)
                phase = "backward" if self.gather == "unit" else "forward"
                out += [e, Free(Key("gathered", f"{current[0]}.experts ({phase})"), self.expert_unit, "params"),
                        *self._reduce(experts + made, f"{current[0]}.experts", device_grads)]
                experts, inside = [], False
                continue
            if isinstance(e, Begin):
                out.append(e)
                current = (e.block, e.copy)
                if self.gather == "unit":
                    unit = self.units[e.block]
                    own = Key("all-gather output", f"{e.block} (backward)")
                    if not ahead:
                        out += [Alloc(own, unit, "params"), *self._copy_in("backward", e.block, unit)]
                    out += [Alloc(Key("gathered", f"{e.block} (backward)"), unit, "params"),
                            Mark("backward", f"all-gather {e.block}"),
                            Free(own, unit, "params")]
                    if ahead and e.block in self.expert_blocks:     # next in backward: this layer's experts
                        xu, ag = self.expert_unit, self.expert_output
                        if ag != 0:
                            out += [Alloc(Key("all-gather output", f"{e.block}.experts (prefetched)"), ag, "params"),
                                    *self._copy_in("backward", f"{e.block}.experts", xu, n=self.n_e)]
                    else:
                        out += prefetch(i)
                i += 1
                continue
            if isinstance(e, End):
                unit = self.units[e.block]
                phase = "backward" if self.gather == "unit" else "forward"
                out.append(Free(Key("gathered", f"{e.block} ({phase})"), unit, "params"))
                out += self._reduce(full.pop(current, []), e.block, device_grads)
                out.append(e)
                current = None
                continue
            if isinstance(e, Backward):
                e, made = _full_grads(e)
                (experts if inside else full.setdefault(current, [])).extend(made)
            out.append(e)
        tail = [Free(Key("gathered", "root"), self.root, "params")]
        tail += self._reduce(full.pop(None, []), None, device_grads)
        if self.scattering is not None:    # the root's post-backward callback lets go of the last
            tail.append(Free(self.scattering[0], self.scattering[1], "transient"))
            self.scattering = None
        cut = len(out) - 1 if out and isinstance(out[-1], Free) and out[-1].key.kind == "vgrad" else len(out)
        return tuple(out[:cut] + tail + out[cut:])

    def _backward(self, events, device_grads: bool) -> tuple:
        if self.stage < 2:
            return events
        if self.fsdp:
            return self._backward_fsdp(events, device_grads)
        out, full, current = [], {}, None
        last = self._last_copies(events, "backward")
        if self.bucket != 0 and self.stage < 3:      # stage_1_and_2.py backward(): the ipg buffer
            out.append(Alloc(Key("ipg bucket", "backward"), self.bucket, "transient"))
        for e in events:
            if isinstance(e, Begin):
                out.append(e)
                current = (e.block, e.copy)
                if self.gather == "unit":
                    out += self._gathered(e.block, "backward", current == last)
                continue
            if isinstance(e, End):
                out += self._reduce(full.pop(current, []), e.block, device_grads)
                unit = self.units[e.block]
                if self.gather == "unit":
                    if self._prefetch("backward") and current != last:
                        out.append(Free(Key("prefetched", f"{e.block} (backward)"), self._prefetch("backward") * unit,
                                        "params"))
                    out.append(Free(Key("gathered", f"{e.block} (backward)"), unit, "params"))
                elif self.gather == "keep":
                    out.append(Free(Key("gathered", f"{e.block} (forward)"), unit, "params"))
                out.append(e)
                current = None
                continue
            if isinstance(e, Backward):
                e, made = _full_grads(e)
                if self.gather is None:      # DeepSpeed ZeRO-2: into the ipg bucket as each hook fires
                    e = replace(e, events=e.events + tuple(self._reduce(made, None, device_grads)))
                else:
                    full.setdefault(current, []).extend(made)
            out.append(e)
        tail = self._reduce(full.pop(None, []), None, device_grads)
        if self.gather is not None:
            tail.append(Free(Key("gathered", "root"), self.root, "params"))
        if self.bucket != 0 and self.stage < 3:
            tail.append(Free(Key("ipg bucket", "backward"), self.bucket, "transient"))
        # before the loss's gradient is let go (the last event of backward)
        cut = len(out) - 1 if out and isinstance(out[-1], Free) and out[-1].key.kind == "vgrad" else len(out)
        return tuple(out[:cut] + tail + out[cut:])

    def _reduce(self, made: list, block, device_grads: bool) -> list:
        """The full gradients ``made`` reduce-scattered: the partition kept, the full ones freed;
        under FSDP first copied, padded, into the flat reduce-scatter input."""
        if not made:
            return []
        out = []
        if self.fsdp:
            # FSDP2's foreach_reduce: the previous unit's input let go, this unit's gradients
            # copied padded into one flat input (chunk_cat), kept until the next unit reduces
            if self.scattering is not None:
                out.append(Free(self.scattering[0], self.scattering[1], "transient"))
            total = sp.expand(sum(((x.nbytes if self.reduce_half else self._master(x.nbytes))
                                   * self._degree(x.key.name) * self._shard(x.key.name, 1) for x in made), ZERO))
            self.scattering = (Key("reduce-scatter input", block or "root"), total)
            out += [Alloc(self.scattering[0], total, "transient"),
                    Mark("backward", f"reduce-scatter {block or 'root'}")]
        out += [Free(Key("full grad", x.key.name, x.key.copy), x.nbytes, "transient") for x in made]
        if device_grads and (self.fsdp or self.stage < 3):     # ZeRO-3's partition exists from the start
            out += [Alloc(x.key, self._shard(x.key.name, self._master(x.nbytes)), "grads") for x in made]
        experts = self.fsdp and bool(block) and block.endswith(".experts")
        # foreach_reduce's loop over (parameter, gradient) pairs (world size > 1) leaves its
        # variable bound to the unit's last gradient until it returns: the experts' down_proj's
        # (their module's last parameter). Another unit's last parameter is its module's last
        # registered (a decoder layer's post_attention_layernorm), which the graph does not
        # record: not counted there (the note at the top of this module)
        last = [x.nbytes for x in made if x.key.name == self.last_expert] if experts and not self.whole_experts else []
        if last:
            out.append(Mark("backward", f"reduce-scatter output {block}", (("transient", last[0]),)))
        if experts and self.whole_experts:
            # one rank: ``reduce_output.copy_(reduce_scatter_input / gradient_divide_factor)``
            out.append(Mark("backward", f"reduce-scatter divide {block}", (("transient", total),)))
        if self.reduce_half and device_grads:     # the half-precision output, cast to the float32 shards
            out.append(Mark("backward", f"reduce-scatter cast {block or 'root'}",
                            (("transient", total / self._degree(made[0].key.name)), *(("transient", x) for x in last))))
        return out

    # ----- the step -------------------------------------------------------------------------
    def _optimizer(self, events) -> tuple:
        if self.stage < 1:
            return events
        if self.fsdp and not self.par.offload_optimizer:
            return self._optimizer_fsdp(events)
        out = []
        for e in events:
            if self.par.offload_optimizer:     # the step runs on the host
                if isinstance(e, Alloc) and e.key.kind == "master grads":
                    continue
                if isinstance(e, Mark):
                    e = replace(e, extra=())
            else:
                if isinstance(e, Alloc) and e.key.kind == "master grads":
                    e = replace(e, nbytes=e.nbytes / self.n)
                elif isinstance(e, Mark) and not e.node.startswith("grad scaler"):
                    e = replace(e, extra=tuple((r, x / self.n) for r, x in e.extra))
            out.append(e)
        return tuple(out)

    def _optimizer_fsdp(self, events) -> tuple:
        """The step on each rank's local shards: the optimizer's temporaries derived again for
        parameters of ``ceiling(dim0 / n)`` rows (rank 0's, the largest; ``n / e`` for the experts'
        beside expert parallelism)."""
        from ..lowering import _param_order, own_dtype
        policy = self.policy

        def local(p):
            k = self._degree(p.name)
            p = self.local.get(p.name, p)
            return replace(p, shape=(sp.ceiling(p.shape[0] / k), *p.shape[1:])) if p.shape else p
        trained = [(local(p), m) for p, m in self.graph.params() if p.trainable]
        order = [local(p) for p in _param_order(self.graph.items) if p.trainable]
        rebind = own_dtype([p for p, _ in trained])
        # one mark per distinct size (of the local shards: not the whole parameters' sizes)
        temps = [Mark("optimizer", where, (("transient", temp.xreplace(rebind)),))
                 for where, temp in policy.opt.step_temps(policy.impl, order, trained, policy.device)]
        whole = sp.expand(sum((p.numel * m for p, m in self.params if p.trainable and p.dtype is None), ZERO))
        out = []
        for e in events:
            if isinstance(e, Alloc) and e.key.kind == "master grads" and self.mp:
                continue        # the gradient shards are float32 already: stepped as they are
            if isinstance(e, Alloc) and e.key.kind == "master grads":     # the rank's float32 copy
                local_numel = sp.expand(sum((p.numel * m for p, m in trained if p.dtype is None), ZERO))
                e = replace(e, nbytes=sp.expand(e.nbytes / whole * local_numel))
            elif isinstance(e, Mark) and not e.node.startswith("grad scaler"):
                out += temps
                temps = []
                continue
            out.append(e)
        return tuple(out)


def _bracketed(events, layers: set) -> tuple:
    """The events with each run of a written-out layer's operators (forward) or backwards
    between a ``Begin``/``End`` of copy 0, so that it is gathered as a unit as an iteration
    is; the frees that follow its last operator are its own (its internal values)."""
    if not layers:
        return events
    out, cur = [], None
    for e in events:
        node = e.node if isinstance(e, (Compute, Backward)) else None
        if node is not None or isinstance(e, (Begin, End)):
            unit = next((x for x in layers if node is not None and node.startswith(x + "/")), None)
            if unit != cur:
                if cur is not None:
                    out.append(End(cur, 0))
                if unit is not None:
                    out.append(Begin(unit, 0, sp.Integer(1)))
                cur = unit
        out.append(e)
    if cur is not None:
        out.append(End(cur, 0))
    return tuple(out)


def _unbracketed(events) -> tuple:
    """The events without :func:`_bracketed`'s markers."""
    return tuple(e for e in events if not (isinstance(e, (Begin, End)) and e.copy == 0))


def _full_grads(e: Backward) -> tuple:
    """A node's backward with the parameter gradients it makes turned into whole, transient
    gradients (``full grad``: reduced into the rank's shard later), and those allocations."""
    inner, made = [], []
    for x in e.events:
        if isinstance(x, Alloc) and x.role == "grads":
            made.append(x)
            x = replace(x, key=Key("full grad", x.key.name, x.key.copy), role="transient")
        inner.append(x)
    return replace(e, events=tuple(inner)), made


def _expert_params(graph) -> set:
    """The names of the parameters the experts module holds under expert parallelism
    (:func:`symmem.models.mixtral.in_ep_experts`)."""
    from ..models.mixtral import in_ep_experts
    return {p.name for n in graph.nodes() if in_ep_experts(n.name) for p in n.params}


def _blocks_with(graph, names: set) -> set:
    """The repeated blocks whose bodies hold any of the parameters ``names``."""
    return {rep.name for rep in graph.repeats() if names & set(rep.body._params)}
