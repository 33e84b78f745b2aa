"""Cross-layer weight sharing as ALBERT does it (Lan et al. 2019): Hugging Face's GPT-2 with
one block object in every layer (``transformer.h = ModuleList([block] * L)``), trained one
step on the CPU, against ``graph.with_shared_layers("h")``: the weights once, the
activations L times, the gradients of the L layers summed into one per weight.
"""
import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.measure import param_bytes, saved_bytes, training_step  # noqa: E402
from helpers import assert_step_exact  # noqa: E402
from test_gpt2_measured import POINTS, graph_of, hf_model, loss_fn, optimizer  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402
from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

transformers.logging.set_verbosity_error()

CASES = [(POINTS[0], "fp32", "adamw", "for-loop"), (POINTS[1], "bf16-mixed", "adamw", "for-loop"),
         (POINTS[1], "fp32", "sgd", "foreach"), (POINTS[2], "bf16-mixed", "sgd-momentum", "for-loop")]


def shared_model(point):
    b, s, h, a, L, V, P, act = point
    cfg, model = hf_model(h, a, L, V, P, act)
    block = model.transformer.h[0]
    model.transformer.h = torch.nn.ModuleList([block] * L)
    return cfg, model


@pytest.mark.parametrize("point,precision,opt,impl", CASES,
                         ids=[f"b{p[0]}-L{p[4]}-{pr}-{o}-{i}" for p, pr, o, i in CASES])
def test_shared_layers_exact(point, precision, opt, impl):
    b, s, h, a, L, V, P, act = point
    cfg, model = shared_model(point)
    est = sm.estimate(graph_of(cfg).with_shared_layers("h"), sm.Policy(precision, opt, "cpu", impl))
    ev = est.at(b=b, s=s)
    ids = torch.randint(0, V, (b, s))
    assert ev.bytes["params"] == param_bytes(model)
    fwd = loss_fn(model, ids, precision)
    assert ev.bytes["activations"] == saved_bytes(fwd, exclude=model).total
    report = training_step(model, lambda m: fwd(), optimizer(opt, impl, model.parameters()), extra=(ids,))
    assert_step_exact(est, report, b, s)


def test_shared_weights_are_counted_once():
    """GPT-2 small with ALBERT's sharing: 12 layers of 7,087,872 weights become one; the
    activations are the same as without sharing."""
    g = sm.models.preset("gpt2")
    own, shared = sm.estimate(g), sm.estimate(g.with_shared_layers("h"))
    per_layer = 12 * 768**2 + 13 * 768                     # 7,087,872
    assert shared.graph.param_count().xreplace(shared.bindings) == 124_439_808 - 11 * per_layer
    assert own.at(b=2, s=64).bytes["activations"] == shared.at(b=2, s=64).bytes["activations"]
    with pytest.raises(sm.errors.UnknownName, match="unknown repeated block 'layers'"):
        g.with_shared_layers("layers")


# ----------------------------------------------------------------------------- shared QKV

def shared_qkv_forward(self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None,
                       encoder_attention_mask=None, output_attentions=False, **kwargs):
    """transformers' ``GPT2Attention.forward`` (self-attention, no cache) with one projection for
    the query, the key and the value: ``c_attn`` is h x h and its output, viewed as heads, is all
    three (the seed's shared QKV projection)."""
    qkv = self.c_attn(hidden_states)
    query_states = key_states = value_states = qkv.view(*qkv.shape[:-1], -1, self.head_dim).transpose(1, 2)
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                eager_attention_forward)
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=self.attn_dropout.p if self.training else 0.0, scaling=self.scaling, **kwargs)
    attn_output = attn_output.reshape(*attn_output.shape[:-2], -1).contiguous()
    attn_output = self.c_proj(attn_output)
    attn_output = self.resid_dropout(attn_output)
    return attn_output, attn_weights


def shared_qkv_model(point, attention):
    b, s, h, a, L, V, P, act = point
    cfg, model = hf_model(h, a, L, V, P, act)
    cfg._attn_implementation = model.config._attn_implementation = attention
    cfg.shared_qkv = True               # read by graph_of: GPT2Config(shared_qkv=True)
    for block in model.transformer.h:
        block.attn.c_attn = Conv1D(h, h)
        block.attn.forward = types.MethodType(shared_qkv_forward, block.attn)
    return cfg, model


QKV_CASES = [(POINTS[0], "eager", "fp32", "adamw"), (POINTS[1], "sdpa", "bf16-mixed", "adamw"),
             (POINTS[2], "eager", "bf16-mixed", "sgd"), (POINTS[3], "sdpa", "fp32", "sgd-momentum")]


@pytest.mark.parametrize("point,attention,precision,opt", QKV_CASES,
                         ids=[f"b{p[0]}-h{p[2]}-{at}-{pr}-{o}" for p, at, pr, o in QKV_CASES])
def test_shared_qkv_exact(point, attention, precision, opt):
    """One h x h projection instead of the 3h-wide one: its weight, gradient and states a third,
    its output a third, and attention's saved query, key and value one storage."""
    b, s, h, a, L, V, P, act = point
    cfg, model = shared_qkv_model(point, attention)
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, opt, "cpu", "for-loop"))
    ev = est.at(b=b, s=s)
    ids = torch.randint(0, V, (b, s))
    assert ev.bytes["params"] == param_bytes(model)
    fwd = loss_fn(model, ids, precision)
    assert ev.bytes["activations"] == saved_bytes(fwd, exclude=model).total
    report = training_step(model, lambda m: fwd(), optimizer(opt, "for-loop", model.parameters()), extra=(ids,))
    assert_step_exact(est, report, b, s)


def test_shared_qkv_parameters():
    """GPT-2 small: c_attn's 768 x 2304 weight and 2304 bias become 768 x 768 and 768, in each
    of 12 layers: 12 * (2 * 768**2 + 2 * 768) = 14,174,208 weights fewer."""
    own = sm.models.preset("gpt2")
    shared = sm.models.build_gpt2(sm.models.GPT2Config(shared_qkv=True))
    assert (own.param_count() - shared.param_count()).xreplace(own.bindings) == 14_174_208
