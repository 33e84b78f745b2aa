"""The vision transformer against Hugging Face's own ``ViTForImageClassification`` on the CPU:
random weights from small configs (no download), eager and SDPA attention, float32 and bfloat16
autocast and a bfloat16 model, with and without transformers' activation checkpointing
(``recompute="full"``); parameters, bytes saved for backward, the training step's peak, its
phase and every phase's maximum, to the byte; and the published parameter counts.
"""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.errors import ConfigError  # noqa: E402
from symmem.measure import param_bytes, saved_bytes, training_step  # noqa: E402
from symmem.symbols import n_c  # noqa: E402
from test_gpt2_measured import optimizer  # noqa: E402
from test_resnet_measured import assert_step_exact  # noqa: E402

transformers.logging.set_verbosity_error()

# b, h, a, L, f, image, patch, classes, attention, precision, optimizer, implementation, dropout
CASES = [
    (2, 32, 4, 2, 64, 16, 4, 10, "eager", "fp32", "adamw", "for-loop", 0.0),
    (2, 32, 4, 2, 64, 16, 4, 10, "sdpa", "bf16-mixed", "sgd", "for-loop", 0.0),
    (3, 64, 4, 3, 128, 32, 8, 5, "eager", "bf16-mixed", "adamw", "foreach", 0.0),
    (2, 32, 2, 2, 96, 24, 4, 7, "sdpa", "fp32", "sgd-momentum", "for-loop", 0.0),
    (2, 32, 4, 2, 64, 16, 4, 10, "eager", "fp32", "sgd", "for-loop", 0.1),      # dropout's noise
    (2, 32, 4, 2, 64, 16, 4, 10, "sdpa", "bf16", "sgd", "for-loop", 0.0),       # a bfloat16 model
    (2, 32, 4, 2, 64, 16, 4, 10, "eager", "bf16", "adamw", "for-loop", 0.0),
    # b = 1: the class token's gradient is a view keeping the whole (1, 17, 32) embedding
    # gradient through the step (fp32: 17 * 32 * 4 = 2,176 bytes where its own is 128)
    (1, 32, 4, 2, 64, 16, 4, 10, "eager", "fp32", "adamw", "for-loop", 0.0),
    (1, 32, 4, 2, 64, 16, 4, 10, "sdpa", "bf16-mixed", "sgd", "for-loop", 0.0),
    (1, 32, 4, 2, 64, 16, 4, 10, "eager", "bf16", "adamw", "for-loop", 0.0),
]


def hf_vit(h_, a_, L_, f_, image, patch, classes, attention, dropout=0.0):
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(hidden_size=h_, num_attention_heads=a_, num_hidden_layers=L_,
                                 intermediate_size=f_, image_size=image, patch_size=patch, num_labels=classes,
                                 hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                                 attn_implementation=attention)
    return cfg, transformers.ViTForImageClassification(cfg).train()


@pytest.mark.parametrize("b,h,a,L,f,image,patch,classes,attention,precision,opt,impl,dropout", CASES,
                         ids=[f"b{c[0]}-h{c[1]}-L{c[3]}-{c[5]}px-P{c[6]}-{c[8]}-{c[9]}-{c[10]}-p{c[12]}" for c in CASES])
def test_vit_exact(b, h, a, L, f, image, patch, classes, attention, precision, opt, impl, dropout):
    cfg, model = hf_vit(h, a, L, f, image, patch, classes, attention, dropout)
    assert_vit_step_exact(cfg, model, sm.Policy(precision, opt, "cpu", impl), b, image, classes)


def assert_vit_step_exact(cfg, model, policy, b, image, classes):
    """symmem's estimate of ``model`` under ``policy`` against its measured training step at
    batch ``b``: parameters, bytes saved for backward, the peak, its phase and every phase's
    maximum, to the byte (a bfloat16 policy puts the model and the images in bfloat16)."""
    keys = {**cfg.to_dict(), "attn_implementation": cfg._attn_implementation}
    est = sm.estimate(sm.models.from_hf_config(keys), policy)
    if b == 1:
        est = est.at_one
    ev = est.at(b=b)
    x = torch.randn(b, 3, image, image)
    if policy.precision == "bf16":      # model.to(bfloat16), and images in it
        model.to(torch.bfloat16)
        x = x.to(torch.bfloat16)
    assert ev.bytes["params"] == param_bytes(model)
    y = torch.randint(0, classes, (b,))

    def fwd(m=model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=policy.precision == "bf16-mixed"):
            return m(pixel_values=x, labels=y).loss
    assert ev.bytes["activations"] == saved_bytes(fwd, exclude=model).total
    opt = optimizer(policy.optimizer, policy.implementation, model.parameters())
    report = training_step(model, fwd, opt, extra=(x, y))
    assert_step_exact(est, report, b=b)


