"""GPT-NeoX / Pythia against Hugging Face's own ``GPTNeoXForCausalLM`` on the CPU: random weights
from small configs, parallel and sequential residuals, partial rotary embeddings (a quarter, a
half, all of each head), eager and SDPA, fp32, bfloat16 autocast and a bfloat16 model;
parameters, buffers, saved bytes, the peak, its phase and every phase's maximum, to the byte.
"""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.errors import ConfigError, UnknownName  # noqa: E402
from symmem.measure import param_bytes  # noqa: E402
from helpers import assert_hf_step_exact  # noqa: E402

transformers.logging.set_verbosity_error()

# (b, s, h, f, a, L, V), parallel residual, rotary fraction, hidden dropout, attention, precision, optimizer
CASES = [
    ((2, 16, 32, 64, 4, 2, 100), True, 0.25, 0.0, "eager", "fp32", "adamw"),
    ((2, 16, 32, 64, 4, 2, 100), False, 0.25, 0.0, "sdpa", "fp32", "sgd"),
    ((2, 8, 128, 512, 4, 3, 20), True, 0.25, 0.0, "sdpa", "bf16", "adamw"),
    ((2, 8, 128, 512, 4, 3, 20), False, 1.0, 0.0, "eager", "bf16-mixed", "sgd"),
    ((2, 8, 128, 512, 4, 3, 20), True, 0.5, 0.0, "sdpa", "bf16-mixed", "adamw"),
    ((1, 16, 64, 128, 4, 2, 50), True, 0.5, 0.1, "eager", "fp32", "adamw"),
]


@pytest.mark.parametrize("point,parallel,pct,drop,attention,precision,opt", CASES,
                         ids=[f"b{p[0]}-h{p[2]}-{'par' if par else 'seq'}-rot{pct}-{at}-{pr}-{o}"
                              for p, par, pct, _, at, pr, o in CASES])
def test_gpt_neox_exact(point, parallel, pct, drop, attention, precision, opt):
    b, s, h, f, a, L, V = point
    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(hidden_size=h, intermediate_size=f, num_attention_heads=a, num_hidden_layers=L,
                                     vocab_size=V, use_parallel_residual=parallel, rotary_pct=pct, hidden_dropout=drop,
                                     attn_implementation=attention, use_cache=False)
    model = transformers.GPTNeoXForCausalLM(cfg)
    model.train()
    if precision == "bf16":
        model.to(torch.bfloat16)
    graph = sm.models.from_hf_config({**cfg.to_dict(), "attn_implementation": attention})
    est = sm.estimate(graph, sm.Policy(precision, opt, "cpu", "for-loop"))
    if b == 1:
        est = est.at_one
    ev = est.at(b=b, s=s)
    buffers = sum(t.untyped_storage().nbytes() for t in model.buffers())
    assert (ev.bytes["params"], ev.bytes["buffers"]) == (param_bytes(model), buffers)
    ids = torch.randint(0, V, (b, s))
    assert_hf_step_exact(est, model, ids, precision, opt, b, s)


#: GPTNeoXForCausalLM's parameters as transformers counts them (built on the meta device from
#: the presets' configs; Pythia's model cards round them: 160M, 1.0B, 12B; GPT-NeoX 20B)
COUNTS = {"pythia-160m": 162_322_944, "pythia-1b": 1_011_781_632, "pythia-12b": 11_846_072_320,
          "gpt-neox-20b": 20_554_567_680}


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_gpt_neox_preset_counts(name):
    """Pythia 160m: embeddings and untied head 2*50304*768 = 77,266,944; 12 layers of
    3*768^2 + 3*768 (qkv) + 768^2 + 768 (dense) + 2*768*3072 + 3072 + 768 (MLP) + 4*768 (norms)
    = 7,087,872 (85,054,464); the final norm 1536: 162,322,944."""
    assert sm.estimate(name, sm.Policy("fp32", "sgd")).at(b=1, s=128).bytes["params"] == 4 * COUNTS[name]


def test_rope_parameters_and_rotary_pct():
    """transformers 5 reads the rotated fraction from rope_parameters, older config.json files
    from rotary_pct: both give the same tables (d/2 * 0.25 inverse frequencies: 4 for d = 32)."""
    base = {"model_type": "gpt_neox", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 512, "vocab_size": 100}
    old = sm.estimate(sm.models.from_hf_config({**base, "rotary_pct": 0.25}), sm.Policy("fp32", device="cpu"))
    new = sm.estimate(sm.models.from_hf_config({**base, "rope_parameters": {"partial_rotary_factor": 0.25}}),
                      sm.Policy("fp32", device="cpu"))
    assert old.at(b=2, s=8).bytes == new.at(b=2, s=8).bytes
    assert old.at(b=2, s=8).bytes["buffers"] == 2 * 4 * 4


@pytest.mark.parametrize("changes,words", [
    ({"hidden_act": "relu"}, "unknown hidden_act 'relu'"),
    ({"rotary_pct": 0.3}, "partial_rotary_factor = 0.3 is not valid: expected a fraction that rotates an even "
                          "whole number of the head's 32 dimensions"),
    ({"num_attention_heads": 5}, "hidden_size = 128 is not valid: expected a multiple of the number of attention "
                                 "heads (5)"),
])
def test_bad_gpt_neox_config_is_refused(changes, words):
    base = {"model_type": "gpt_neox", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 512, "vocab_size": 100}
    with pytest.raises((ConfigError, UnknownName)) as e:
        sm.models.from_hf_config({**base, **changes})
    assert words in str(e.value)
