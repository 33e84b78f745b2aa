"""T5 against Hugging Face's own ``T5ForConditionalGeneration`` on the CPU: random weights from
small configs (no download), v1.0 (ReLU) and v1.1 (gated GELU, unscaled head), an inner
attention width other than d_model, fewer decoder layers, labels of another length than the
inputs; float32, bfloat16 autocast and a bfloat16 model; eager attention and SDPA (whose CPU
kernel with dropout is the math fallback, the position bias its float mask); transformers'
activation checkpointing against ``recompute="full"``, ``nth:N``, ``last:N`` and
``Recompute.layers``, and its attention function checkpointed against ``selective`` (SDPA in a
bfloat16 model refused, as are ``selective,reentrant`` and ``every:K``). Parameters, bytes
saved for backward, the training step's peak, its phase and every phase's maximum, to the byte.
"""
import pytest
import sympy as sp

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.errors import ConfigError, UnknownName  # noqa: E402
from symmem.measure import param_bytes, saved_bytes, training_step  # noqa: E402
from symmem.policy import Recompute  # noqa: E402
from helpers import saved_as_cuda_on_meta  # noqa: E402
from test_gpt2_measured import optimizer  # noqa: E402

transformers.logging.set_verbosity_error()

# (b, s, s_d, h, f, a, d_kv, L, L_d, V)
POINTS = [
    (2, 16, 8, 32, 64, 4, 8, 3, 3, 100),      # a * d_kv = h; decoder shorter than the encoder
    (2, 8, 12, 32, 64, 4, 16, 2, 2, 60),      # a * d_kv = 64 != h (the symbol d_h); decoder longer
    (3, 12, 6, 48, 96, 6, 8, 3, 2, 80),       # two decoder layers under three encoder layers
    (1, 16, 8, 32, 64, 4, 8, 3, 3, 100),      # b = 1 (Estimate.at_one)
]


def hf_t5(point, attention="eager", **extra):
    b, s, s_d, h, f, a, d_kv, L, L_d, V = point
    torch.manual_seed(0)
    cfg = transformers.T5Config(d_model=h, d_ff=f, num_heads=a, d_kv=d_kv, num_layers=L, num_decoder_layers=L_d,
                                vocab_size=V, attn_implementation=attention, use_cache=False,
                                decoder_start_token_id=0, **extra)
    model = transformers.T5ForConditionalGeneration(cfg)
    model.train()
    return cfg, model


def graph_of(cfg):
    return sm.models.from_hf_config({**cfg.to_dict(), "attn_implementation": cfg._attn_implementation})


def assert_t5_step_exact(est, model, ids, labels, precision, opt, impl="for-loop"):
    """Saved bytes, then the whole step: every phase's maximum, the peak and its phase."""
    b, s = ids.shape
    s_d = labels.shape[1]

    def fwd():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            return model(input_ids=ids, labels=labels).loss
    ev = est.at(b=b, s=s, s_d=s_d)
    assert ev.bytes["activations"] == saved_bytes(fwd, exclude=model).total
    report = training_step(model, lambda m: fwd(), optimizer(opt, impl, model.parameters()), extra=(ids, labels))
    subs = est._subs({"b": b, "s": s, "s_d": s_d})
    predicted = {phase: max(int(p.total.xreplace(subs)) for p in est.timeline if p.phase == phase)
                 for phase in report.phase_peaks}
    assert (predicted, ev.peak) == (report.phase_peaks, report.peak), (ev.peak_point.where, report.peak_op)
    assert ev.peak_point.phase == report.peak_phase


