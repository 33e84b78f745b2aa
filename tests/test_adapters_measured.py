"""LoRA against ``peft``: Hugging Face's GPT-2 with ``get_peft_model`` (every base weight
frozen, rank-r adapters on the targets), trained one step on the CPU; parameters, bytes
saved for backward, the peak, its phase and every phase's maximum, exact.
"""
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import symmem as sm  # noqa: E402
from symmem.measure import param_bytes, saved_bytes, training_step  # noqa: E402
from helpers import assert_step_exact  # noqa: E402
from test_gpt2_measured import POINTS, graph_of, hf_model, loss_fn, optimizer  # noqa: E402

transformers.logging.set_verbosity_error()
# get_peft_model asks transformers whether checkpointing is on, through a name it deprecates
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

CASES = [  # point, attention, precision, rank, targets, optimizer
    (POINTS[0], "eager", "fp32", 4, ("c_attn",), "adamw"),
    (POINTS[0], "eager", "bf16-mixed", 4, ("c_attn",), "adamw"),
    (POINTS[1], "sdpa", "fp32", 8, ("c_attn", "c_proj"), "adamw"),
    (POINTS[1], "sdpa", "bf16-mixed", 2, ("c_attn", "c_proj", "c_fc"), "sgd"),
    (POINTS[2], "eager", "bf16-mixed", 8, ("c_fc", "c_proj"), "adam"),
    # a bfloat16 (float16) model: peft upcasts the adapters to float32
    (POINTS[0], "eager", "bf16", 4, ("c_attn", "c_fc"), "adamw"),
    (POINTS[1], "sdpa", "fp16", 8, ("c_attn",), "sgd"),
    # wide layers, a small vocabulary: the forward's peak at the adapters, where the caller's
    # argument (mlp.c_proj's input) and ln_2 (held by the block and by c_fc's call) live on
    ((2, 8, 128, 4, 4, 20, 16, "gelu_new"), "eager", "bf16", 2, ("c_proj",), "adamw"),
    ((2, 8, 128, 4, 4, 20, 16, "gelu_new"), "eager", "bf16", 2, ("c_fc",), "adamw"),
]
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def lora_model(point, attention, rank, targets, precision="fp32", upcast=True):
    b, s, h, a, L, V, P, act = point
    cfg, model = hf_model(h, a, L, V, P, act)
    if precision in HALF:
        model.to(HALF[precision])
    if attention != "eager":
        cfg._attn_implementation = attention
        model.config._attn_implementation = attention
    config = peft.LoraConfig(r=rank, lora_alpha=16, target_modules=list(targets), lora_dropout=0.0,
                             fan_in_fan_out=True)
    return cfg, peft.get_peft_model(model, config, autocast_adapter_dtype=upcast)


@pytest.mark.parametrize("point,attention,precision,rank,targets,opt", CASES,
                         ids=[f"b{p[0]}-s{p[1]}-{at}-{pr}-r{r}-{'+'.join(t)}-{o}" for p, at, pr, r, t, o in CASES])
def test_lora_exact(point, attention, precision, rank, targets, opt):
    b, s, h, a, L, V, P, act = point
    cfg, model = lora_model(point, attention, rank, targets, precision)
    if precision in HALF:
        assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, opt, "cpu", lora=rank, lora_targets=",".join(targets)))
    ev = est.at(b=b, s=s)
    ids = torch.randint(0, V, (b, s))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert ev.bytes["params"] == param_bytes(model)
    fwd = loss_fn(model, ids, precision) if precision not in HALF else (lambda: model(ids, labels=ids).loss)
    assert ev.bytes["activations"] == saved_bytes(fwd, exclude=model).total
    report = training_step(model, lambda m: fwd(), optimizer(opt, "for-loop", trainable), extra=(ids,))
    assert_step_exact(est, report, b, s)


MODEL_DTYPE = [(POINTS[0], "eager", "bf16", 4, ("c_attn", "c_fc"), "adamw"),
               (POINTS[1], "sdpa", "fp16", 8, ("c_attn",), "sgd-momentum")]


@pytest.mark.parametrize("point,attention,precision,rank,targets,opt", MODEL_DTYPE,
                         ids=[f"{at}-{pr}-r{r}-{'+'.join(t)}-{o}" for p, at, pr, r, t, o in MODEL_DTYPE])
