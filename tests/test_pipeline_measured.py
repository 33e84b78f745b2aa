"""Pipeline stages against Hugging Face's ``LlamaForCausalLM`` cut into stages on the CPU, each
rank's schedule run as Megatron-LM runs it (``forward_backward_pipelining_without_interleaving``
and GPipe's all-forwards-first), the rank alone: what it receives from its neighbours (the
previous stage's output, the next stage's gradient) is a new tensor where a receive would make
one, the training loop keeps the latest micro-batch's token ids (as a loop over a DataLoader
keeps its ``batch``; a middle stage gets none), what it sends is freed once sent (Megatron's ``deallocate_output_tensor``; its one-element
placeholder is an empty tensor here, 0 bytes instead of Megatron's 4 per micro-batch in
flight), and backward starts from the received gradient through autograd's engine as
Megatron's ``custom_backward`` does; the last stage's loss (divided by the micro-batches) is
let go of once its backward has run, as Megatron pops it. Live bytes of every storage, to the byte.
"""
import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.measure import param_bytes, schedule_step  # noqa: E402
from test_gpt2_measured import optimizer  # noqa: E402

transformers.logging.set_verbosity_error()


def actions(schedule: str, p: int, m: int, r: int) -> list:
    """Rank ``r``'s forwards and backwards in order (Megatron's 1F1B: min(p - r - 1, m)
    warm-up forwards, then a forward and a backward in turn, then the rest of the backwards)."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(p - r - 1, m)
    out = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        out += [("F", warm + i), ("B", i)]
    return out + [("B", i) for i in range(m - warm, m)]


def stage(model, r: int, p: int):
    """Rank ``r``'s part of ``model``: its layers, the embedding on the first, the norm and
    the output layer on the last."""
    part = copy.deepcopy(model)
    per = model.config.num_hidden_layers // p
    part.model.layers = torch.nn.ModuleList(list(part.model.layers)[r * per:(r + 1) * per])
    part.model.config.num_hidden_layers = per
    if r > 0:
        part.model.embed_tokens = None
    if r < p - 1:
        part.model.norm = torch.nn.Identity()
        part.lm_head = None
    return part


def run_rank(model, cfg, r, p, m, schedule, b, s, precision, opt):
    part = stage(model, r, p)
    dtype = next(part.parameters()).dtype
    first, last = r == 0, r == p - 1
    outs, ins, batch = {}, {}, {}
    gen = torch.Generator().manual_seed(r)

    def forward(i):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            ids = torch.randint(0, cfg.vocab_size, (b, s), generator=gen) if first or last else None
            batch["ids"] = ids          # the loop's batch: the latest micro-batch's, until the next
            if not first:       # received: a new buffer that requires grad
                ins[i] = torch.randn(b, s, cfg.hidden_size, dtype=dtype, generator=gen).requires_grad_()
            if last:
                out = part(inputs_embeds=ins[i], labels=ids).loss / m
            else:
                out = part.model(**({"input_ids": ids} if first else {"inputs_embeds": ins[i]})).last_hidden_state
                out.data = torch.empty(0, dtype=out.dtype)      # sent, then freed
        outs[i] = out

    def backward(i):
        out = outs.pop(i)
        if last:
            out.backward()
        else:
            grad = torch.randn(b, s, cfg.hidden_size, dtype=dtype, generator=gen)
            torch.autograd.Variable._execution_engine.run_backward(
                (out,), (grad,), False, False, (), True, True)
            del grad
        del out
        if not first:
            ins.pop(i)          # its gradient sent back

    report = schedule_step(part, optimizer(opt, "for-loop", part.parameters()), actions(schedule, p, m, r),
                           forward, backward)
    return part, report


CASES = [
    # p, m, schedule, precision, opt
    (2, 4, "1f1b", "fp32", "adamw"),
    (4, 6, "1f1b", "fp32", "sgd"),
    (4, 2, "1f1b", "bf16-mixed", "adamw"),
    (2, 3, "gpipe", "fp32", "adamw"),
]


@pytest.mark.parametrize("p,m,schedule,precision,opt", CASES)
def test_llama_stages_exact(p, m, schedule, precision, opt):
    b, s, h, f, a, k, L, V = 2, 16, 32, 64, 4, 2, 8, 100
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=h, intermediate_size=f, num_attention_heads=a, num_key_value_heads=k,
                                   num_hidden_layers=L, vocab_size=V, max_position_embeddings=64,
                                   attn_implementation="eager", use_cache=False, bos_token_id=0, eos_token_id=0,
                                   pad_token_id=None)
    model = transformers.LlamaForCausalLM(cfg)
    model.train()
    graph = sm.models.from_hf_config({**cfg.to_dict(), "attn_implementation": "eager"})
    est = sm.estimate(graph, sm.Policy(precision, opt, "cpu", "for-loop",
                                       parallel=f"pp={p},microbatches={m},schedule={schedule}"))
    for r in range(p):
        part, report = run_rank(model, cfg, r, p, m, schedule, b, s, precision, opt)
        rank = est.ranks[r]
        ev = rank.at(b=b, s=s)
        assert ev.bytes["params"] == param_bytes(part)
        subs = rank._subs({"b": b, "s": s})
        predicted = {phase: max(int(q.total.xreplace(subs)) for q in rank.timeline if q.phase == phase)
                     for phase in report.phase_peaks}
        assert (r, predicted, ev.peak) == (r, report.phase_peaks, report.peak), (ev.peak_point.where, report.peak_phase, report.peak_op, report.peak_micro)