CASES = [
    # point, attention, feed_forward_proj, tie_word_embeddings, dropout_rate, precision, optimizer, implementation
    (POINTS[0], "eager", "relu", True, 0.1, "fp32", "adamw", "for-loop"),
    (POINTS[0], "eager", "relu", True, 0.1, "bf16-mixed", "adamw", "foreach"),
    (POINTS[0], "sdpa", "relu", True, 0.1, "bf16", "sgd", "for-loop"),
    (POINTS[1], "sdpa", "gated-gelu", False, 0.1, "bf16-mixed", "adamw", "for-loop"),
    (POINTS[1], "eager", "gated-gelu", False, 0.1, "bf16", "sgd-momentum", "for-loop"),
    (POINTS[2], "sdpa", "gated-gelu", False, 0.1, "fp32", "adam", "foreach"),
    (POINTS[2], "eager", "relu", True, 0.0, "bf16-mixed", "sgd", "for-loop"),     # no dropout: nothing saved for it
    (POINTS[3], "sdpa", "gated-gelu", False, 0.1, "bf16", "adamw", "for-loop"),
]


@pytest.mark.parametrize("point,attention,ff,tie,p,precision,opt,impl", CASES,
                         ids=[f"b{pt[0]}-s{pt[1]}-sd{pt[2]}-h{pt[3]}-dkv{pt[6]}-L{pt[7]}.{pt[8]}-{at}-{ff}-p{p}-{pr}-{o}-{i}"
                              for pt, at, ff, _, p, pr, o, i in CASES])
def test_t5_exact(point, attention, ff, tie, p, precision, opt, impl):
    """Parameters (the shared embedding tied to both stacks and the head, each stack's bucket
    table n_b x a), saved bytes, the peak, its phase and every phase's maximum. SDPA on the CPU
    with dropout runs the math kernel with the bias as its float mask: a contiguous copy of the
    encoder's bias per layer, the decoder's masked by ``torch.where`` (its bool condition saved)."""
    b, s, s_d, h, f, a, d_kv, L, L_d, V = point
    cfg, model = hf_t5(point, attention, feed_forward_proj=ff, tie_word_embeddings=tie, dropout_rate=p)
    if precision == "bf16":
        model.to(torch.bfloat16)
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, opt, "cpu", impl))
    if b == 1:
        est = est.at_one
    assert est.at(b=b, s=s, s_d=s_d).bytes["params"] == param_bytes(model)
    ids = torch.randint(0, V, (b, s))
    labels = torch.randint(0, V, (b, s_d))
    assert_t5_step_exact(est, model, ids, labels, precision, opt, impl)


RECOMPUTED = [
    # point, attention, feed_forward_proj, precision
    (POINTS[0], "eager", "relu", "fp32"),
    (POINTS[0], "sdpa", "relu", "fp32"),
    (POINTS[0], "eager", "relu", "bf16"),
    (POINTS[2], "eager", "gated-gelu", "fp32"),
    (POINTS[3], "eager", "gated-gelu", "bf16"),
    (POINTS[0], "eager", "relu", "bf16-mixed"),
    (POINTS[2], "sdpa", "gated-gelu", "bf16-mixed"),
]


@pytest.mark.parametrize("point,attention,ff,precision", RECOMPUTED,
                         ids=[f"b{pt[0]}-h{pt[3]}-L{pt[7]}.{pt[8]}-{at}-{ff}-{pr}" for pt, at, ff, pr in RECOMPUTED])
def test_t5_recomputed_exact(point, attention, ff, precision):
    """transformers' activation checkpointing of every T5Block (non-reentrant) against
    ``recompute="full"``: the first block of each stack, which computes the position bias, is
    checkpointed too (the bias is its output; the later blocks receive it as an argument their
    checkpoint keeps); T5Attention then makes the cross-attention's zero bias a leaf that
    requires grad (a (1, a, s_d, s) gradient kept as its ``.grad``, with it, through the step:
    4,096 bytes in float32 at the first point); the gated feed-forward's two halves are Python
    locals until ``wo`` (checkpointed, nothing else keeps them: 13,048 bytes of the forward's
    maximum at the third point). Under bfloat16 autocast too (eager and SDPA): the recomputed
    block keeps its Python locals again as forward does (T5LayerNorm's float32 output while q, k
    and v run), which the recompute pass models."""
    import warnings
    from helpers import enable_checkpointing
    b, s, s_d, h, f, a, d_kv, L, L_d, V = point
    cfg, model = hf_t5(point, attention, feed_forward_proj=ff, dropout_rate=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_checkpointing(model)
    if precision == "bf16":
        model.to(torch.bfloat16)
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, "adamw", "cpu", "for-loop", recompute="full"))
    if b == 1:
        est = est.at_one
    assert est.at(b=b, s=s, s_d=s_d).bytes["params"] == param_bytes(model)
    ids = torch.randint(0, V, (b, s))
    labels = torch.randint(0, V, (b, s_d))
    assert_t5_step_exact(est, model, ids, labels, precision, "adamw")


