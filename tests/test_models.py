"""The model-family registry (``symmem.models``) and the GPT-2 family.

Registry behaviour is tested on fresh ``Registry()`` objects with a throwaway family, so
the global registry is never touched. The GPT-2 family's decisions are checked against
transformers: its config defaults and keys, its parameter counts (models built on the
meta device), and, measured on the CPU, that the keys it ignores do not change memory
and the keys it refuses do."""
import functools
import json
from dataclasses import dataclass, fields

import pytest

import symmem as sm
from symmem.cli import WIDTH, main
from symmem.errors import ConfigError, UnknownName
from symmem.models import DuplicateName, Family, Registry, Unmodelled
from symmem.models import gpt2
from symmem.symbols import b, h

TINY = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100,
        "n_positions": 32}


# ----------------------------------------------------------------------------- a throwaway family

@dataclass(frozen=True)
class ToyConfig:
    width: int = 8
    fancy_free: bool = True
    name: str = "toy"


def build_toy(cfg: ToyConfig) -> sm.Graph:
    g = sm.Graph(cfg.name, {h: cfg.width})
    x = g.input("x", (b, h), dtype="float32", requires_grad=True)
    g.add("linear", x, params=(g.param("w", (h, h)),), name="lin")
    return g


def toy(**changes) -> Family:
    spec = dict(name="toy", description="a toy", config=ToyConfig, build=build_toy, model_types=("toy",),
                aliases={"hidden_size": "width"}, required=("width",),
                presets={"toy-8": ToyConfig(8, name="toy-8"), "toy-16": ToyConfig(16, name="toy-16")},
                hf_ids={"toy-8": "someone/toy-8"},
                unmodelled=(Unmodelled("fancy", (False,), "fancy things cost memory"),),
                ignored={"colour": "paint is not memory"})
    return Family(**{**spec, **changes})


@pytest.fixture
def reg():
    r = Registry()
    r.register(toy())
    r.register(gpt2.FAMILY)
    return r


# ----------------------------------------------------------------------------- the registry

def test_duplicate_family_name(reg):
    with pytest.raises(DuplicateName) as e:
        reg.register(toy(model_types=("toy2",), presets={}, hf_ids={}))
    assert (e.value.kind, e.value.name, e.value.owner) == ("family name", "toy", "toy")
    assert str(e.value) == ("family name = 'toy' is not valid: expected a family name that no registered "
                            "family uses (family 'toy' has it). Choose another name, or register into a "
                            "fresh Registry() to try a variant.")


def test_duplicate_model_type(reg):
    with pytest.raises(DuplicateName) as e:
        reg.register(toy(name="toy2", model_types=("gpt2",), presets={}, hf_ids={}))
    assert str(e.value) == ("model_type = 'gpt2' is not valid: expected a model_type that no registered "
                            "family uses (family 'gpt2' has it). Rename it in family 'toy2', or register "
                            "into a fresh Registry() to try a variant.")


@pytest.mark.parametrize("presets,hf_ids,kind,name,owner", [
    ({"GPT2-Medium": ToyConfig(name="GPT2-Medium")}, {}, "preset name", "GPT2-Medium", "gpt2"),
    ({"openai-community/gpt2": ToyConfig(name="openai-community/gpt2")}, {}, "preset name",
     "openai-community/gpt2", "gpt2"),                                     # a name that is an HF id
    ({"t": ToyConfig(name="t")}, {"t": "OpenAI-Community/GPT2-XL"}, "Hugging Face id",
     "OpenAI-Community/GPT2-XL", "gpt2"),
    ({"t": ToyConfig(name="t"), "u": ToyConfig(name="u")}, {"t": "x/t", "u": "X/T"}, "Hugging Face id",
     "X/T", "toy2"),                                                       # twice in one family
])
def test_duplicate_presets_and_ids_any_case(reg, presets, hf_ids, kind, name, owner):
    before = (reg.model_types(), dict(reg.presets))
    with pytest.raises(DuplicateName) as e:
        reg.register(toy(name="toy2", model_types=("toy2",), presets=presets, hf_ids=hf_ids))
    assert (e.value.kind, e.value.name, e.value.owner) == (kind, name, owner)
    assert (reg.model_types(), dict(reg.presets)) == before                # nothing half-registered
    with pytest.raises(UnknownName):
        reg.family("toy2")


