"""Context parallelism measured: torch's load-balanced ring attention (``_templated_ring_attention``
and its backward, torch 2.13, the defaults of ``context_parallel``) run on 2 to 4 CPU processes
(gloo) over the CPU flash kernel, per rank, beside :mod:`symmem.passes.context`.

torch's ``context_parallel`` dispatches the CUDA SDPA kernels only; here the same ring functions
are called with ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward inside an
``autograd.Function`` that saves what the kernel's autograd node saves (q, k, v, the merged
output and log-sum-exp), which is how the ring runs below autograd under ``context_parallel``.
"""

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

import sympy as sp  # noqa: E402

from symmem.measure import training_step  # noqa: E402
from symmem.measure_dist import run_ranks  # noqa: E402
from symmem.passes.context import ring_backward, ring_forward  # noqa: E402
from symmem.symbols import c as C  # noqa: E402

aten = torch.ops.aten


def _forward_op(q, k, v, is_causal=False, scale=None, **_):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)


def _backward_op(query, key, value, out, logsumexp, is_causal=False, grad_out=None, scale=None, **_):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out, logsumexp,
                                                                     0.0, is_causal, scale=scale)


#: The inputs of the ring's collectives not yet waited for (see :class:`_Collectives`).
_PENDING = []


class _Collectives:
    """The ring's functional collectives (``ft_c.all_gather_single``, ``ft_c.permute_tensor``)
    run synchronously, returning once gloo's worker thread has let go of their tensors
    (``symmem.measure_dist._released``); their inputs are kept until the ring waits for the
    result (``_maybe_wait``), as an asynchronous collective's ``Work`` keeps them on NCCL. Gloo's
    worker otherwise drops a finished collective's input when it is next scheduled, a
    timing-dependent number of operators later."""

    def __init__(self, ft_c):
        self._ft_c = ft_c

    def __getattr__(self, name):
        return getattr(self._ft_c, name)

    @staticmethod
    def all_gather_single(x, gather_dim, group):
        from symmem.measure_dist import _released
        assert gather_dim == 0
        out = torch.empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]), dtype=x.dtype)
        _released([out, x], lambda o, i: dist.all_gather_into_tensor(o, i, group=group))
        _PENDING.append(x)
        return out

    @staticmethod
    def permute_tensor(x, dsts, group):
        from symmem.measure_dist import _released
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        out = torch.empty_like(x)
        send = [x.numel() if j == dsts[rank] else 0 for j in range(world)]
        receive = [x.numel() if dsts[j] == rank else 0 for j in range(world)]
        _released([out, x], lambda o, i: dist.all_to_all_single(o, i, receive, send, group=group))
        _PENDING.append(x)
        return out


def _synchronous_ring():
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring
    if not isinstance(ring.ft_c, _Collectives):
        ring.ft_c = _Collectives(ring.ft_c)
        wait = ring._maybe_wait

        def waited(tensor):
            _PENDING.clear()
            return wait(tensor)
        ring._maybe_wait = waited