def checkpoint_t5(model, spec):
    """transformers' activation checkpointing of T5 (reentrant where ``spec`` says) as ``spec`` names it:
    ``nth:N`` through ``every_n_layers=N`` (transformers numbers the blocks of both stacks in
    one count); ``last:N`` and ``Recompute.layers`` with ``gradient_checkpointing`` switched
    off on each stack's other blocks (block 0 the first, written out in symmem)."""
    import warnings
    from helpers import enable_checkpointing
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        kwargs = {"use_reentrant": True} if spec.reentrant else {}
        if spec.mode == "nth":
            model.activation_checkpointing_enable(kwargs or None, every_n_layers=spec.k)
        else:
            enable_checkpointing(model, **kwargs)
    for stack in (model.encoder.block, model.decoder.block):
        n = len(stack)
        start, stop = {"full": (0, n), "nth": (0, n), "last": (0, n - spec.k)}.get(spec.mode, spec.span)
        for i, block in enumerate(stack):
            if spec.mode != "nth":
                block.gradient_checkpointing = start <= i < (n if stop is None else stop)
    return [[block.gradient_checkpointing for block in stack] for stack in (model.encoder.block, model.decoder.block)]


FOUR = (2, 16, 8, 32, 64, 4, 8, 4, 4, 100)          # POINTS[0] with four layers in each stack
SIX_FOUR = (2, 12, 6, 32, 64, 4, 8, 6, 4, 80)       # six encoder layers, four decoder layers
PARTIAL = [
    # point, spec, attention, feed_forward_proj, precision, the blocks checkpointed (encoder,
    # decoder), bytes saved for backward
    (FOUR, "nth:2", "eager", "relu", "fp32", ([1, 0, 1, 0], [1, 0, 1, 0]), 406_956),
    (FOUR, "nth:2", "sdpa", "relu", "fp32", ([1, 0, 1, 0], [1, 0, 1, 0]), 406_476),
    (FOUR, "nth:2", "eager", "relu", "bf16-mixed", ([1, 0, 1, 0], [1, 0, 1, 0]), None),
    # every_n_layers=2 over 6 + 4 blocks: the decoder's blocks 6, 8 in transformers' count
    (SIX_FOUR, "nth:2", "eager", "gated-gelu", "bf16", ([1, 0, 1, 0, 1, 0], [1, 0, 1, 0]), None),
    # nth:4 at four layers checkpoints block 0 of each stack alone (as last:3 does, the same step:
    # test_partial_modes_count_the_first_block)
    (FOUR, "nth:4", "eager", "relu", "fp32", ([1, 0, 0, 0], [1, 0, 0, 0]), 568_172),
    (SIX_FOUR, "last:2", "eager", "gated-gelu", "bf16", ([1, 1, 1, 1, 0, 0], [1, 1, 0, 0]), None),
    # every block but block 0 of each stack: the written-out block keeps its activations
    (POINTS[3], Recompute.layers(1), "eager", "relu", "fp32", ([0, 1, 1], [0, 1, 1]), None),
    # reentrant: the zero bias's gradient made but no .grad kept (full,reentrant kept 4,096
    # bytes too many before: the (1, 4, 8, 16) float32 bias and its gradient, 2 x 2,048)
    (POINTS[0], "full,reentrant", "sdpa", "relu", "fp32", ([1, 1, 1], [1, 1, 1]), None),
    (FOUR, "nth:2,reentrant", "eager", "relu", "fp32", ([1, 0, 1, 0], [1, 0, 1, 0]), None),
    (FOUR, "last:1,reentrant", "eager", "relu", "bf16-mixed", ([1, 1, 1, 0], [1, 1, 1, 0]), None),
]