def test_lora_in_the_models_dtype_exact(point, attention, precision, rank, targets, opt):
    """``get_peft_model(..., autocast_adapter_dtype=False)`` leaves the adapters in the model's
    half dtype (``lora_dtype="model"``): their weights, gradients and states in 2 bytes, no
    float32 copy of the input, no cast of their sum back."""
    b, s, h, a, L, V, P, act = point
    cfg, model = lora_model(point, attention, rank, targets, precision, upcast=False)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {HALF[precision]}
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, opt, "cpu", lora=rank, lora_targets=",".join(targets),
                                               lora_dtype="model"))
    ev = est.at(b=b, s=s)
    ids = torch.randint(0, V, (b, s))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert ev.bytes["params"] == param_bytes(model)
    fwd = lambda: model(ids, labels=ids).loss  # noqa: E731
    assert ev.bytes["activations"] == saved_bytes(fwd, exclude=model).total
    report = training_step(model, lambda m: fwd(), optimizer(opt, "for-loop", trainable), extra=(ids,))
    assert_step_exact(est, report, b, s)


# ----------------------------------------------------------------------------- the formulas

def test_rank_as_a_symbol():
    """``lora="r"`` keeps the rank in the formulas: the adapters' parameters are r*(in + out) per
    target, their gradients and AdamW's two states the same, and binding r gives the numbers."""
    from symmem.symbols import L, h, r
    sym = sm.estimate("gpt2", sm.Policy("bf16-mixed", "adamw", lora="r"))
    eight = sm.estimate("gpt2", sm.Policy("bf16-mixed", "adamw", lora=8))
    # c_attn: A (r x h), B (3h x r) in each of the L layers; float32 under autocast
    adapters = L * r * (h + 3 * h)
    assert sm.engine.canonical(sym.components["grads"] - adapters * sm.symbols.B_g) == 0
    assert r in sym.peak.free_symbols and r not in eight.components["grads"].free_symbols
    assert sym.at(b=4, s=512, r=8).peak == eight.at(b=4, s=512).peak
    # GPT-2 small: 12 * 8 * 4 * 768 = 294,912 trainable parameters, 4 bytes each
    assert eight.at(b=1, s=8).bytes["grads"] == 4 * 294_912


def test_lora_on_a_24_gb_card_is_one_command(capsys):
    """"Can I fine-tune this model with LoRA on a 24 GB card?": the largest batch, and its
    comparison with full fine-tuning."""
    from symmem.cli import main
    assert main(["max-batch", "--model", "gpt2-medium", "--seq", "1024", "--precision", "bf16-mixed",
                 "--lora", "16", "--lora-targets", "c_attn,c_proj", "--gpu", "RTX-4090", "--format", "json"]) == 0
    lora = json.loads(capsys.readouterr().out)
    assert main(["max-batch", "--model", "gpt2-medium", "--seq", "1024", "--precision", "bf16-mixed",
                 "--gpu", "RTX-4090", "--format", "json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert lora["max_batch"] > full["max_batch"] >= 1
    assert "LoRA rank 16 on c_attn, c_proj, the rest frozen" in lora["policy"]


@pytest.mark.parametrize("kwargs,words", [
    ({"lora": 0}, "lora = 0 is not valid: expected a rank >= 1"),
    ({"lora": -4}, "lora = -4 is not valid"),
    ({"lora": "eight"}, "lora = 'eight' is not valid"),
    ({"lora": 8, "lora_targets": "q_proj"}, "lora_targets = 'q_proj' is not valid: expected a linear layer of "
                                            "'gpt2': one of c_attn, c_proj, c_fc, lm_head."),
    ({"lora": 8, "lora_targets": ""}, "lora_targets = '' is not valid"),
    ({"lora_dtype": "model"}, "lora_dtype = 'model' is not valid: expected adapters to place (--lora R)"),
    ({"lora": 8, "lora_dtype": "bf16"}, "unknown LoRA adapter dtype 'bf16'"),
])
def test_bad_lora_input_is_refused(kwargs, words):
    with pytest.raises(sm.errors.SymmemError) as e:
        sm.estimate("gpt2", sm.Policy(**kwargs))
    assert words in str(e.value)
