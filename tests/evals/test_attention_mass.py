"""The attention-mass probe (evals/attention_mass.py): on plain attention it reads what eager
attention's weights say; under every attention-side method each head's masses over a partition of
the keys sum to one, and the probed forward and the decoding after it are what they are without it."""

from __future__ import annotations

import json

import pytest
import torch

import rope_ext
from rope_ext.chunked import chunked_forward, new_cache
from rope_ext.evals.attention_mass import indicators, mass_probe, passkey_spans

from helpers import load_llama

SPANS = [(0, 40), (40, 150), (150, 151), (151, 299), (299, 300)]  # a partition of 300 keys


def ids() -> torch.Tensor:
    return torch.randint(5, 500, (1, 300), generator=torch.Generator().manual_seed(0))


def test_on_plain_attention_the_masses_are_eager_attention_s_weights_summed_over_each_span(tiny_path):
    model = load_llama(tiny_path, attn_implementation="eager")
    with torch.no_grad(), mass_probe(model, SPANS) as found:
        weights = model(ids(), output_attentions=True).attentions
    for layer, attention in enumerate(weights):
        expected = torch.stack([attention[0, :, -1, a:b].sum(-1) for a, b in SPANS], dim=-1)
        torch.testing.assert_close(found[layer], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("method", ["rerope", "dpe", "self_extend", "string", "dca", "dynamic", "yarn"])
def test_under_a_patch_the_masses_partition_one_and_the_forward_is_unchanged(tiny_path, method):
    model = load_llama(tiny_path)
    rope_ext.patch(model, method, factor=4)  # 300 keys: past the tiny model's 128-token window
    prompt = ids()

    def decode(probe: bool):
        cache = new_cache(model)
        chunked_forward(model, prompt[:, :-1], 299, cache=cache, keep_hidden=False)
        with torch.no_grad():
            if probe:
                with mass_probe(model, SPANS) as found:
                    last = model(prompt[:, -1:], cache=cache, use_cache=True).logits[0, -1]
            else:
                found, last = None, model(prompt[:, -1:], cache=cache, use_cache=True).logits[0, -1]
            after = model(last.argmax()[None, None], cache=cache, use_cache=True).logits[0, -1]
        return found, last, after

    found, last, after = decode(probe=True)
    _, unprobed, unprobed_after = decode(probe=False)
    assert torch.equal(last, unprobed) and torch.equal(after, unprobed_after)
    assert sorted(found) == list(range(model.config.num_hidden_layers))
    for masses in found.values():
        assert masses.shape == (model.config.num_attention_heads, len(SPANS))
        torch.testing.assert_close(masses.sum(-1), torch.ones(masses.shape[0]), rtol=0, atol=1e-5)
        assert (masses >= -1e-6).all()


def test_more_spans_than_a_head_has_channels_are_refused():
    with pytest.raises(ValueError, match="3 spans, but a head's values have 2 channels"):
        indicators(torch.zeros(1, 1, 4, 2), [(0, 1), (1, 2), (2, 3)])


def test_a_passkey_prompt_s_parts_cover_it_in_order(tiny_tokenizer):
    from rope_ext.evals.passkey import build_prompt

    prompt = build_prompt(tiny_tokenizer, 400, 0.3, 31337)
    spans = passkey_spans(tiny_tokenizer, prompt, near=64, bins=8)
    order = ["task", "filler before", "key line", "filler after", "question"]
    assert spans["task"][0] == 0 and spans["question"][1] == len(prompt.ids)
    assert all(spans[a][1] == spans[b][0] for a, b in zip(order, order[1:]))  # a partition, in order
    digits = spans["key digits"]
    assert spans["key line"][0] < digits[0] < digits[1] <= spans["key line"][1]
    assert "31337" in tiny_tokenizer.decode(prompt.ids[digits[0] : digits[1]]).replace(" ", "")
    assert spans["bin 0"][0] == 0 and spans["bin 7"][1] == len(prompt.ids)


def test_the_command_writes_each_prompt_s_answer_and_masses(tiny_path, tmp_path):
    from rope_ext.evals import attention_mass

    out = tmp_path / "mass.json"
    argv = ["--model", str(tiny_path), "--method", "rerope", "--factor", "4", "--length", "400", "--depths", "0.2", "0.6"]
    assert attention_mass.main(argv + ["--dtype", "float32", "--bins", "4", "--near", "64", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["depth"] for r in result["prompts"]] == [0.6, 0.2] and result["setup"]["method"] == "rerope"
    for record in result["prompts"]:
        parts = ["task", "filler before", "key line", "filler after", "question"]
        total = torch.tensor([record["mass"][p] for p in parts]).sum(0)  # [layers, heads]
        torch.testing.assert_close(total, torch.ones_like(total), rtol=0, atol=1e-5)
        assert isinstance(record["answer"], str) and record["correct"] in (True, False)