@pytest.mark.parametrize("point,spec,attention,ff,precision,blocks,saved", PARTIAL,
                         ids=[f"L{pt[7]}.{pt[8]}-{sp_}-{at}-{ff}-{pr}" for pt, sp_, at, ff, pr, _, _ in PARTIAL])
def test_t5_partial_recompute_exact(point, spec, attention, ff, precision, blocks, saved):
    """Some blocks checkpointed: ``nth:N`` against transformers' ``every_n_layers=N``, ``last:N``
    and ``Recompute.layers`` against its checkpointing switched off on the other blocks, each
    stack's written-out first block counted as its layer 0 (``blocks``: which ones
    transformers checkpoints). The cross-attention's zero bias requires grad in every case
    (T5Attention's flag is set in every block), a leaf whose ``.grad`` is kept but under the
    reentrant checkpoint. Bytes saved, the peak, its phase and every phase's maximum."""
    spec = Recompute.parse(spec)
    b, s, s_d, h, f, a, d_kv, L, L_d, V = point
    cfg, model = hf_t5(point, attention, feed_forward_proj=ff, dropout_rate=0.1)
    assert checkpoint_t5(model, spec) == [[bool(x) for x in stack] for stack in blocks]
    if precision == "bf16":
        model.to(torch.bfloat16)
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, "adamw", "cpu", "for-loop", recompute=spec))
    if b == 1:
        est = est.at_one
    if saved is not None:
        assert est.at(b=b, s=s, s_d=s_d).bytes["activations"] == saved
    ids = torch.randint(0, V, (b, s))
    labels = torch.randint(0, V, (b, s_d))
    assert_t5_step_exact(est, model, ids, labels, precision, "adamw")


SELECTIVE = [
    # point, attention, feed_forward_proj, precision
    (POINTS[0], "eager", "relu", "fp32"),
    (POINTS[2], "eager", "gated-gelu", "bf16-mixed"),
    (POINTS[0], "eager", "relu", "bf16"),
    (POINTS[3], "sdpa", "gated-gelu", "fp32"),
]


@pytest.mark.parametrize("point,attention,ff,precision", SELECTIVE,
                         ids=[f"b{pt[0]}-L{pt[7]}.{pt[8]}-{at}-{ff}-{pr}" for pt, at, ff, pr in SELECTIVE])
def test_t5_selective_exact(point, attention, ff, precision, monkeypatch):
    """``selective`` against T5's attention function (eager's, or SDPA's, which makes the bias its
    mask) run in a non-reentrant ``torch.utils.checkpoint`` with q, k, v, the mask and the
    position bias as its arguments: the checkpoint keeps them (the bias, one tensor per stack
    and the cross-attention's zeros, counted once each); no block is checkpointed, so the zero
    bias needs no gradient. Bytes saved, the peak, its phase and every phase's maximum."""
    from transformers.models.t5 import modeling_t5
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    b, s, s_d, h, f, a, d_kv, L, L_d, V = point
    cfg, model = hf_t5(point, attention, feed_forward_proj=ff, dropout_rate=0.1)
    core = modeling_t5.eager_attention_forward if attention == "eager" else ALL_ATTENTION_FUNCTIONS["sdpa"]

    def checkpointed_core(module, q, k, v, mask, position_bias=None, **kwargs):
        def fn(q, k, v, mask, position_bias):
            return core(module, q, k, v, mask, position_bias=position_bias, **kwargs)
        return torch.utils.checkpoint.checkpoint(fn, q, k, v, mask, position_bias, use_reentrant=False)
    if attention == "eager":
        monkeypatch.setattr(modeling_t5, "eager_attention_forward", checkpointed_core)
    else:
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", checkpointed_core)
    if precision == "bf16":
        model.to(torch.bfloat16)
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, "adamw", "cpu", "for-loop", recompute="selective"))
    if b == 1:
        est = est.at_one
    ids = torch.randint(0, V, (b, s))
    labels = torch.randint(0, V, (b, s_d))
    assert_t5_step_exact(est, model, ids, labels, precision, "adamw")