#: google/vit-base-patch16-224 and google/vit-large-patch16-224 (1000 ImageNet classes), as
#: transformers counts ViTForImageClassification's parameters
PUBLISHED = {"vit-base": 86_567_656, "vit-large": 304_326_632}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts(name):
    """ViT-B/16: patches 768*3*16*16 + 768 = 590,592; class token 768; positions
    (14*14 + 1)*768 = 151,296; 12 layers of 4*(768^2 + 768) + 2*768*3072 + 3072 + 768 + 4*768
    = 7,087,872; final norm 1,536; classifier 768,000 + 1,000: 86,567,656."""
    fam, cfg = sm.models.preset_config(name)
    g = fam.build(cfg)
    assert int(g.param_count().xreplace(g.bindings)) == PUBLISHED[name]
    hf = transformers.ViTConfig(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                                num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.intermediate_size,
                                num_labels=1000)
    with torch.device("meta"):
        model = transformers.ViTForImageClassification(hf)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]


def test_config_keys():
    keys = {"model_type": "vit", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 64, "image_size": 16, "patch_size": 4}
    g = sm.models.from_hf_config({**keys, "id2label": {"0": "a", "1": "b", "2": "c"}, "encoder_stride": 4})
    assert g.bindings[n_c] == 3
    with pytest.raises(ConfigError, match="a multiple of patch_size"):
        sm.models.from_hf_config({**keys, "image_size": 18})
    with pytest.raises(ConfigError, match="problem_type"):
        sm.models.from_hf_config({**keys, "problem_type": "multi_label_classification"})
    with pytest.raises(ConfigError, match="a square"):
        sm.models.from_hf_config({**keys, "image_size": [16, 32]})
    # b = 1: the class token's gradient keeps the whole embedding gradient, (1 + 16) * 32 * 4 =
    # 2,176 bytes where its own is 32 * 4 = 128: the optimizer step holds 2,048 more
    est = sm.estimate(sm.models.from_hf_config(keys), sm.Policy("fp32", "sgd", "cpu"))
    one = est.at_one
    assert one is not est
    subs = {**est._subs({}), sm.symbols.b: 1}
    step = [max(p.total.xreplace(subs) for p in e.timeline if p.phase == "optimizer") for e in (est, one)]
    assert step[1] - step[0] == 2048


RECOMPUTED = [
    # b, attention, precision
    (2, "eager", "fp32"),
    (2, "sdpa", "bf16-mixed"),
    (2, "eager", "bf16"),
    (2, "sdpa", "fp32"),
    (1, "sdpa", "bf16"),
    (1, "eager", "bf16-mixed"),
]


@pytest.mark.parametrize("b,attention,precision", RECOMPUTED, ids=[f"b{c[0]}-{c[1]}-{c[2]}" for c in RECOMPUTED])
def test_vit_recomputed_exact(b, attention, precision):
    """Hugging Face's activation checkpointing (non-reentrant) against ``recompute="full"``:
    each ViTLayer's checkpoint keeps its input and recomputes the layer in the backward, up to
    fc2. Under autocast fc2's recomputed input and weight copy are freed with its kernels, before
    the engine sums its bias's bfloat16 gradient (at b = 2, h = 32: 64 bytes that the peak
    would otherwise count beside the 4,352 + 4,096 of the two)."""
    import warnings
    from helpers import enable_checkpointing
    h, a, L, f, image, patch, classes = 32, 4, 2, 64, 16, 4, 10
    cfg, model = hf_vit(h, a, L, f, image, patch, classes, attention)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_checkpointing(model)
    assert_vit_step_exact(cfg, model, sm.Policy(precision, "adamw", "cpu", "for-loop", recompute="full"), b, image,
                          classes)