def test_the_global_registry_is_untouched_and_read_only():
    assert [f.name for f in sm.models.families()][0] == "gpt2"
    assert set(gpt2.PRESETS) <= set(sm.models.PRESETS)
    with pytest.raises(TypeError):
        sm.models.PRESETS["mine"] = gpt2.GPT2Config()
    with pytest.raises(DuplicateName):                                     # gpt2 registers once
        sm.models.register(gpt2.FAMILY)


@pytest.mark.parametrize("changes,words", [
    (dict(aliases={"hidden_size": "depth"}), "family 'toy': alias 'hidden_size' = 'depth' is not valid: "
                                             "expected a field of ToyConfig."),
    (dict(required=("depth",)), "family 'toy': required key = 'depth' is not valid: expected a field of ToyConfig."),
    (dict(presets={"a": ToyConfig(name="b")}, hf_ids={}),
     "family 'toy': preset 'a' = 'b' is not valid: expected the preset's own name in its config's name field."),
    (dict(hf_ids={"nope": "x/nope"}), "family 'toy': hf_ids = 'nope' is not valid: expected the name of "
                                      "one of the family's presets."),
    (dict(ignored={"fancy": "twice"}), "family 'toy': unmodelled or ignored key = 'fancy' is not valid: "
                                       "expected a key decided once. List it either in unmodelled or in ignored."),
    (dict(ignored={"width": "a field"}), "family 'toy': unmodelled or ignored key = 'width' is not valid: "
                                         "expected a key that is not a field or an alias (those are modelled)."),
    (dict(model_types=()), "family 'toy': model_types = () is not valid: expected at least one Hugging Face "
                           "model_type."),
])
def test_family_checks_itself(changes, words):
    with pytest.raises(ConfigError) as e:
        toy(**changes)
    assert str(e.value) == words


def test_family_is_frozen_and_classifies_every_key():
    fam = toy()
    with pytest.raises(AttributeError):
        fam.name = "other"
    with pytest.raises(TypeError):
        fam.presets["x"] = ToyConfig()
    assert [fam.classify(k) for k in ("width", "hidden_size", "fancy", "colour", "whatever")] == \
        ["field", "alias", "unmodelled", "ignored", "unread"]


# ----------------------------------------------------------------------------- dispatch, aliases

def test_dispatch_on_model_type(reg):
    fam, cfg = reg.hf_config({"model_type": "toy", "hidden_size": 16, "colour": "red", "whatever": 1})
    assert fam.name == "toy" and cfg == ToyConfig(16, name="toy")
    assert reg.from_hf_config({"model_type": "toy", "width": 4}, name="t").bindings == {h: 4}
    fam, cfg = reg.hf_config(TINY)
    assert fam is gpt2.FAMILY and cfg == gpt2.GPT2Config(64, 2, 4, 100, 32, name="gpt2")


def test_unknown_model_type_lists_the_supported(reg):
    with pytest.raises(UnknownName) as e:
        reg.from_hf_config({**TINY, "model_type": "mamba"})
    assert str(e.value) == "unknown model_type 'mamba'. Known: gpt2, toy."
    assert e.value.known == ("gpt2", "toy")
    with pytest.raises(ConfigError) as e:
        reg.from_hf_config({"width": 4})
    assert str(e.value) == ('model_type = None is not valid: expected one of gpt2, toy. '
                            'Add "model_type" to the config.')


def test_unmodelled_key_of_a_toy(reg):
    assert reg.hf_config({"model_type": "toy", "width": 4, "fancy": False})[1].width == 4
    with pytest.raises(ConfigError) as e:
        reg.from_hf_config({"model_type": "toy", "width": 4, "fancy": True})
    assert (e.value.field, e.value.value) == ("fancy", True)
    assert str(e.value) == ("fancy = True is not valid: expected false, the only value symmem models "
                            "(fancy things cost memory). Remove the key or set it to false.")
    with pytest.raises(ConfigError, match="fancy = 0 is not valid"):      # 0 is not false in JSON
        reg.from_hf_config({"model_type": "toy", "width": 4, "fancy": 0})