def test_partial_modes_count_the_first_block():
    """The written-out first block is layer 0 of its stack: at four layers, nth:4 and last:3
    checkpoint it alone (the same step), layers(0, 1) too, and layers(1) every block but it;
    nth:1 is full. Formulas in L where a block's count allows: last:1 derived at L = 8 equals
    the model of 12 layers at L = 12; nth:4 at four layers holds for four only."""
    g4 = sm.models.from_hf_config({**BASE, "num_layers": 4})

    def at(spec, g=g4, **values):
        est = sm.estimate(g, sm.Policy("fp32", "adamw", "cpu", attention="eager", recompute=spec))
        return est.at(b=2, s=16, s_d=8, **values)

    def peak(spec, g=g4, **values):
        return at(spec, g, **values).peak
    assert peak("nth:4") == peak("last:3") == peak(Recompute.layers(0, 1))
    assert peak("nth:1") == peak("full") != peak(Recompute.layers(1))
    specs = ("nth:2", "nth:4", "full", "last:1", Recompute.layers(1))
    assert len({at(spec).bytes["activations"] for spec in specs}) == 5
    g8, g12 = ({**BASE, "num_layers": n} for n in (8, 12))
    assert peak("last:1", sm.models.from_hf_config(g8), L=12) == peak("last:1", sm.models.from_hf_config(g12))
    with pytest.raises(ConfigError) as e:
        peak("nth:4", L=8)
    assert "nth:4 checkpoints layer 0 of block 'encoder/blocks' alone" in str(e.value)


@pytest.mark.parametrize("spec,precision,attention,words", [
    ("full", "bf16", "sdpa", "expected eager attention for a T5 model in bf16 with checkpointed layers"),
    ("last:1", "bf16", "sdpa", "expected eager attention for a T5 model in bf16 with checkpointed layers"),
    ("selective", "bf16", "sdpa", "expected eager attention for a T5 model in bf16 with checkpointed attention"),
    ("selective", "bf16-mixed", "sdpa", "expected eager attention for a T5 model in bf16-mixed with "
     "checkpointed attention"),
])
def test_recompute_refused_where_not_exact(spec, precision, attention, words):
    """SDPA in a bfloat16 model with any recomputation, and with selective under autocast, is
    refused (the step measured differs: the module docstring of symmem.models.t5): the field,
    the value, what is expected and how to fix it. Layers checkpointed under autocast are not."""
    g = sm.models.from_hf_config(BASE)
    with pytest.raises(ConfigError) as e:
        sm.estimate(g, sm.Policy(precision, "adamw", "cpu", attention=attention, recompute=spec))
    text = str(e.value)
    assert text.startswith(f"recompute = '{spec}' is not valid") and words in text
    assert "leave recompute out" in text.lower()
    sm.estimate(g, sm.Policy(precision, "adamw", "cpu", attention=attention))     # without recompute: modelled
    sm.estimate(g, sm.Policy("bf16-mixed", "adamw", "cpu", attention=attention, recompute="last:1"))


@pytest.mark.parametrize("mode,words,fix", [
    ("every:2", "expected full or nth:N for 't5-small': layer 0 of block 'encoder/blocks' is written out",
     "Use --recompute full, or nth:N."),
    ("nth:4", "expected nth:K with K dividing the 6 layers of block 'encoder/blocks' (its written-out first "
     "layer included)", "For example nth:1, nth:2, nth:3, nth:6."),
    ("last:7", "expected last:N with N at most the 6 layers of block 'encoder/blocks'", "Keep fewer layers"),
    ("selective,reentrant", "expected selective (non-reentrant) for T5", "Drop ,reentrant"),
])
def test_recompute_modes_refused(mode, words, fix):
    """What stays refused for T5 (six layers in each stack): every:K (its regions would join the
    written-out first block to repeated ones), nth:N with N not dividing a stack's layers, a
    range past them, selective,reentrant (measured 6,144 bytes off in backward)."""
    with pytest.raises(ConfigError) as e:
        sm.estimate("t5-small", sm.Policy("fp32", "adamw", "cpu", attention="eager", recompute=mode))
    text = str(e.value)
    assert text.startswith(f"recompute = '{mode}' is not valid: ") and words in text and fix in text


