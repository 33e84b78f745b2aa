"""OPT against Hugging Face's own ``OPTForCausalLM`` on the CPU: random weights from small
configs, pre- and post-layer norm, eager and SDPA, fp32, bfloat16 autocast and a bfloat16
model; parameters, saved bytes, the peak, its phase and every phase's maximum, to the byte.
"""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.errors import ConfigError, UnknownName  # noqa: E402
from symmem.measure import param_bytes  # noqa: E402
from helpers import assert_hf_step_exact  # noqa: E402

transformers.logging.set_verbosity_error()

# (b, s, h, f, a, L, V)
CASES = [
    ((2, 16, 32, 64, 4, 2, 100), True, "eager", "fp32", "adamw"),
    ((2, 16, 32, 64, 4, 2, 100), False, "sdpa", "fp32", "sgd"),
    ((2, 8, 128, 512, 4, 3, 20), True, "eager", "bf16-mixed", "sgd"),
    ((2, 8, 128, 512, 4, 3, 20), False, "eager", "bf16-mixed", "adamw"),
    ((2, 8, 128, 512, 4, 3, 20), True, "sdpa", "bf16", "adamw"),
    ((1, 16, 64, 128, 4, 2, 50), False, "eager", "fp32", "sgd"),
    # OPT 350m's shape: embeddings and head 16 wide, projected in and out of 32-wide layers
    ((2, 16, 32, 64, 4, 2, 100, 16), False, "sdpa", "bf16-mixed", "adamw"),
    ((2, 8, 32, 64, 4, 2, 100, 48), True, "eager", "fp32", "sgd"),
]


def hf_opt(point, pre, attention):
    b, s, h, f, a, L, V, *proj = point
    torch.manual_seed(0)
    cfg = transformers.OPTConfig(hidden_size=h, ffn_dim=f, num_attention_heads=a, num_hidden_layers=L,
                                 vocab_size=V, max_position_embeddings=64, word_embed_proj_dim=proj[0] if proj else h,
                                 do_layer_norm_before=pre, attn_implementation=attention, use_cache=False,
                                 pad_token_id=1, bos_token_id=2, eos_token_id=2)
    model = transformers.OPTForCausalLM(cfg)
    model.train()
    return cfg, model


@pytest.mark.parametrize("point,pre,attention,precision,opt", CASES,
                         ids=[f"b{p[0]}-h{p[2]}-{'pre' if pre else 'post'}-{at}-{pr}-{o}" + (f"-e{p[7]}" if p[7:] else "")
                              for p, pre, at, pr, o in CASES])
def test_opt_exact(point, pre, attention, precision, opt):
    b, s, h, f, a, L, V, *proj = point
    cfg, model = hf_opt(point, pre, attention)
    if precision == "bf16":
        model.to(torch.bfloat16)
    config = {**cfg.to_dict(), "attn_implementation": attention}
    if not proj:
        del config["word_embed_proj_dim"]   # the hidden size here: no projection
    est = sm.estimate(sm.models.from_hf_config(config), sm.Policy(precision, opt, "cpu", "for-loop"))
    if b == 1:
        est = est.at_one
    ev = est.at(b=b, s=s)
    assert ev.bytes["params"] == param_bytes(model)
    ids = torch.randint(3, V, (b, s))
    assert_hf_step_exact(est, model, ids, precision, opt, b, s)


#: OPT 350m: token embeddings 50272*512 = 25,739,264, positions 2050*1024 = 2,099,200, project_in
#: and project_out 2*512*1024 = 1,048,576, 24 post-norm layers of 4*(1024^2 + 1024) + 2*1024*4096
#: + 4096 + 1024 + 4*1024 = 12,596,224 (302,309,376), no final norm, the head tied.
OPT_350M = 25_739_264 + 2_099_200 + 1_048_576 + 302_309_376

#: OPTForCausalLM's parameters as transformers counts them (built on the meta device from the
#: presets' configs)
COUNTS = {"opt-125m": 125_239_296, "opt-350m": OPT_350M, "opt-1.3b": 1_315_758_080, "opt-6.7b": 6_658_473_984,
          "opt-66b": 65_719_701_504}


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_opt_preset_counts(name):
    """OPT 125m: token embeddings 50272*768 = 38,608,896, positions (2048 + 2)*768 = 1,574,400,
    12 layers of 4*(768^2 + 768) + 2*768*3072 + 3072 + 768 + 4*768 = 7,087,872 (85,054,464), the
    final norm 1536, the head tied: 125,239,296."""
    assert sm.estimate(name, sm.Policy("fp32", "sgd")).at(b=1, s=128).bytes["params"] == 4 * COUNTS[name]


@pytest.mark.parametrize("changes,words", [
    ({"word_embed_proj_dim": 0}, "word_embed_proj_dim = 0 is not valid"),
    ({"activation_function": "gelu"}, "unknown activation_function 'gelu'"),
    ({"num_attention_heads": 5}, "hidden_size = 32 is not valid: expected a multiple of the number of attention "
                                 "heads (5)"),
    ({"layerdrop": 0.1}, "layerdrop = 0.1 is not valid"),
])
def test_bad_opt_config_is_refused(changes, words):
    base = {"model_type": "opt", "hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 100, "max_position_embeddings": 64}
    with pytest.raises((ConfigError, UnknownName)) as e:
        sm.models.from_hf_config({**base, **changes})
    assert words in str(e.value)
