"""self_extend: SelfExtend's grouped attention (rope_ext.method.self_extend)."""

import pytest
import torch
from transformers import DynamicCache

import rope_ext
from rope_ext.attention import AttentionChain, AttentionTransform
from rope_ext.method import self_extend

from helpers import WINDOW, random_model


def rotate(x, positions, base, dim):
    """x [B, H, S, dim] rotated to `positions` [S], pairs (i, i + dim/2): written out independently."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions[:, None].float() * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    a, b = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class NaiveSelfExtend(AttentionTransform):
    """The definition with full [S, S] matrices, for one unpadded sequence: own positions for
    distance < W or for queries that have seen <= L tokens, grouped positions otherwise."""

    def __init__(self, rotary, group, window):
        self.rotary, self.group, self.window = rotary, group, window

    def __call__(self, module, query, key, value, attention_mask, attend, scaling=None, **kwargs):
        frame, geometry = self.rotary.frame, self.rotary.geometry
        q_pos, k_pos = frame.q_pos[0], frame.k_pos[0]
        G, W, dim = self.group, self.window, geometry.rotary_dim
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        own = rotate(query, q_pos, geometry.base, dim) @ rotate(key, k_pos, geometry.base, dim).transpose(-1, -2)
        grouped = rotate(query, q_pos // G + W - W // G, geometry.base, dim) @ rotate(key, k_pos // G, geometry.base, dim).transpose(-1, -2)
        distance = q_pos[:, None] - k_pos[None, :]
        use_grouped = (q_pos[:, None] + 1 > geometry.original_window) & (distance >= W)
        scores = torch.where(use_grouped, grouped, own) * scaling
        scores = scores.masked_fill(distance < 0, float("-inf"))
        return (scores.softmax(-1) @ value).transpose(1, 2), None


class RecordShapes(AttentionTransform):
    """Passes everything on, remembering the largest mask the backend received."""

    largest = 0

    def __call__(self, module, query, key, value, attention_mask, attend, **kwargs):
        if attention_mask is not None:
            RecordShapes.largest = max(RecordShapes.largest, attention_mask.numel())
        return attend(module, query, key, value, attention_mask, **kwargs)


def set_chain(model, transforms):
    chain = AttentionChain(transforms)
    for layer in model.model.layers:
        layer.self_attn.rope_ext_attention = chain


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_matches_the_definition_in_blocks_chunks_and_decoding(monkeypatch, attn):
    group, window = 3, 12
    model = random_model("llama", attn=attn)
    rope_ext.patch(model, "self_extend", group=group, window=window)
    rotary = model.model.rotary_emb
    ids = torch.randint(0, 97, (1, 4 * WINDOW), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        set_chain(model, [NaiveSelfExtend(rotary, group, window)])
        reference = model(ids).logits
        # small score blocks: many query blocks, each with its own keys and mask
        monkeypatch.setattr(self_extend, "SCORE_BYTES", 4 * 4 * 40 * (4 * WINDOW + window))
        RecordShapes.largest = 0
        # rows past the window attend through attend_with_lse, not the backend: record its masks too
        attend_with_lse = self_extend.attend_with_lse

        def recorded(query, key, value, *, mask=None, **kwargs):
            if mask is not None:
                RecordShapes.largest = max(RecordShapes.largest, mask.numel())
            return attend_with_lse(query, key, value, mask=mask, **kwargs)

        monkeypatch.setattr(self_extend, "attend_with_lse", recorded)
        set_chain(model, [self_extend.GroupedAttention(rotary), RecordShapes()])
        full = model(ids).logits
        largest_mask = RecordShapes.largest
        cache = DynamicCache(config=model.config)
        chunked = torch.cat([model(c, cache=cache, use_cache=True).logits for c in ids.split(50, dim=1)], dim=1)
        cache = DynamicCache(config=model.config)
        model(ids[:, : 3 * WINDOW], cache=cache, use_cache=True)
        steps = torch.cat([model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(3 * WINDOW, 3 * WINDOW + 30)], dim=1)
    assert (full - reference).abs().max() <= 1e-5
    assert (chunked - reference).abs().max() <= 1e-5
    assert (steps - reference[:, 3 * WINDOW : 3 * WINDOW + 30]).abs().max() <= 1e-5
    # one forward builds no mask over all 256 x 256 positions: at most 40 query rows per block
    assert 0 < largest_mask <= 40 * (4 * WINDOW + window)
    rope_ext.unpatch(model)
    with torch.no_grad():
        plain = model(ids).logits
    assert torch.equal(plain[:, :WINDOW], full[:, :WINDOW])
    assert (plain[:, WINDOW:] - full[:, WINDOW:]).abs().max() > 1e-3  # the grouping is not vacuous


def test_inside_the_window_the_model_is_unchanged(tiny_model, heldout_ids):
    window = tiny_model.config.max_position_embeddings
    ids = heldout_ids[None, : 4 * window]
    with torch.no_grad():
        plain = tiny_model(ids).logits
        rope_ext.patch(tiny_model, "self_extend", factor=4)
        patched = tiny_model(ids).logits
        short = tiny_model(ids[:, :window]).logits
    assert (short - plain[:, :window]).abs().max() <= 1e-5
    assert (patched[:, :window] - plain[:, :window]).abs().max() <= 1e-5
    assert (patched[:, window:] - plain[:, window:]).abs().max() > 1.0  # past the window it does act


def test_chunked_prefill_and_decoding_equal_one_forward(tiny_model, heldout_ids):
    window = tiny_model.config.max_position_embeddings
    rope_ext.patch(tiny_model, "self_extend", group=4, window=32)
    ids = heldout_ids[None, : 3 * window]
    with torch.no_grad():
        full = tiny_model(ids).logits
        cache = DynamicCache(config=tiny_model.config)
        chunks = torch.cat([tiny_model(c, cache=cache, use_cache=True).logits for c in ids.split(window - 3, dim=1)], dim=1)
        cache = DynamicCache(config=tiny_model.config)
        tiny_model(ids[:, : window - 4], cache=cache, use_cache=True)
        steps = torch.cat([tiny_model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(window - 4, window + 40)], dim=1)
    assert (chunks - full).abs().max() <= 1e-4
    assert (steps - full[:, window - 4 : window + 40]).abs().max() <= 1e-4


def _ppl(model, ids, first):
    with torch.no_grad():
        logits = model(ids).logits[0, first - 1 : -1]
    return torch.nn.functional.cross_entropy(logits, ids[0, first:]).exp().item()


def test_beats_plain_rope_at_four_times_the_window(tiny_model, heldout_ids):
    window = tiny_model.config.max_position_embeddings
    starts = range(0, 6 * 4 * window, 4 * window)
    plain = [_ppl(tiny_model, heldout_ids[None, s : s + 4 * window], 2 * window) for s in starts]
    rope_ext.patch(tiny_model, "self_extend", factor=4)
    extended = [_ppl(tiny_model, heldout_ids[None, s : s + 4 * window], 2 * window) for s in starts]
    plain, extended = sum(plain) / len(plain), sum(extended) / len(extended)
    assert extended < 0.8 * plain, (extended, plain)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_left_padded_batch_generates_as_single_rows(tiny_model, tiny_tokenizer, heldout_ids, attn):
    tiny_model.set_attn_implementation(attn)
    window = tiny_model.config.max_position_embeddings
    rope_ext.patch(tiny_model, "self_extend", group=4, window=32)
    pad = tiny_tokenizer.pad_token_id
    long, short = heldout_ids[: window + 60], heldout_ids[2000 : 2000 + window + 20]
    batch = torch.full((2, len(long)), pad)
    batch[0] = long
    batch[1, -len(short) :] = short
    mask = (torch.arange(len(long))[None] >= torch.tensor([[0], [len(long) - len(short)]])).long()
    settings = dict(max_new_tokens=10, do_sample=False, pad_token_id=pad)
    with torch.no_grad():
        together = tiny_model.generate(batch, attention_mask=mask, **settings)[:, len(long) :]
        alone = [tiny_model.generate(row[None], **settings)[0, len(row) :] for row in (long, short)]
    assert torch.equal(together[0], alone[0])
    assert torch.equal(together[1], alone[1])


def test_factor_group_and_window(tiny_model):
    window = tiny_model.config.max_position_embeddings  # 128
    info = rope_ext.patch(tiny_model, "self_extend", group=4, window=32)
    assert info.factor == 4 * (128 - 32 + 8) / 128 and info.max_length == 416
    assert info.params["group"] == 4 and info.params["window"] == 32
    info = rope_ext.patch(tiny_model, "self_extend", factor=4)  # window 128/4, smallest group reaching 512
    assert (info.params["window"], info.params["group"], info.max_length) == (32, 6, 4 * window)
    info = rope_ext.patch(tiny_model, "self_extend", factor=2, group=8, window=64)  # factor only sets max_length
    assert info.max_length == 2 * window and info.params["group"] == 8
    assert rope_ext.describe(tiny_model)["method"] == "self_extend"
    assert tiny_model.config.max_position_embeddings == window  # a plain reload is the unscaled model


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "needs a factor"),
        ({"group": 1}, "group must be >= 2"),
        ({"group": 4, "window": 128}, "must be smaller than the trained window"),
        ({"factor": 8, "group": 4, "window": 32}, "reaches 416 tokens"),
        ({"group": 4, "granularity": 4}, "granularity does not apply"),
        ({"group": 4, "beta_fast": 4}, "unknown parameter"),
        ({"group": 2.5}, "must be an int"),
    ],
)
def test_bad_parameters_change_nothing(tiny_model, heldout_ids, kwargs, message):
    ids = heldout_ids[None, :64]
    with torch.no_grad():
        before = tiny_model(ids).logits
    with pytest.raises(ValueError, match=message):
        rope_ext.patch(tiny_model, "self_extend", **kwargs)
    assert rope_ext.describe(tiny_model) is None
    with torch.no_grad():
        assert torch.equal(tiny_model(ids).logits, before)


def test_unsupported_backend_is_refused(tiny_model):
    tiny_model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="eager or sdpa"):
        rope_ext.patch(tiny_model, "self_extend", factor=4)


def test_unpatch_save_and_reload(tiny_model, heldout_ids, tmp_path):
    window = tiny_model.config.max_position_embeddings
    ids = heldout_ids[None, : 3 * window]
    with torch.no_grad():
        plain = tiny_model(ids).logits
        rope_ext.patch(tiny_model, "self_extend", group=4, window=32)
        patched = tiny_model(ids).logits
        tiny_model.save_pretrained(tmp_path)
        reloaded = rope_ext.from_pretrained(tmp_path, dtype=torch.float32).eval()
        assert rope_ext.describe(reloaded)["params"] == rope_ext.describe(tiny_model)["params"]
        assert torch.equal(reloaded(ids).logits, patched)
        rope_ext.unpatch(tiny_model)
        assert torch.equal(tiny_model(ids).logits, plain)
    assert "self_extend" in rope_ext.methods()