# ----------------------------------------------------------------------------- formulas

def test_two_lengths_and_symbols():
    """The formula keeps s and s_d apart, d_h where a * d_kv != d_model, and n_b; the position
    bias's bucket table is n_b * a per stack. Parameters of a v1.0 T5 with a*d = h: the shared
    embedding V h, per encoder layer 4h^2 + 2fh + 2h, per decoder layer 8h^2 + 2fh + 3h, two
    tables 2 n_b a and two final norms 2h."""
    est = sm.estimate("t5-small", sm.Policy("bf16-mixed", "adamw", attention="eager"))
    free = est.components["activations"].free_symbols
    assert {sm.symbols.s, sm.symbols.s_d, sm.symbols.b, sm.symbols.L} <= free
    B_w, V, h, f, a, L, n_b = (sm.symbols.B_w, sm.symbols.V, sm.symbols.h, sm.symbols.f, sm.symbols.a,
                               sm.symbols.L, sm.symbols.n_b)
    expected = B_w * (V * h + L * (4 * h**2 + 2 * f * h + 2 * h) + L * (8 * h**2 + 2 * f * h + 3 * h)
                      + 2 * n_b * a + 2 * h)
    assert sp.expand(est.components["params"] - expected) == 0
    with pytest.raises(ConfigError) as e:
        est.at(b=2, s=128)
    assert "s_d" in str(e.value)
    at = est.at(b=2, s=128, s_d=32)
    assert at.peak < est.at(b=2, s=128, s_d=64).peak < est.at(b=2, s=256, s_d=64).peak


def test_own_head_dim():
    g = sm.models.from_hf_config({"model_type": "t5", "d_model": 32, "d_kv": 16, "d_ff": 64, "num_layers": 2,
                                  "num_heads": 4, "vocab_size": 60})
    assert sm.symbols.d_h in g.param_count().free_symbols   # q, k, v, o: 4 h a d_h per attention


# ----------------------------------------------------------------------------- presets

#: parameters as transformers 5.24 counts them (T5ForConditionalGeneration on the meta device);
#: the v1.0 numbers are the published ones (t5-small 60.5M ... t5-11b 11.3B)
PUBLISHED = {"t5-small": 60_506_624, "t5-base": 222_903_552, "t5-large": 737_668_096,
             "t5-3b": 2_851_598_336, "t5-11b": 11_307_321_344, "t5-v1_1-base": 222_903_552}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts(name):
    """t5-small: the shared embedding 32128*512 = 16,449,536; 6 encoder layers of
    4*512^2 + 2*512*2048 + 2*512 = 3,146,752; 6 decoder layers of 8*512^2 + 2*512*2048 + 3*512
    = 4,195,840; two bucket tables 2*32*8 = 512 and two final norms 1024: 60,506,624."""
    g = sm.models.preset(name)
    assert g.param_count().xreplace(g.bindings) == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_counts_match_transformers(name):
    """Each preset's config built by transformers on the meta device: the same count. T5 v1.1
    (``tie_word_embeddings: false``) keeps a tied head in transformers 5, whose T5Config always
    ties and reads the flag as ``scale_decoder_outputs`` only."""
    c = sm.models.PRESETS[name]
    hf = transformers.T5Config(d_model=c.d_model, d_ff=c.d_ff, num_layers=c.num_layers, num_heads=c.num_heads,
                               d_kv=c.d_kv, feed_forward_proj=c.feed_forward_proj, vocab_size=c.vocab_size,
                               tie_word_embeddings=c.tie_word_embeddings)
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(hf)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]
    assert hf.scale_decoder_outputs == c.scaled