class Ring(torch.autograd.Function):
    """Causal ring attention over the default process group (sequence dimension 2)."""

    @staticmethod
    def forward(ctx, q, k, v, scale=None):
        from torch.distributed.tensor.experimental._context_parallel import _attention as ring
        out, lse = ring._templated_ring_attention(dist.group.WORLD, 2, _forward_op, q, k, v, is_causal=True,
                                                  scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor.experimental._context_parallel import _attention as ring
        q, k, v, out, lse = ctx.saved_tensors
        return (*ring._templated_ring_attention_backward(dist.group.WORLD, 2, _backward_op, grad, "grad_out",
                                                         q, k, v, out, lse, True, scale=ctx.scale)[:3], None)


class _QKV(torch.nn.Module):
    def __init__(self, b, a, k, n, d, dtype):
        super().__init__()
        self.q = torch.nn.Parameter(torch.randn(b, a, n, d, dtype=dtype))
        self.k = torch.nn.Parameter(torch.randn(b, k, n, d, dtype=dtype))
        self.v = torch.nn.Parameter(torch.randn(b, k, n, d, dtype=dtype))


def _ring_rank(rank, world_size, b, a, k, n, d, dtype):
    _synchronous_ring()
    torch.manual_seed(rank)
    module = _QKV(b, a, k, n, d, dtype)
    report = training_step(module, lambda m: Ring.apply(m.q, m.k, m.v).sum(),
                           torch.optim.SGD(module.parameters(), lr=0.0), steps=2)
    return report.at_start, report.phase_peaks["forward"], report.phase_peaks["backward"]


@pytest.mark.parametrize("c,dtype,heads", [(2, "float32", (2, 2)), (4, "float32", (2, 2)), (3, "bfloat16", (4, 4)),
                                           (4, "bfloat16", (4, 1)), (2, "float32", (4, 2)), (3, "float32", (4, 1)),
                                           (2, "bfloat16", (2, 2)), (4, "bfloat16", (4, 2))])
def test_ring_attention_peaks_are_the_formulas(c, dtype, heads):
    b, (a, k), n, d = 2, heads, 8, 16          # n: the rank's positions, s / c
    ranks = run_ranks(_ring_rank, c, b, a, k, n, d, getattr(torch, dtype))
    B = 4 if dtype == "float32" else 2
    q, kv, lse = b * a * n * d * B, 2 * b * k * n * d * B, 4 * b * a * n
    qf, kvf = b * a * n * d * 4, 2 * b * k * n * d * 4
    start = q + kv                               # the rank's q, k, v
    # q, k and v are contiguous here: the ring copies none of them
    fwd = [sp.sympify(x).xreplace({C: c}) for x in ring_forward((q, qf), (kv, kvf), lse, B != 4, 0, c > 2).values()]
    bwd = [sp.sympify(x).xreplace({C: c}) for x in ring_backward((q, qf), (kv, kvf), lse, 0, c > 2).values()]
    # forward: the kernel's output and log-sum-exp, and the ring's largest moment
    predicted_forward = start + q + lse + max(fwd)
    # backward: the output, log-sum-exp, the loss and its gradient (scalars in the dtype), the
    # kernel's own gradients (q + kv) and the ring's larger moment
    predicted_backward = start + q + lse + 2 * B + q + kv + max(bwd)
    assert {r[0] for r in ranks} == {start}
    assert max(r[1] for r in ranks) == predicted_forward
    assert max(r[2] for r in ranks) == predicted_backward
    if (c, dtype, heads) == (4, "float32", (2, 2)):
        # Q = 2*2*8*16*4 = 2,048, KV = 4,096, L = 4*2*2*8 = 128. Forward: q, k, v 6,144 + output
        # and log-sum-exp 2,176 + the merge c KV + 3 Q + 2 L = 16,384 + 6,144 + 256. Backward: 6,144
        # + 2,176 + the loss and its gradient 8 + the kernel's gradients 6,144 + rank 0's half-query
        # step Qf + 3 KVf + (c + 2) KV + Q/2 + L/2 = 2,048 + 12,288 + 24,576 + 1,024 + 64.
        assert (predicted_forward, predicted_backward) == (31_104, 54_472)


# --------------------------------------------------------------------------- a Llama, c ranks

_CONFIG = dict(model_type="llama", hidden_size=32, intermediate_size=40, num_attention_heads=4,
               num_key_value_heads=2, num_hidden_layers=2, vocab_size=100, max_position_embeddings=64,
               attn_implementation="sdpa", use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=None)


def _ring_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` as ``context_parallel`` runs it: autocast's casts of
    q, k and v (the op is on its lower-precision list), then the ring below autocast."""
    assert attn_mask is None and is_causal and dropout_p == 0.0
    if torch.is_autocast_enabled("cpu"):
        half = torch.get_autocast_dtype("cpu")
        query, key, value = (x.to(half) if x.dtype == torch.float32 else x for x in (query, key, value))
    with torch.autocast("cpu", enabled=False):
        return Ring.apply(query, key, value, scale)


def _llama_cp_rank(rank, world_size, precision, s, config):
    """One rank of a Llama under context parallelism: its load-balanced half-chunks of every
    sequence (chunks ``rank`` and ``2c - 1 - rank`` of ``2c``) as input ids and labels; the
    model's own positions (the values differ from the rank's, the bytes do not)."""
    transformers = pytest.importorskip("transformers")
    from symmem.measure_dist import RankSetup
    _synchronous_ring()
    torch.nn.functional.scaled_dot_product_attention = _ring_sdpa
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in config.items()
                                                                      if k != "model_type"}))
    ids = torch.randint(0, config["vocab_size"], (2, s))
    chunks = ids.chunk(2 * world_size, dim=1)
    mine = torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=1).contiguous()

    def loss(m):
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):
            return m(mine, labels=mine).loss
    return RankSetup(model, loss, torch.optim.SGD(model.parameters(), lr=0.1, foreach=False), [mine])


@pytest.mark.parametrize("precision,c,vocab", [("fp32", 2, 100), ("bf16-mixed", 2, 8), ("fp32", 4, 8),
                                               ("bf16-mixed", 4, 8)])
def test_llama_context_parallel_rank_is_symmems(precision, c, vocab):
    # The most loaded rank's maximum of each phase, to the byte. Forward's is the loss (every
    # layer's saved tensors; the ring's forward moments are pinned above); backward's is one of
    # the ring's moments at the second step of a layer's attention with a vocabulary of 8, whose
    # logits are small: rank 0's kernel on half its queries at c = 2, the second concatenation
    # of the keys and values beside the first step's contiguous copies of them at c = 4 (HF's
    # k and v are transposed views). Ranks 0 to c - 2 merge their half-chunks by
    # concatenation, so their attention output is (b, a, s, d) and merging its heads copies it
    # (one more saved tensor a layer than the last rank: the last rank's forward is 2 * 8 * 32 * 4
    # = 2,048 bytes a layer lower at c = 2, fp32).
    import symmem as sm
    from symmem.measure_dist import distributed_step
    s, config = 16, {**_CONFIG, "vocab_size": vocab}     # 2c | s: each rank holds s / c = 8 or 4 positions
    ranks = distributed_step(lambda r, w: _llama_cp_rank(r, w, precision, s, config), c, steps=2)
    est = sm.estimate(sm.models.from_hf_config(config),
                      sm.Policy(precision, "sgd", "cpu", "for-loop", attention="sdpa", parallel=f"cp={c}"))
    subs = est._subs({"b": 2, "s": s})
    moments = {ph: [(int(p.total.xreplace(subs)), p.where) for p in est.timeline if p.phase == ph]
               for ph in ("forward", "backward", "optimizer")}
    predicted = {ph: max(m)[0] for ph, m in moments.items()}
    measured = {ph: max(r.step.phase_peaks[ph] for r in ranks) for ph in predicted}
    assert measured == predicted
    assert max(moments["forward"])[1] == "forward loss"
    if vocab == 8:
        assert "backward layers/self_attn/context (ring: " in max(moments["backward"])[1]