def test_gpt2_aliases_are_hugging_faces_attribute_map():
    transformers = pytest.importorskip("transformers")
    # and transformers' own name for the attention kernel, which it keeps in `_attn_implementation`
    assert gpt2.ALIASES == {**transformers.GPT2Config.attribute_map, "_attn_implementation": "attn_implementation"}
    generic = {"model_type": "gpt2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "vocab_size": 100, "max_position_embeddings": 32}
    assert sm.models.hf_config(generic)[1] == sm.models.hf_config(TINY)[1]
    assert sm.models.hf_config({**TINY, "hidden_size": 64})[1].n_embd == 64     # both, agreeing
    with pytest.raises(ConfigError) as e:
        sm.models.from_hf_config({**TINY, "hidden_size": 128})
    assert str(e.value) == ("hidden_size = 128 is not valid: expected the value of 'n_embd' (64): both name "
                            "GPT2Config.n_embd. Give one of the two keys, or the same value to both.")


def test_gpt2_defaults_are_transformers_defaults():
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2Config()
    for fl in fields(gpt2.GPT2Config):
        if fl.name != "name" and fl.name not in gpt2.SYMMEM_FIELDS:
            assert getattr(hf, "_" * (fl.name == "attn_implementation") + fl.name) == fl.default, fl.name


def test_every_transformers_key_is_decided():
    """Each key transformers writes into a GPT-2 config.json is modelled, an alias,
    refused unless supported, or ignored with a reason: none is left to chance."""
    transformers = pytest.importorskip("transformers")
    keys = set(transformers.GPT2Config().to_dict()) | set(transformers.PreTrainedConfig().to_dict())
    undecided = {k for k in keys if gpt2.FAMILY.classify(k) == "unread"}
    assert undecided == set()
    assert all(reason for reason in gpt2.FAMILY.ignored.values())


def test_example_configs_are_accepted():
    for folder in ("gpt2-medium", "tiny-gpt2"):
        fam, cfg = sm.models.hf_config(f"examples/{folder}")
        assert fam.name == "gpt2" and cfg.name == folder


# ----------------------------------------------------------------------------- unmodelled GPT-2 keys

def test_reorder_and_upcast_attn_is_refused_word_for_word():
    with pytest.raises(ConfigError) as e:
        sm.models.from_hf_config({**TINY, "reorder_and_upcast_attn": True})
    assert (e.value.field, e.value.value) == ("reorder_and_upcast_attn", True)
    assert str(e.value) == (
        "reorder_and_upcast_attn = True is not valid: expected false, the only value symmem models (the "
        "reordered attention runs baddbmm and softmax in float32 and saves float32 copies of Q, K and the "
        "scores). Remove the key or set it to false.")


@pytest.mark.parametrize("key,value,words", [
    ("add_cross_attention", True, "4*h^2 + 6*h parameters more per layer"),
    ("gradient_checkpointing", True, "symmem models no recomputation yet"),
])
def test_unmodelled_keys_are_refused(key, value, words):
    supported = next(u for u in gpt2.UNMODELLED if u.key == key).supported
    assert all(sm.models.hf_config({**TINY, key: v}) for v in supported)
    with pytest.raises(ConfigError) as e:
        sm.models.from_hf_config({**TINY, key: value})
    assert e.value.field == key and words in str(e.value)


@pytest.mark.parametrize("key", ["attn_implementation", "_attn_implementation"])
def test_the_configs_attention_is_the_default_kernel(key):
    """``attn_implementation`` is what ``--attention auto`` (the default) runs; a policy that
    names a kernel wins; a name transformers does not have is refused with the known ones."""
    for hf_name, kernel in (("eager", "eager"), ("sdpa", "sdpa"), ("flash_attention_2", "flash")):
        g = sm.models.from_hf_config({**TINY, key: hf_name})
        assert sm.estimate(g, sm.Policy("bf16-mixed")).policy.attention == kernel
        assert sm.estimate(g, sm.Policy("bf16-mixed", attention="math")).policy.attention == "math"
    assert sm.estimate(sm.models.from_hf_config(TINY)).policy.attention == "sdpa"    # transformers' default
    with pytest.raises(UnknownName) as e:
        sm.models.from_hf_config({**TINY, key: "flex_attention"})
    assert str(e.value) == ("unknown attn_implementation 'flex_attention'. Did you mean 'flash_attention_2'? "
                            "Known: eager, sdpa, flash_attention_2.")


def test_cli_refuses_an_unmodelled_key(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "reorder_and_upcast_attn": True}))
    code = main(["estimate", "--config", str(tmp_path), "--batch", "1", "--seq", "8"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.startswith("symmem: error: reorder_and_upcast_attn = True is not valid: expected false")


def test_activation_outside_the_table_is_unknown():
    with pytest.raises(UnknownName, match=r"^unknown activation_function 'quick_gelu'\. .*Known: gelu_new, "
                                          r"gelu, gelu_pytorch_tanh, relu\.$"):
        sm.models.from_hf_config({**TINY, "activation_function": "quick_gelu"})


# ----------------------------------------------------------------------------- measured decisions

@functools.lru_cache(maxsize=None)
def _measure(precision="fp32", changes=(), step=True):
    """(parameter bytes, bytes saved for backward, training-step peak or None) of
    transformers' GPT2LMHeadModel at b=2, s=16, h=32, a=4, L=2, V=100 on the CPU, with the
    config keys of ``changes`` ((key, value) pairs) set, and the config.json transformers
    writes for it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from symmem.measure import param_bytes, saved_bytes, training_step
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    kw = dict(n_embd=32, n_head=4, n_layer=2, vocab_size=100, n_positions=32, attn_implementation="eager",
              use_cache=False, bos_token_id=0, eos_token_id=0)
    cfg = transformers.GPT2Config(**{**kw, **dict(changes)})
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    ids = torch.randint(0, 100, (2, 16))

    def loss():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            return model(ids, labels=ids).loss
    saved = saved_bytes(loss, exclude=model).total
    peak = training_step(model, lambda m: loss(), torch.optim.SGD(model.parameters(), lr=0.1, foreach=False),
                         extra=(ids,)).peak if step else None
    return (param_bytes(model), saved, peak), {**cfg.to_dict(), "attn_implementation": cfg._attn_implementation,
                                               **dict(changes)}


def test_the_measured_baseline_is_estimated():
    measured, hf = _measure()
    ev = sm.estimate(sm.models.from_hf_config(hf), sm.Policy("fp32", "sgd", "cpu")).at(b=2, s=16)
    assert (ev.bytes["params"], ev.bytes["activations"]) == measured[:2]      # exact
    assert abs(ev.peak - measured[2]) <= 0.01 * measured[2]


#: Ignored keys whose neutrality is not obvious from the modelling code, at other values.
IGNORED_MEASURED = (("scale_attn_weights", False), ("scale_attn_by_inverse_layer_idx", True),
                    ("use_cache", True), ("output_hidden_states", True), ("output_attentions", True),
                    ("layer_norm_epsilon", 1e-3))


def test_ignored_keys_change_no_byte():
    """Measured, all set at once: no parameter, no saved byte and not the peak changes;
    and symmem reads the same config (hence the same graph) with them as without."""
    assert {gpt2.FAMILY.classify(k) for k, _ in IGNORED_MEASURED} == {"ignored"}
    base, hf_base = _measure()
    changed, hf = _measure("fp32", IGNORED_MEASURED)
    assert changed == base
    assert sm.models.hf_config(hf)[1] == sm.models.hf_config(hf_base)[1]


UNMODELLED_MEASURED = [("reorder_and_upcast_attn", True, "bf16"), ("add_cross_attention", True, "fp32"),
                       ("gradient_checkpointing", True, "fp32")]


@pytest.mark.parametrize("key,value,precision", UNMODELLED_MEASURED, ids=[k for k, *_ in UNMODELLED_MEASURED])
def test_refused_keys_do_change_memory(key, value, precision):
    """Measured: each refused setting changes the parameter bytes or the saved bytes."""
    assert gpt2.FAMILY.classify(key) == "unmodelled"
    base, _ = _measure(precision, step=False)
    changed, _ = _measure(precision, ((key, value),), step=False)
    assert changed != base


# ----------------------------------------------------------------------------- presets

def test_presets_by_name_and_hugging_face_id_any_case():
    medium = sm.models.preset("gpt2-medium")
    for name in ("GPT2-Medium", "openai-community/gpt2-medium", "OpenAI-Community/GPT2-MEDIUM"):
        g = sm.models.preset(name)
        assert g.name == "gpt2-medium" and g.bindings == medium.bindings
    assert sm.models.preset("distilbert/distilgpt2").bindings[sm.symbols.L] == 6
    fam, cfg = sm.models.preset_config("gpt3-175b")
    assert fam.name == "gpt2" and cfg.n_positions == 2048


def test_unknown_presets_suggest_names_and_ids():
    with pytest.raises(UnknownName) as e:
        sm.models.preset("gpt-2")
    assert str(e.value).startswith("unknown model 'gpt-2'. Did you mean 'gpt2'? Known: gpt2, gpt2-medium,")
    with pytest.raises(UnknownName, match=r"^unknown model 'openai-community/gpt2-mediun'\. Did you mean "
                                          r"'openai-community/gpt2-medium'\?"):
        sm.models.preset("openai-community/gpt2-mediun")


def _hf_count(cfg: gpt2.GPT2Config) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kw = {fl.name: getattr(cfg, fl.name) for fl in fields(cfg) if fl.name != "name"}
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**kw))
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() for p in unique.values())


@pytest.mark.parametrize("name", list(gpt2.PRESETS))
def test_preset_parameter_counts_equal_transformers(name):
    g = sm.models.preset(name)
    assert int(g.param_count().xreplace(g.bindings)) == _hf_count(gpt2.PRESETS[name])


@pytest.mark.parametrize("changes", [{"n_inner": 100}, {"tie_word_embeddings": False},
                                     {"activation_function": "relu", "n_inner": 48}])
def test_config_variants_count_like_transformers(changes):
    fam, cfg = sm.models.hf_config({**TINY, **changes})
    g = fam.build(cfg)
    assert int(g.param_count().xreplace(g.bindings)) == _hf_count(cfg)


# ----------------------------------------------------------------------------- symmem models

def test_symmem_models_lists_every_family_and_preset(capsys):
    assert main(["models"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert max(len(line) for line in out.splitlines()) <= WIDTH
    words = " ".join(out.split())
    for fam in sm.models.families():
        assert f"{fam.name}: {' '.join(fam.description.split())}" in words
        assert f"model_type: {', '.join(fam.model_types)}" in out
    for r in sm.models.summaries():
        assert r.name in out and f"{r.parameters:,}" in out and (r.hf_id or "-") in out
    # gpt2 by hand: 124,439,808 parameters (tests/test_cli.py), L 12, h 768, a 12, V 50,257, s_max 1,024
    assert "gpt2             124,439,808  12    768 12 50,257 1,024  openai-community/gpt2\n" in out


def test_symmem_models_json(capsys):
    assert main(["models", "--format", "json"]) == 0
    j = json.loads(capsys.readouterr().out)
    gpt = next(f for f in j["families"] if f["name"] == "gpt2")
    assert gpt["model_types"] == ["gpt2"]
    assert gpt["presets"][0] == {"name": "gpt2", "hf_id": "openai-community/gpt2", "parameters": 124_439_808,
                                 "layers": 12, "hidden": 768, "heads": 12, "vocab": 50257, "positions": 1024}
    assert [p["name"] for f in j["families"] for p in f["presets"]] == list(sm.models.PRESETS)


def test_estimate_by_hugging_face_id(capsys):
    assert main(["estimate", "--model", "openai-community/gpt2", "--batch", "1", "--seq", "8",
                 "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] == 124_439_808
