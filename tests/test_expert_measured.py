"""Expert parallelism measured: transformers' own (``transformers/distributed/expert_parallel.py``,
``apply_expert_parallelism`` with Mixtral's ``base_model_ep_plan``: the experts' weights sharded
``grouped_gemm``, the dispatch ``ep_dispatch_experts`` through ``AllToAllEP``) on a small
``MixtralForCausalLM``, 2 and 4 CPU processes (gloo), each training its own batch, the routing
fixed balanced or worst (a forward hook on the router, as in tests/test_mixtral_measured.py),
beside :mod:`symmem.passes.expert`: every rank's parameters and each phase's maximum, to the
byte. The all-to-alls run synchronously (:class:`_AllToAll`), as NCCL's lifetimes are."""

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
transformers = pytest.importorskip("transformers")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

import symmem as sm  # noqa: E402
from symmem.measure_dist import RankSetup, distributed_step  # noqa: E402

transformers.logging.set_verbosity_error()


def _config(E, K):
    return dict(model_type="mixtral", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                num_key_value_heads=2, num_hidden_layers=2, vocab_size=100, num_local_experts=E,
                num_experts_per_tok=K, attn_implementation="eager", use_cache=False, bos_token_id=0,
                eos_token_id=0, pad_token_id=None)


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, foreach=False)
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single_autograd`` run synchronously, returning once gloo's worker thread has
    let go of its tensors (``symmem.measure_dist._released``), in forward and in backward: gloo's
    worker otherwise drops a finished collective's input a timing-dependent moment later, where
    NCCL's lets go of it at the wait (``_WaitTensor``, right after the call)."""

    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group):
        from symmem.measure_dist import _released
        ctx.splits, ctx.group = (output_split_sizes, input_split_sizes), group
        out = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
        _released([out, x], lambda o, i: dist.all_to_all_single(o, i, output_split_sizes, input_split_sizes,
                                                                 group=group))
        return out

    @staticmethod
    def backward(ctx, grad):
        from symmem.measure_dist import _released
        out_sizes, in_sizes = ctx.splits
        back = grad.new_empty((sum(in_sizes), *grad.shape[1:]))
        _released([back, grad], lambda o, i: dist.all_to_all_single(o, i, in_sizes, out_sizes, group=ctx.group))
        return back, None, None, None


def _rank(rank, world_size, precision, E, K, optimizer, b, s, routing="balanced", ep=None, fsdp=None):
    """One rank of ``world_size``: expert parallel over all of them, or (``fsdp``: "full" or
    "grad-op") over ``ep`` of them beside FSDP2 over all, as below."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed import expert_parallel
    from transformers.distributed.expert_parallel import apply_expert_parallelism
    expert_parallel.all_to_all_single_autograd = _AllToAll.apply
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**{k: v for k, v in _config(E, K).items() if k != "model_type"})
    model = transformers.MixtralForCausalLM(cfg)
    model.train()

    def route(module, args, out):
        # the router's indices rewritten in place (through .data: no allocation, no version bump):
        # balanced, token n's j-th pick is expert (n K + j) mod E; worst, experts 0..K-1 (rank 0's)
        flat = out[2].data.view(-1)
        torch.arange(flat.numel(), out=flat)
        flat.remainder_(E if routing == "balanced" else K)
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(route)
    ep = ep or world_size
    mesh = init_device_mesh("cpu", (world_size // ep, ep, 1), mesh_dim_names=("efsdp", "ep", "tp"))
    plan = {}
    for i in range(cfg.num_hidden_layers):       # Mixtral's base_model_ep_plan, expanded
        plan |= {f"model.layers.{i}.mlp.experts.gate_up_proj": "grouped_gemm",
                 f"model.layers.{i}.mlp.experts.down_proj": "grouped_gemm",
                 f"model.layers.{i}.mlp.experts": "ep_dispatch_experts"}
    apply_expert_parallelism(model, mesh["ep"], mesh["tp"], plan)
    if fsdp:
        _fully_shard(model, mesh, world_size, fsdp == "full", precision == "bf16-master")
    ids = torch.randint(0, 100, (b, s), generator=torch.Generator().manual_seed(rank))

    def loss(m):
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):
            return m(ids, labels=ids).loss
    return RankSetup(model, loss, _optimizer(optimizer, model.parameters()), [ids])


def _fully_shard(model, mesh, world_size, reshard, mixed):
    """transformers' ``apply_fully_sharded_data_parallelism`` beside expert parallelism
    (``distributed/fsdp.py``), with torchtitan's units: each layer's experts on the ``efsdp``
    mesh (the ranks holding the same experts: world / ep), their gradients summed and divided
    by the world size (``set_gradient_divide_factor``, and ``set_force_sum_reduction_for_comms``
    where efsdp > 1: gloo has no PREMUL_SUM), then each layer and the root on all ranks.
    ``mixed``: ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from test_dist_measured import _reproducible_collectives
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed \
        else MixedPrecisionPolicy()
    everyone = mesh["efsdp", "ep"]._flatten("fsdp")
    for layer in model.model.layers:
        fully_shard(layer.mlp.experts, mesh=mesh["efsdp"], reshard_after_forward=reshard, mp_policy=mp)
        layer.mlp.experts.set_gradient_divide_factor(float(world_size))
        if mesh["efsdp"].size() > 1:
            layer.mlp.experts.set_force_sum_reduction_for_comms(True)
        fully_shard(layer, mesh=everyone, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=everyone, mp_policy=mp)
    for module in (*(layer.mlp.experts for layer in model.model.layers), *model.model.layers, model):
        _reproducible_collectives(module)