def test_hugging_face_ids_offline():
    assert sm.models.preset("google-t5/t5-small").name == "t5-small"
    assert sm.models.preset("GOOGLE/T5-V1_1-BASE").name == "t5-v1_1-base"


# ----------------------------------------------------------------------------- refusals

BASE = {"model_type": "t5", "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4,
        "vocab_size": 100}


@pytest.mark.parametrize("changes,words", [
    ({"feed_forward_proj": "gated-swish"}, "unknown feed_forward_proj 'gated-swish'"),
    ({"dropout_rate": 1.0}, "dropout_rate = 1.0 is not valid"),
    ({"num_layers": 1}, "num_layers = 1 is not valid: expected at least 2"),
    ({"num_decoder_layers": 1}, "num_decoder_layers = 1 is not valid: expected at least 2"),
    ({"attn_implementation": "flash_attention_2"}, "attn_implementation = 'flash_attention_2' is not valid"),
    ({"gradient_checkpointing": True}, "gradient_checkpointing = True is not valid"),
    ({"d_kv": 0}, "d_kv = 0 is not valid: expected a positive integer"),
])
def test_bad_t5_config_is_refused(changes, words):
    with pytest.raises((ConfigError, UnknownName)) as e:
        sm.models.from_hf_config({**BASE, **changes})
    assert words in str(e.value)


def test_fused_kernels_and_float16_are_refused():
    """SDPA without dropout on the CPU (its flash kernel with a float mask that needs a
    gradient), a fused kernel asked for, and a float16 model (clamped after every sub-layer)
    are not modelled: refused where the kernel or the dtype is known."""
    g = sm.models.from_hf_config({**BASE, "dropout_rate": 0.0})
    with pytest.raises(ConfigError) as e:
        sm.estimate(g, sm.Policy("fp32", "sgd", "cpu", attention="sdpa"))
    assert "a kernel symmem models for" in str(e.value) and "on cpu (eager, math)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        sm.estimate(g, sm.Policy("bf16-mixed", "sgd", "cuda", attention="flash"))
    assert "--attention eager" in str(e.value)
    with pytest.raises(ConfigError) as e:
        sm.estimate(g, sm.Policy("fp16", "sgd", attention="eager"))
    assert "T5 clamps float16 hidden states" in str(e.value)


@pytest.mark.parametrize("point,ff,precision", [
    ((2, 16, 32, 32, 64, 4, 8, 3, 2, 100), "relu", "bf16"),
    ((3, 32, 16, 48, 96, 6, 8, 2, 3, 80), "gated-gelu", "fp32"),
    ((1, 16, 16, 32, 64, 4, 16, 2, 2, 60), "gated-gelu", "bf16"),     # b = 1: the bias's expand a view
])
def test_cuda_sdpa_saved_bytes_from_pytorch_meta(point, ff, precision):
    """On CUDA, T5's SDPA runs the mem-efficient kernel with the position bias as attn_bias
    (flash takes no mask), which needs its gradient. Its bytes saved for backward, derived
    from PyTorch's sources, against the same forward counted on the meta device
    (:func:`helpers.saved_as_cuda_on_meta`): equal but for each attention call's 16 bytes of
    philox seed and offset, which the meta device keeps with the rest and CUDA keeps on the
    host (``attention.cu``: ``at::scalar_tensor`` without a device). L + 2 L_d calls: one
    self-attention in each encoder layer, two attentions in each decoder layer."""
    b, s, s_d, h, f, a, d_kv, L, L_d, V = point
    cfg = transformers.T5Config(d_model=h, d_ff=f, num_heads=a, d_kv=d_kv, num_layers=L, num_decoder_layers=L_d,
                                vocab_size=V, attn_implementation="sdpa", use_cache=False, decoder_start_token_id=0,
                                dropout_rate=0.1, feed_forward_proj=ff)
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, "adamw", "cuda"))
    assert est.kernels == ("mem-efficient",)
    if b == 1:
        est = est.at_one
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(cfg)
    model.train()
    if precision == "bf16":
        model.to(torch.bfloat16)
    ids, labels = (torch.randint(0, V, (b, n), device="meta") for n in (s, s_d))
    measured = saved_as_cuda_on_meta(model, lambda m: m(input_ids=ids, labels=labels), "mem-efficient")
    calls = L + 2 * L_d
    assert est.at(b=b, s=s, s_d=s_d).bytes["activations"] == measured - 16 * calls


