"""Patched models at run time: caches, outputs and objects that reach a patch it does not fit are
refused with the reason, and a patched model survives torch.save."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model

import rope_ext
from rope_ext import chunked
from rope_ext.method import REGISTRY
from rope_ext.method.attention_side import AttentionMethod
from rope_ext.method.sink_window import SinkWindowCache
from rope_ext.saving import save_record
from rope_ext.training.checks import check_parallelism
from rope_ext.training.config import ConfigError, parse_args

from helpers import linear_glm, load_llama, required_params


@pytest.mark.parametrize("method, params", [(None, {}), ("dynamic", {}), ("sink_window", {"sinks": 2, "window": 60})])
def test_a_sink_window_cache_is_refused_by_a_model_it_does_not_fit(tiny_model, heldout_ids, method, params):
    """A SinkWindowCache lets keys go that any other model (or sink_window with other sizes) would
    attend: that model would compute wrong logits from it without a word."""
    if method is not None:
        rope_ext.patch(tiny_model, method, factor=4, **params)
    cache = SinkWindowCache(tiny_model.config.num_hidden_layers, sinks=4, window=60)
    with pytest.raises(ValueError, match=r"SinkWindowCache\(sinks=4, window=60\)"), torch.no_grad():
        tiny_model(heldout_ids[None, :200], cache=cache, use_cache=True)
    assert cache.get_seq_length() == 0


def test_a_sink_window_cache_serves_the_patch_it_was_made_for(tiny_model, heldout_ids):
    rope_ext.patch(tiny_model, "sink_window", factor=4, sinks=4, window=60)
    ids = heldout_ids[None, :200]
    cache = chunked.new_cache(tiny_model)
    with torch.no_grad():
        full = tiny_model(ids).logits
        first = tiny_model(ids[:, :150], cache=cache, use_cache=True).logits
        rest = tiny_model(ids[:, 150:], cache=cache, use_cache=True).logits
    assert (torch.cat((first, rest), dim=1) - full).abs().max() <= 1e-4


# every attention-side method: each merges one softmax from several calls
SPLIT_SOFTMAX = [name for name, m in REGISTRY.items() if isinstance(m, AttentionMethod)]


@pytest.mark.parametrize(
    "method, attn",
    [*((m, "eager") for m in SPLIT_SOFTMAX), ("dynamic", "sdpa"), ("self_extend", "sdpa"), ("alibi_hybrid", "sdpa")],
)
def test_output_attentions_is_refused_where_the_patch_has_no_weights(tiny_model, heldout_ids, method, attn):
    """Methods that merge one softmax from several calls have no weights to return, nor has a
    backend that computes none; the model returned an empty tuple without a word."""
    tiny_model.set_attn_implementation(attn)
    rope_ext.patch(tiny_model, method, factor=4)
    window = tiny_model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"output_attentions=True: {method}"), torch.no_grad():
        tiny_model(heldout_ids[None, : 2 * window], output_attentions=True)


@pytest.mark.parametrize(
    "method, params",
    [
        ("dynamic", {"granularity": 8}),
        ("dynamic_yarn", {"granularity": 8}),
        ("alibi_hybrid", {"rope": "dynamic", "granularity": 8}),
        ("longrope", {}),
    ],
)
def test_output_attentions_of_the_rotation_inside_attention_are_its_weights(tiny_model, heldout_ids, method, params):
    """Past the window the causal schedule attends in groups of rows; the weights gathered from the
    groups are those each row has when decoded alone (one call through eager)."""
    tiny_model.set_attn_implementation("eager")
    pairs = tiny_model.config.hidden_size // tiny_model.config.num_attention_heads // 2
    rope_ext.patch(tiny_model, method, factor=4, **required_params(method, pairs), **params)
    window = tiny_model.config.max_position_embeddings
    ids = heldout_ids[None, : 2 * window]
    with torch.no_grad():
        full = tiny_model(ids, output_attentions=True).attentions
        cache = chunked.new_cache(tiny_model)
        tiny_model(ids[:, :-5], cache=cache, use_cache=True)
        steps = [
            tiny_model(ids[:, t : t + 1], cache=cache, use_cache=True, output_attentions=True).attentions
            for t in range(ids.shape[1] - 5, ids.shape[1])
        ]
    assert len(full) == tiny_model.config.num_hidden_layers
    for layer, weights in enumerate(full):
        assert weights.shape[-2:] == (2 * window, 2 * window)
        assert torch.allclose(weights.sum(-1), torch.ones(()), atol=1e-5)
        for k, step in enumerate(steps):
            t = ids.shape[1] - 5 + k
            assert (step[layer][:, :, 0] - weights[:, :, t, : t + 1]).abs().max() <= 1e-5


# every method, alibi_hybrid with a rope that rotates inside attention too
PICKLED = [(name, {}) for name in REGISTRY] + [("alibi_hybrid", {"rope": "dynamic"})]


def test_a_patched_model_survives_torch_save_and_load_in_a_new_process(tiny_path, heldout_ids, tmp_path):
    """torch.save pickles the whole model: the state a patch keeps per forward (the positions of
    each cache's keys, the frame) is dropped, the method is saved by its name, and a new process
    finds the attention wrapper registered on the first forward. rope-ext itself never unpickles;
    this test does, as users who torch.load a model they saved do."""
    window = 128
    ids = heldout_ids[None, : 2 * window]
    expected = {}
    for index, (method, params) in enumerate(PICKLED):
        model = load_llama(tiny_path)
        pairs = model.config.hidden_size // model.config.num_attention_heads // 2
        rope_ext.patch(model, method, factor=4, **required_params(method, pairs), **params)
        with torch.no_grad():
            model(ids[:, :40], cache=chunked.new_cache(model), use_cache=True)  # leaves per-forward state behind
            expected[index] = model(ids).logits
        torch.save(model, tmp_path / f"{index}.pt")
    again = torch.load(tmp_path / "0.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, expected[0])
    torch.save(ids, tmp_path / "ids.pt")
    script = (
        "import sys, torch\n"
        "torch.set_num_threads(1)\n"
        f"folder, count = sys.argv[1], {len(PICKLED)}\n"
        "ids = torch.load(f'{folder}/ids.pt')\n"
        "out = {}\n"
        "for index in range(count):\n"
        "    model = torch.load(f'{folder}/{index}.pt', weights_only=False)\n"
        "    with torch.no_grad():\n"
        "        out[index] = model(ids).logits\n"
        "torch.save(out, f'{folder}/logits.pt')\n"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True)
    loaded = torch.load(tmp_path / "logits.pt")
    for index, (method, params) in enumerate(PICKLED):
        assert torch.equal(loaded[index], expected[index]), (method, params)


def test_a_method_on_a_linear_scaled_checkpoint_keeps_its_position_ratio_through_torch_save(tmp_path):
    """A GLM checkpoint with a linear scaling is patched on top of it (rope_ext.rotary.
    with_position_ratio); the reloaded method is rebuilt with the same ratio."""
    model = linear_glm(max_positions=64)
    rope_ext.patch(model, "dynamic", factor=2, granularity=4)
    ids = torch.randint(0, 97, (1, 200))
    with torch.no_grad():
        expected = model(ids).logits
    torch.save(model, tmp_path / "glm.pt")
    again = torch.load(tmp_path / "glm.pt", weights_only=False)
    assert again.model.rotary_emb.method.fn.ratio == 4.0
    with torch.no_grad():
        assert torch.equal(again(ids).logits, expected)


@pytest.mark.parametrize("rope", ["dynamic", "ntk"])
def test_shifted_sparse_attention_is_refused_for_a_method_that_runs_inside_attention(rope):
    """alibi_hybrid adds its bias inside attention, and with rope=dynamic rotates there too; the
    check read the registry's alibi_hybrid (rope=ntk, static rotation) and let it through to
    training, where the switch to S²-attention failed with the backend's error."""
    argv = ["--method", "alibi_hybrid", "--factor", "4", "--param", f"rope={rope}", "--s2-groups", "2"]
    with pytest.raises(ConfigError, match="training.s2_groups.*alibi_hybrid"):
        parse_args(argv)


def test_context_parallelism_is_refused_for_a_rotation_inside_attention():
    cfg, _ = parse_args(["--method", "alibi_hybrid", "--factor", "4", "--param", "rope=dynamic"])
    cfg["model"]["attn_implementation"] = "sdpa"
    with pytest.raises(ConfigError, match="context parallelism supports static methods"):
        check_parallelism(cfg, 2)


def _yarn_adapter_folder(tiny_path, out):
    """A fine-tune folder as the recipe writes it for yarn (native rope_parameters): the adapter,
    its config naming out/base, rope_ext_finetune.json. The LoRA weights are perturbed from their
    zero init so that the adapter changes the logits."""
    model = load_llama(tiny_path)
    rope_ext.patch(model, "yarn", factor=4)
    tuned = get_peft_model(model, LoraConfig(r=4, target_modules=rope_ext.lora_targets(model)))
    with torch.no_grad():
        for name, parameter in tuned.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    tuned.save_pretrained(out)
    save_record(out, str(tiny_path), tuned)


def test_an_adapter_on_a_base_loaded_by_its_original_name_is_refused(tiny_path, heldout_ids, tmp_path):
    """peft's PeftModel.from_pretrained(<the base by its original name>, out) attaches the adapter
    to the unpatched base without a word; rope-ext's check (and every chunked call) refuses it,
    and passes the loads that give the fine-tune."""
    out = tmp_path / "run"
    _yarn_adapter_folder(tiny_path, out)
    by_name = PeftModel.from_pretrained(load_llama(tiny_path), str(out))
    ids = heldout_ids[None, :512]
    with pytest.raises(ValueError, match="patched base"):
        rope_ext.check_adapter_base(by_name)
    with pytest.raises(ValueError, match="patched base"):
        chunked.chunked_nll(by_name, ids[0], chunk_size=256)
    expected = rope_ext.from_pretrained(out)
    with torch.no_grad():
        gap = (by_name(ids).logits - expected(ids).logits).abs().max().item()
    assert gap > 1, gap
    for model in (expected, AutoPeftModelForCausalLM.from_pretrained(str(out)).eval()):
        rope_ext.check_adapter_base(model)
        with torch.no_grad():
            assert (model(ids).logits - expected(ids).logits).abs().max() <= 1e-5
