"""Sliding-window perplexity: exact on a model with a known distribution, equal to the
re-forward protocol on the trained tiny model, shared forwards only where exact."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import rope_ext
from rope_ext import cli
from rope_ext.evals import data as data_mod
from rope_ext.evals import perplexity
from rope_ext.evals.data import Document

BOS = 1


def bigram_model(vocab: int = 48) -> LlamaForCausalLM:
    """A LLaMA whose attention and MLP outputs are zero: the residual stream stays the token's
    embedding, so p(next | context) depends on the current token alone: a bigram table."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.normal_(0, 1)
        model.lm_head.weight.normal_(0, 0.5)
    return model


def bigram_log_probs(model) -> torch.Tensor:
    """log p(next | current) [V, V], computed from the weights alone (no forward), in float64."""
    e = model.model.embed_tokens.weight.detach().double()
    eps = model.config.rms_norm_eps
    normed = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + eps) * model.model.norm.weight.detach().double()
    return torch.log_softmax(normed @ model.lm_head.weight.detach().double().T, dim=-1)


def expected_nll(table, ids, length, stride, bos) -> tuple[float, int, list[float]]:
    """(total NLL, scored tokens, per-window mean NLLs) by the protocol's closed form for
    stride == length (non-overlapping chunks) or stride < length (every token once)."""
    nll, count, windows = 0.0, 0, []
    chunks = [range(s, min(s + length, len(ids))) for s in range(0, len(ids), length)] if stride == length else None
    if chunks is None:
        scored = [(BOS if i == 0 else ids[i - 1], ids[i]) for i in range(0 if bos else 1, len(ids))]
        values = [-float(table[p, t]) for p, t in scored]
        return sum(values), len(values), []
    for chunk in chunks:
        values = []
        for i in chunk:
            if i == chunk.start:
                if not bos:
                    continue
                prev = BOS
            else:
                prev = ids[i - 1]
            values.append(-float(table[prev, ids[i]]))
        nll += sum(values)
        count += len(values)
        windows.append(sum(values) / len(values))
    return nll, count, windows


