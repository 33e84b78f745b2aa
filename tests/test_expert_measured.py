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


def _rank(rank, world_size, precision, E, K, optimizer, b, s, routing="balanced"):
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
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("ep", "tp"))
    plan = {}
    for i in range(cfg.num_hidden_layers):       # Mixtral's base_model_ep_plan, expanded
        plan |= {f"model.layers.{i}.mlp.experts.gate_up_proj": "grouped_gemm",
                 f"model.layers.{i}.mlp.experts.down_proj": "grouped_gemm",
                 f"model.layers.{i}.mlp.experts": "ep_dispatch_experts"}
    apply_expert_parallelism(model, mesh["ep"], mesh["tp"], plan)
    ids = torch.randint(0, 100, (b, s), generator=torch.Generator().manual_seed(rank))

    def loss(m):
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):
            return m(ids, labels=ids).loss
    return RankSetup(model, loss, _optimizer(optimizer, model.parameters()), [ids])


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
