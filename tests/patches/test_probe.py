"""patches/probe.py on tiny random models: what it proves of a plain Llama, what a sliding window,
a layer without RoPE and a rotation rope-ext does not compute change in what it finds, the
refusals of a model without a rotary module, without a rope_theta or with the rotation reaching it
elsewhere, and that probing leaves the model as it was."""

import copy

import pytest
import torch
from transformers.models.llama import modeling_llama

from rope_ext.patches.probe import PROBE_LENGTH, REASONS, Refused, probe

from helpers import in_another_thread, logits, random_ids, random_model

LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")


def test_a_plain_llama_is_proven_as_it_is_built():
    model = random_model("llama")
    structure = probe(model)
    assert structure.rotary == "model.rotary_emb"
    assert structure.attention == LAYERS and structure.rope == (True, True)
    assert structure.rope_attention == LAYERS and structure.nope_attention == ()
    assert (structure.layout, structure.channels, structure.cos_format) == ("half", "leading", "cat")
    assert structure.head_dim == structure.rotary_dim == 16
    assert structure.plain_attention and structure.static_only is None
    assert (structure.layer_type, structure.layer_types, structure.axes, structure.config) == (None, (), 0, "")
    assert structure.rotation_elsewhere == () and structure.kept_rotary == structure.unused_rotary == ()


def test_the_structure_names_modules_so_a_deep_copy_gives_the_same():
    model = random_model("llama")
    assert probe(copy.deepcopy(model)) == probe(model)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_probing_leaves_the_model_as_it_was(attn):
    model = random_model("llama", attn=attn).train()
    ids = random_ids(12)
    before = logits(model.eval(), ids)
    model.train()
    hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    probe(model)
    assert model.training and model.config._attn_implementation == attn
    assert [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()] == hooks
    assert type(model.model.rotary_emb).forward is modeling_llama.LlamaRotaryEmbedding.forward
    assert "forward" not in vars(model.model.rotary_emb)
    assert torch.equal(logits(model.eval(), ids), before)


@pytest.mark.parametrize("window, plain", [(PROBE_LENGTH // 2, False), (PROBE_LENGTH, True), (None, True)])
def test_a_sliding_window_inside_the_probe_is_not_plain_attention(window, plain):
    """A window shorter than the probe's tokens masks keys a causal mask keeps: the methods that
    compute attention themselves would attend past it. The rotation is proven all the same."""
    structure = probe(random_model("mistral", sliding_window=window))
    assert structure.plain_attention is plain
    assert structure.rope == (True, True) and structure.static_only is None


def test_a_layer_without_rope_is_found_and_left_alone():
    model = random_model("llama")

    def unrotated(module, args, kwargs):
        cos, sin = kwargs["position_embeddings"]
        return args, {**kwargs, "position_embeddings": (torch.ones_like(cos), torch.zeros_like(sin))}

    model.model.layers[1].self_attn.register_forward_pre_hook(unrotated, with_kwargs=True)
    structure = probe(model)
    assert structure.rope == (True, False)
    assert structure.rope_attention == LAYERS[:1] and structure.nope_attention == LAYERS[1:]
    assert structure.static_only is None


def test_a_rotation_rope_ext_does_not_compute_takes_static_methods_only(monkeypatch):
    """The model turns its queries and keys the other way: no pairing of rope-ext's rotation gives
    what attention receives, so rope-ext may change the module's output but never rotate for it."""
    real = modeling_llama.apply_rotary_pos_emb
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", lambda q, k, cos, sin, *a, **kw: real(q, k, cos, -sin, *a, **kw))
    structure = probe(random_model("llama"))
    assert structure.rope == (True, True)
    assert structure.static_only.startswith("in 2 of its 2 rotating layers (`model.layers.0.self_attn`, ...)")
    assert "does not give bit for bit" in structure.static_only


def test_a_rotation_that_reaches_the_model_outside_attention_is_refused():
    model = random_model("llama")
    seen = {}
    model.model.rotary_emb.register_forward_hook(lambda module, args, out: seen.update(cos=out[0]))
    model.model.norm.register_forward_hook(lambda module, args, out: out + seen["cos"].mean())
    with pytest.raises(Refused, match="an identity rotation fed to attention's own inputs changes the logits") as refused:
        probe(model)
    assert refused.value.reason == "outside-attention"
    assert str(refused.value).startswith(REASONS["outside-attention"])


def test_a_model_without_a_rotary_buffer_is_refused():
    model = random_model("llama")
    for name in ("inv_freq", "original_inv_freq"):
        delattr(model.model.rotary_emb, name)
    with pytest.raises(Refused) as refused:
        probe(model)
    assert refused.value.reason == "no-rotary" and str(refused.value) == f"{REASONS['no-rotary']}: LlamaForCausalLM"


def test_a_config_without_rope_theta_is_refused():
    model = random_model("llama")
    model.config.rope_parameters = {"rope_type": "default"}
    with pytest.raises(Refused) as refused:
        probe(model)
    assert refused.value.reason == "config" and "LlamaConfig.rope_parameters is {'rope_type': 'default'}" in str(refused.value)


def test_two_threads_probe_two_models_at_once():
    """A probe that runs while another thread's probe is inside its forward (issue #51 item 3): the
    second thread patches its model from the middle of the first one's forward, and each probe sees
    its own model's attention calls only."""
    import rope_ext

    first, second = random_model("llama"), random_model("llama", seed=1)
    ids = random_ids(3 * 64)
    expected = []
    for model in (first, second):
        twin = copy.deepcopy(model)
        rope_ext.patch(twin, "dynamic", factor=4)
        expected.append(logits(twin, ids))
    patched = []

    def in_the_middle(module, args):
        if not patched:
            patched.append(in_another_thread(lambda: rope_ext.patch(second, "dynamic", factor=4)))

    hook = first.model.layers[1].register_forward_pre_hook(in_the_middle)
    try:
        rope_ext.patch(first, "dynamic", factor=4)
    finally:
        hook.remove()
    patched[0].result()
    for model, reference in zip((first, second), expected):
        assert torch.equal(logits(model, ids), reference)