@pytest.mark.parametrize("precision,ep,E,K,optimizer,b,s", [
    ("fp32", 2, 4, 2, "sgd", 2, 8),
    ("bf16-mixed", 2, 4, 2, "adamw", 2, 8),
    ("fp32", 4, 8, 2, "adamw", 1, 16),
    ("fp32", 2, 4, 1, "sgd", 3, 8),
])
def test_mixtral_expert_parallel_rank_is_symmems(precision, ep, E, K, optimizer, b, s):
    ranks = distributed_step(lambda r, w: _rank(r, w, precision, E, K, optimizer, b, s), ep, steps=2,
                             keep_timeline=False)
    est = sm.estimate(sm.models.from_hf_config(_config(E, K)),
                      sm.Policy(precision, optimizer, "cpu", "for-loop", parallel=f"ep={ep}"))
    subs = est._subs({"b": b, "s": s})
    predicted = {ph: max(int(p.total.xreplace(subs)) for p in est.timeline if p.phase == ph)
                 for ph in ("forward", "backward", "optimizer")}
    params = est.at(b=b, s=s).bytes["params"]
    if (E, ep) == (4, 2):
        # embedding and head 2 * 100 * 32, the final norm 32; per layer q, o 2 * 32 * 32, k, v 2 * 16 * 32,
        # two norms 2 * 32, the router 4 * 32 and 2 of the 4 experts 2 * 3 * 64 * 32: 37,536 floats
        assert params == 4 * (6_400 + 32 + 2 * (2_048 + 1_024 + 64 + 128 + 12_288)) == 150_144
    for r in ranks:
        assert r.params == params
        assert r.step.phase_peaks == predicted


@pytest.mark.parametrize("precision,ep", [("fp32", 2), ("bf16-mixed", 4)])
def test_worst_routing_loads_one_rank(precision, ep):
    # Every token's K = 2 picks are experts 0 and 1, both rank 0's; rank 0 receives every rank's b s K rows (ep b s K), the others none. symmem's ep_load="worst"
    # is rank 0's step to the byte, every phase.
    E, K, b, s = 2 * ep, 2, 2, 8
    ranks = distributed_step(lambda r, w: _rank(r, w, precision, E, K, "sgd", b, s, "worst"), ep, steps=2,
                             keep_timeline=False)
    est = sm.estimate(sm.models.from_hf_config(_config(E, K)),
                      sm.Policy(precision, "sgd", "cpu", "for-loop", parallel=f"ep={ep},ep_load=worst"))
    subs = est._subs({"b": b, "s": s})
    predicted = {ph: max(int(p.total.xreplace(subs)) for p in est.timeline if p.phase == ph)
                 for ph in ("forward", "backward", "optimizer")}
    assert ranks[0].step.phase_peaks == predicted
    for r in ranks[1:]:
        assert all(r.step.phase_peaks[ph] <= predicted[ph] for ph in predicted)


@pytest.mark.parametrize("world,ep,fsdp,precision,optimizer,expected", [
    # efsdp = 2: each expert sharded over the 2 ranks holding it
    (4, 2, "full", "fp32", "adamw", (475_124, 470_460, 281_592)),
    (4, 2, "full", "bf16-master", "adamw", (344_308, 357_332, 281_592)),
    (4, 2, "grad-op", "bf16-master", "sgd", (258_360, 257_600, 124_388)),
    # efsdp = 1: every rank its own experts whole (no all-gather; the gradients divided into a copy)
    (2, 2, "full", "fp32", "sgd", (363_776, 430_368, 248_612)),
])
def test_expert_parallel_beside_fsdp_is_symmems(world, ep, fsdp, precision, optimizer, expected):
    """FSDP2 beside transformers' expert parallelism on a two-layer Mixtral (E = 4, K = 2, b 2,
    s 8, balanced routing): every rank's parameters, gradients and each phase's maximum equal
    symmem's ``dp=world,ep=ep,fsdp=...``, to the byte. Under MixedPrecisionPolicy the experts'
    pre-forward casts the float32 routing weights to bfloat16 (the combine then in bfloat16),
    and at the experts' reduce-scatter output foreach_reduce still holds the down_proj's
    bfloat16 gradient (its loop variable): the backward maximum of the bf16-master case."""
    E, K, b, s = 4, 2, 2, 8
    ranks = distributed_step(lambda r, w: _rank(r, w, precision, E, K, optimizer, b, s, ep=ep, fsdp=fsdp), world,
                             steps=2, keep_timeline=False)
    est = sm.estimate(sm.models.from_hf_config(_config(E, K)),
                      sm.Policy(precision, optimizer, "cpu", "for-loop", parallel=f"dp={world},ep={ep},fsdp={fsdp}"))
    subs = est._subs({"b": b, "s": s})
    predicted = {ph: max(int(p.total.xreplace(subs)) for p in est.timeline if p.phase == ph)
                 for ph in ("forward", "backward", "optimizer")}
    # Per rank: the non-expert parameters, 6,400 + 32 + 2 * (2,048 + 1,024 + 64 + 128) = 12,960 floats,
    # over all ranks (every dim 0 divides 4 and 2); the rank's E / ep = 2 experts a layer,
    # 2 * 3 * 64 * 32 = 12,288 floats, over the world / ep ranks holding them; float32 shards
    shard = 4 * (12_960 // world + 2 * 12_288 // (world // ep))
    assert shard == {4: 62_112, 2: 124_224}[world]
    assert est.at(b=b, s=s).bytes["params"] == shard
    for r in ranks:
        assert (r.params, r.grads) == (shard, shard)
        assert r.step.phase_peaks == predicted == dict(zip(("forward", "backward", "optimizer"), expected))