def test_cuda_sdpa_bias_gradient():
    """The bias's gradient from PyTorch's own functions: ``_efficient_attention_backward``
    (meta) makes it at the expanded (b, a, s_q, s_k) size, 2*4*32*32*4 = 32,768 bytes for a
    (1, 4, 32, 32) float32 bias, which symmem gives the kernel's mask input; ExpandBackward
    sums it to the bias's (1, 4, 32, 32), a new tensor, but at b = 1 hands the gradient on
    itself (measured on the CPU: the same storage)."""
    from symmem.rules import Ctx, F32, TensorInfo, get_rule
    b, a, s, d = 2, 4, 32, 8
    q = torch.randn(b, a, s, d, device="meta", requires_grad=True)
    bias = torch.randn(1, a, s, s, device="meta", requires_grad=True)
    mask = bias.expand(b, a, s, s)
    out = torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, mask, True, 0.1)
    grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        torch.randn(b, a, s, d, device="meta"), q, q, q, mask, out[0], out[1], out[2], out[3], 0.1,
        [True, True, True, True])
    assert grads[3].untyped_storage().nbytes() == 32_768

    class Node:
        name, op, params = "attn", "sdpa_kernel", ()

        def attr(self, key, default=None):
            return {"kernel": "mem-efficient", "dropout": 0.1, "aligned": True}.get(key, default)
    x = TensorInfo((b, a, s, d), F32)
    m = TensorInfo((b, a, s, s), F32, False)
    fp = get_rule("sdpa_kernel")(Node(), [x, x, x, m], Ctx(device="cuda"))
    assert fp.grads[3] == "new" and m.nbytes == 32_768
    # ExpandBackward0 at b = 1: sum_to a shape it already has returns the gradient itself
    one = torch.randn(1, a, s, s, requires_grad=True)
    grad = torch.randn(1, a, s, s)
    (g_in,) = torch.autograd.grad(one.expand(1, a, s, s), one, grad)
    assert g_in.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()


def test_cuda_sdpa_requires_aligned_sequences():
    """A sequence whose length 16 does not divide makes preprocess_mask pad the batch-expanded
    mask (copies in forward and backward, not modelled): refused by the requirement, by name."""
    est = sm.estimate(sm.models.from_hf_config(BASE), sm.Policy("bf16", "adamw", "cuda"))
    est.at(b=2, s=64, s_d=32)
    with pytest.raises(ConfigError) as e:
        est.at(b=2, s=60, s_d=32)
    assert "s = 60 is not valid: expected a multiple of 16" in str(e.value) and "pad_bias" in str(e.value)


def test_cli_decoder_seq(capsys, tmp_path):
    """``--decoder-seq`` gives s_d to estimate (and max-batch, solve); without it the error names
    s_d and the flag's symbol."""
    import json
    from symmem.cli import main
    path = tmp_path / "config.json"
    path.write_text(json.dumps(BASE))
    argv = ["estimate", "--config", str(path), "--batch", "2", "--seq", "16", "--precision", "fp32",
            "--optimizer", "sgd", "--device", "cpu"]
    assert main(argv + ["--decoder-seq", "8", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    est = sm.estimate(sm.models.from_hf_config(BASE), sm.Policy("fp32", "sgd", "cpu"))
    assert out["inputs"]["s_d"] == 8 and out["bytes"]["peak"] == est.at(b=2, s=16, s_d=8).peak
    assert main(argv) == 1
    assert "s_d: decoder (target) sequence length" in capsys.readouterr().err