@pytest.mark.parametrize("length,stride,bos", [(64, 16, False), (64, 16, True), (64, 64, False), (64, 64, True), (50, 50, True)])
def test_perplexity_of_a_known_distribution_is_exact(length, stride, bos):
    model = bigram_model()
    table = bigram_log_probs(model)
    generator = torch.Generator().manual_seed(1)
    docs = [
        Document("a", torch.randint(3, 48, (300,), generator=generator)),
        Document("b", torch.randint(3, 48, (37,), generator=generator)),
    ]  # shorter than a window
    result = perplexity.evaluate(model, docs, [length], stride=stride, bos=bos, bos_id=BOS, progress=False)[length]
    nll, count, windows = 0.0, 0, []
    for doc in docs:
        n, c, w = expected_nll(table, doc.ids.tolist(), length, stride, bos)
        nll, count, windows = nll + n, count + c, windows + w
    assert result["tokens"] == count
    assert result["ppl"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    if windows:
        assert result["yarn_ppl"] == pytest.approx(math.exp(sum(windows) / len(windows)), rel=1e-5)
    # the model is far from uniform, so an off-by-one in rows or targets could not hide
    assert abs(math.log(result["ppl"]) - math.log(48)) > 0.2


def test_windows_follow_the_protocol():
    assert perplexity.plan_windows(10, 4, 2, bos=False) == [
        perplexity.Window(0, 4, 1),
        perplexity.Window(2, 6, 4),
        perplexity.Window(4, 8, 6),
        perplexity.Window(6, 10, 8),
    ]
    assert perplexity.plan_windows(3, 8, 8, bos=True) == [perplexity.Window(0, 3, 0)]
    with pytest.raises(ValueError, match="stride"):
        perplexity.plan_windows(10, 4, 5, bos=False)


@pytest.fixture
def heldout_docs(heldout_ids):
    return [Document("a", heldout_ids[:700]), Document("b", heldout_ids[5000:5450])]


@pytest.mark.parametrize("method,params", [("plain", {}), ("yarn", {"factor": 2}), ("dynamic", {"factor": 2, "granularity": 32})])
def test_matches_the_reforward_protocol_on_the_trained_model(tiny_model, tiny_tokenizer, heldout_docs, method, params):
    if method != "plain":
        rope_ext.patch(tiny_model, method, **params)
    bos_id = tiny_tokenizer.bos_token_id
    for bos in (False, True):
        ours = perplexity.evaluate(tiny_model, heldout_docs, [256], stride=96, bos=bos, bos_id=bos_id, progress=False)[256]
        ref = perplexity.reforward_perplexity(tiny_model, heldout_docs, 256, 96, bos=bos, bos_id=bos_id, progress=False)
        assert (ours["tokens"], ours["windows"]) == (ref["tokens"], ref["windows"])
        assert ours["ppl"] == pytest.approx(ref["ppl"], rel=1e-5)
        assert ours["yarn_ppl"] == pytest.approx(ref["yarn_ppl"], rel=1e-5)
        assert ours["ppl"] < 100  # the trained model, not noise (uniform would be 1024)


@pytest.mark.parametrize(
    "method,params", [("plain", {}), ("sink_window", {"factor": 4, "sinks": 2, "window": 60}), ("self_extend", {"factor": 4})]
)
def test_chunks_through_the_cache_give_the_numbers_of_one_forward(tiny_model, heldout_docs, method, params):
    if method != "plain":
        rope_ext.patch(tiny_model, method, **params)
    one = perplexity.evaluate(tiny_model, heldout_docs, [256, 512], stride=192, progress=False)
    forwards = count_forwards(tiny_model)
    chunked = perplexity.evaluate(tiny_model, heldout_docs, [256, 512], stride=192, chunk_size=50, progress=False)
    assert len(forwards) > 2 * len(heldout_docs)  # several chunks per window, not one forward each
    for n in (256, 512):
        assert chunked[n]["tokens"] == one[n]["tokens"]
        assert chunked[n]["ppl"] == pytest.approx(one[n]["ppl"], rel=1e-5)
        assert [b["ppl"] for b in chunked[n]["buckets"]] == pytest.approx([b["ppl"] for b in one[n]["buckets"]], rel=1e-5)


def count_forwards(model):
    calls = []
    model.get_decoder().register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize(
    "method,params,exact",
    [
        ("yarn", {"factor": 2}, True),
        ("dynamic", {"factor": 2, "granularity": 32}, True),
        ("dynamic", {"factor": 2, "causal": False}, False),
    ],
)
def test_shared_forwards_only_where_exact(tiny_model, heldout_docs, method, params, exact):
    rope_ext.patch(tiny_model, method, **params)
    calls = count_forwards(tiny_model)
    separate = perplexity.evaluate(tiny_model, heldout_docs, [128, 256], stride=64, share=False, progress=False)
    n_separate = len(calls)
    calls.clear()
    auto = perplexity.evaluate(tiny_model, heldout_docs, [128, 256], stride=64, progress=False)
    assert perplexity.prefix_consistent(tiny_model) is exact
    if exact:
        assert len(calls) < n_separate
        for n in (128, 256):
            assert auto[n]["ppl"] == pytest.approx(separate[n]["ppl"], rel=1e-6)
    else:
        assert len(calls) == n_separate
        # sharing would have been wrong here: the 256-token forward scales all of its tokens
        forced = perplexity.evaluate(tiny_model, heldout_docs, [128, 256], stride=64, share=True, progress=False)
        assert abs(forced[128]["ppl"] / separate[128]["ppl"] - 1) > 1e-3


def test_head_runs_in_chunks(tiny_model, heldout_docs, monkeypatch):
    full = perplexity.evaluate(tiny_model, heldout_docs, [256], progress=False)[256]
    rows = []
    tiny_model.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    vocab = tiny_model.config.vocab_size
    monkeypatch.setattr(rope_ext.chunked, "LOGIT_ELEMENTS", 7 * vocab)  # the one LM-head helper
    chunked = perplexity.evaluate(tiny_model, heldout_docs, [256], progress=False)[256]
    assert max(rows) == 7
    assert chunked["ppl"] == pytest.approx(full["ppl"], rel=1e-6)  # fp32 matmuls of other shapes round differently


def test_buckets_show_the_break_past_the_window(tiny_path, heldout_ids):
    from transformers import LlamaForCausalLM

    docs = [Document(f"c{i}", heldout_ids[i * 4096 : i * 4096 + 512]) for i in range(4)]

    def buckets(method):
        model = LlamaForCausalLM.from_pretrained(tiny_path).eval()
        if method != "plain":
            rope_ext.patch(model, method, factor=4)
        result = perplexity.evaluate(model, docs, [512], truncate=True, bucket=128, progress=False)[512]
        return [b["ppl"] for b in result["buckets"]]

    plain, yarn = buckets("plain"), buckets("yarn")
    assert len(plain) == 4
    assert max(plain[1:]) > 1.3 * plain[0]  # the tiny model was trained on 128-token windows only
    assert sum(yarn[1:]) < 0.9 * sum(plain[1:])


def test_data_errors_are_clear(tmp_path, tiny_tokenizer):
    with pytest.raises(FileNotFoundError, match="no such file"):
        list(data_mod.iter_texts(str(tmp_path / "missing.txt")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        list(data_mod.iter_texts(str(tmp_path / "empty")))
    (tmp_path / "blank.txt").write_text("  \n")
    with pytest.raises(ValueError, match="none of the 1 documents"):
        data_mod.tokenize_documents(tiny_tokenizer, data_mod.iter_texts(str(tmp_path / "blank.txt")))
    (tmp_path / "short.txt").write_text("To be, or not to be.")
    with pytest.raises(ValueError, match="at least 1000 tokens"):
        data_mod.tokenize_documents(tiny_tokenizer, data_mod.iter_texts(str(tmp_path / "short.txt")), min_tokens=1000)


def test_a_binary_file_is_not_text(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"PK\x03\x04\x00\x00" + bytes(range(256)))
    with pytest.raises(ValueError, match=r"weights.bin is a binary file, not text"):
        data_mod.iter_texts(str(path))
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("fine text")
    (folder / "b.txt").write_bytes(b"\x00\x01binary")
    with pytest.raises(ValueError, match=r"b.txt is a binary file"):
        data_mod.iter_texts(str(folder))


@pytest.mark.parametrize(
    "lines, match",
    [
        (['{"text": "a"}', "", '{"text": "b"', '{"text": "c"}'], r"docs.jsonl:3: not valid JSON"),
        (['{"text": 12345}'], r"docs.jsonl:1: field 'text' must be a string, got int 12345"),
        (['{"text": "a"}', '["text"]'], r"docs.jsonl:2: expected a JSON object with a 'text' field, got list"),
        (['{"body": "a"}'], r"docs.jsonl:1: no field 'text' \(fields: body\)"),
    ],
)
def test_a_bad_jsonl_line_names_the_file_and_the_line(tmp_path, lines, match):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=match):
        data_mod.iter_texts(str(path))


@pytest.mark.integration
def test_cli_writes_results_and_never_overwrites(tiny_path, tmp_path):
    from rope_ext.defaults import gutenberg_documents

    text = tmp_path / "macbeth.txt"
    text.write_text(gutenberg_documents()["macbeth_gut"][20000:26000])
    out = tmp_path / "out"
    argv = ["--model", str(tiny_path), "--lengths", "128", "256", "--data", str(text), "--output", str(out), "--no-progress"]
    with pytest.warns(UserWarning, match="meant for 128"):
        assert cli.call(["eval", "ppl"] + argv) == 0
    saved = (out / "ppl.json").read_text()
    assert {p.name for p in out.iterdir()} == {"ppl.json", "ppl.md", "ppl.png"}
    assert '"256"' in saved and "PPL by position" in (out / "ppl.md").read_text()
    with pytest.raises(FileExistsError, match="--overwrite"):
        cli.call(["eval", "ppl"] + argv)
    assert (out / "ppl.json").read_text() == saved
    assert cli.call(["eval", "ppl"] + argv + ["--method", "yarn", "--factor", "2", "--overwrite"]) == 0
    assert (out / "ppl.json").read_text() != saved
    assert (
        cli.call(["eval", "ppl"] + argv + ["--method", "sink_window", "--factor", "4", "--chunk-size", "64", "--overwrite"]) == 0
    )
    assert json.loads((out / "ppl.json").read_text())["setup"]["chunk_size"] == 64
    with pytest.raises(ValueError, match="--chunk-size must be an int"):
        cli.call(["eval", "ppl"] + argv + ["--chunk-size", "0", "--overwrite"])


def test_progress_moves_during_one_forward(tiny_model, heldout_ids):
    scorer = perplexity.TokenScorer(tiny_model)
    steps = []

    def advance(n):  # returns what tqdm's update returns when it redraws
        steps.append(n)
        return True

    with torch.no_grad():
        hidden = scorer.hidden(heldout_ids[:301], advance)
        assert torch.equal(hidden, scorer.hidden(heldout_ids[:301]))
    assert len(steps) == tiny_model.config.num_hidden_layers and sum(steps) == 301
    assert not tiny_model.model.layers[0]._forward_hooks  # the hooks go with the forward


@pytest.mark.parametrize("method", ["yarn", "self_extend"])
def test_a_checkpoint_saved_patched_is_evaluated_with_its_patch(tiny_model, tiny_tokenizer, tmp_path, method):
    """Without --method the model is evaluated as loaded: a patched checkpoint keeps its patch (and
    the results say which); --method plain is the unpatched model."""
    from rope_ext.defaults import gutenberg_documents

    rope_ext.patch(tiny_model, method, factor=4)
    tiny_model.save_pretrained(tmp_path / "ckpt")
    tiny_tokenizer.save_pretrained(tmp_path / "ckpt")
    text = tmp_path / "macbeth.txt"
    text.write_text(gutenberg_documents()["macbeth_gut"][20000:26000])
    argv = ["--model", str(tmp_path / "ckpt"), "--lengths", "512", "--data", str(text), "--no-progress", "--overwrite"]
    runs = {}
    for name, extra in (("as loaded", []), ("named", ["--method", method, "--factor", "4"]), ("plain", ["--method", "plain"])):
        assert cli.call(["eval", "ppl"] + argv + extra + ["--output", str(tmp_path / name)]) == 0
        runs[name] = json.loads((tmp_path / name / "ppl.json").read_text())
    assert runs["as loaded"]["setup"]["method"] == method and runs["as loaded"]["setup"]["patch"]["as_loaded"]
    assert runs["as loaded"]["setup"]["capacity"] == 512
    ppl = {name: run["lengths"]["512"]["ppl"] for name, run in runs.items()}
    assert ppl["as loaded"] == ppl["named"] and ppl["plain"] > 1.1 * ppl["named"]
    with pytest.raises(ValueError, match="need --method"):
        cli.call(["eval", "ppl"] + argv + ["--factor", "4", "--output", str(tmp_path / "x")])


def test_a_fine_tune_folder_is_evaluated_as_the_fine_tuned_model(tiny_model, tiny_tokenizer, tiny_path, tmp_path):
    """`eval ppl --model <the fine-tune's --out folder>` (docs/finetune.md): the base, its patch and
    the adapter, as rope_ext.load_finetuned builds them; the results name the folder."""
    from peft import LoraConfig, get_peft_model

    from rope_ext.defaults import gutenberg_documents
    from rope_ext.saving import load_finetuned, save_record

    rope_ext.patch(tiny_model, "yarn", factor=4)
    tuned = get_peft_model(tiny_model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # a trained adapter: LoRA's B starts at zero
        for name, parameter in tuned.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    out = tmp_path / "tiny_yarn_x4"
    tuned.save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    save_record(out, str(tiny_path), tuned)
    text = tmp_path / "macbeth.txt"
    text.write_text(gutenberg_documents()["macbeth_gut"][20000:26000])
    argv = ["eval", "ppl", "--model", str(out), "--lengths", "512", "--data", str(text), "--dtype", "float32", "--no-progress"]
    assert cli.main([*argv, "--output", str(tmp_path / "ppl")]) == 0
    run = json.loads((tmp_path / "ppl" / "ppl.json").read_text())
    assert run["setup"]["model"] == "tiny_yarn_x4" and run["setup"]["method"] == "yarn" and run["setup"]["capacity"] == 512
    model = load_finetuned(out, dtype=torch.float32)
    ids = torch.tensor(tiny_tokenizer(text.read_text(), add_special_tokens=False)["input_ids"])
    bos, bos_id = perplexity.bos_token(tiny_tokenizer, None)
    expected = perplexity.evaluate(model, [Document("macbeth", ids)], [512], bos=bos, bos_id=bos_id, progress=False)[512]["ppl"]
    assert run["lengths"]["512"]["ppl"] == pytest.approx(expected, rel=1e-5)
    base = rope_ext.from_pretrained(tiny_path).eval()
    rope_ext.patch(base, "yarn", factor=4)
    without = perplexity.evaluate(base, [Document("macbeth", ids)], [512], bos=bos, bos_id=bos_id, progress=False)[512]["ppl"]
    assert abs(without - expected) > 1e-3 * expected  # the adapter is in the numbers, 100x the tolerance above
