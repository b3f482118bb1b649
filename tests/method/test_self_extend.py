"""self_extend: SelfExtend's grouped attention (rope_ext.method.self_extend), against its definition
written out with full [S, S] matrices, its group and window, and its authors' rule. What every
attention-side method meets (exactness inside the window, caching, saving, refusals) is in
test_attention_methods.py."""

import copy
import warnings
from fractions import Fraction

import pytest
import torch
from transformers import DynamicCache

import rope_ext
from rope_ext.attention import parts as attention
from rope_ext.attention import AttentionTransform, Rotator
from rope_ext import loading
from rope_ext.method import attention_side, self_extend

from helpers import WINDOW, assert_refused_unchanged, left_padded, random_ids, random_model, rotate, set_chain


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
        grouped = rotate(query, q_pos // G + W - W // G, geometry.base, dim) @ rotate(
            key, k_pos // G, geometry.base, dim
        ).transpose(-1, -2)
        distance = q_pos[:, None] - k_pos[None, :]
        use_grouped = (q_pos[:, None] + 1 > geometry.original_window) & (distance >= W)
        scores = torch.where(use_grouped, grouped, own) * scaling
        scores = scores.masked_fill(distance < 0, float("-inf"))
        return (scores.softmax(-1) @ value).transpose(1, 2), None


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_matches_the_definition_in_blocks_chunks_decoding_and_padded_batches(monkeypatch, attn):
    group, window, pad = 3, 12, 5
    length = 4 * WINDOW - 5  # 187 rows past the window: the last block of 12 is partial
    model = random_model("llama", attn=attn)
    rope_ext.patch(model, "self_extend", group=group, window=window)
    rotary = model.model.rotary_emb
    ids = random_ids(length, seed=1)
    batch, padding, positions = left_padded(ids, pad)
    with torch.no_grad():
        set_chain(model, [NaiveSelfExtend(rotary, group, window)])
        reference, shorter = model(ids).logits, model(ids[:, pad:]).logits
        set_chain(model, [attention_side.TwoPartAttention(Rotator(rotary))])
        # rows past the window attend through attend_with_lse: record the masks it gets
        masks = []
        attend_with_lse = attention.attend_with_lse

        def recorded(query, key, value, *, mask=None, **kwargs):
            masks.append(0 if mask is None else mask.numel())
            return attend_with_lse(query, key, value, mask=mask, **kwargs)

        monkeypatch.setattr(attention_side, "attend_with_lse", recorded)
        monkeypatch.setattr(attention, "attend_with_lse", recorded)
        full = model(ids).logits
        one_forward, masks = masks, []
        cache = DynamicCache(config=model.config)
        chunked = torch.cat([model(c, cache=cache, use_cache=True).logits for c in ids.split(50, dim=1)], dim=1)
        chunks, masks = masks, []
        cache = DynamicCache(config=model.config)
        model(ids[:, : 3 * WINDOW], cache=cache, use_cache=True)
        steps = torch.cat(
            [model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(3 * WINDOW, length)], dim=1
        )
        # a padded batch: blocks of query rows, each with a mask of its keys; 10 rows per block
        # (fp32 scores of 2 sequences x 4 heads x 10 query rows x at most length + window keys)
        monkeypatch.setattr(attention_side, "SCORE_BYTES", 4 * 2 * 4 * 10 * (length + window))
        padded = model(batch, attention_mask=padding, position_ids=positions).logits
    assert (full - reference).abs().max() <= 1e-5
    assert (chunked - reference).abs().max() <= 1e-5
    assert (steps - reference[:, 3 * WINDOW :]).abs().max() <= 1e-5
    assert (padded[:1] - reference).abs().max() <= 1e-5
    assert (padded[1:, pad:] - shorter).abs().max() <= 1e-5
    # one forward and the chunks (whose mask is the causal one) attend without masks; the padded
    # batch with masks [2, 1, rows, keys] of at most 10 query rows, none over all positions
    assert one_forward and chunks and not any(one_forward + chunks)
    assert 0 < max(masks) <= 2 * 10 * (length + window)
    rope_ext.unpatch(model)
    with torch.no_grad():
        plain = model(ids).logits
    assert torch.equal(plain[:, :WINDOW], full[:, :WINDOW])
    assert (plain[:, WINDOW:] - full[:, WINDOW:]).abs().max() > 1e-3  # the grouping is not vacuous


@pytest.mark.parametrize("rows, window, first", [(37, 8, 7), (33, 8, 20), (15, 8, 10), (5, 8, 9), (1, 8, 30), (16, 1, 3)])
def test_window_attention_without_masks_is_the_band(rows, window, first):
    """rope_ext.attention.window_parts against a band mask over all keys: full blocks, a partial
    one (one row short of the window, too), a block of one row, a window longer than the rows, the
    first row at window - 1, window 1."""
    generator = torch.Generator().manual_seed(rows)
    query = torch.randn(1, 4, rows, 16, generator=generator)
    key, value = torch.randn(2, 1, 2, first + rows, 16, generator=generator)
    blocks = list(attention.window_parts(query, key, value, first, window))
    ours = torch.cat([attention.merge_by_lse(parts) for _, _, parts in blocks], dim=2)
    row_index, key_index = first + torch.arange(rows)[:, None], torch.arange(first + rows)[None, :]
    band = (key_index <= row_index) & (key_index > row_index - window)
    scores = (query @ key.repeat_interleave(2, dim=1).transpose(-1, -2) / 4).masked_fill(~band, float("-inf"))
    assert [(lo, hi) for lo, hi, _ in blocks] == [(lo, min(lo + window, rows)) for lo in range(0, rows, window)]
    assert (ours - scores.softmax(-1) @ value.repeat_interleave(2, dim=1)).abs().max() <= 1e-5


@pytest.mark.parametrize("causal, masked", [(False, False), (True, False), (False, True)])
def test_attention_by_scores_in_blocks_is_the_cpu_kernel(monkeypatch, causal, masked):
    """attend_with_lse off the CPU (explicit scores, query rows in blocks) against torch's CPU
    kernel, on grouped key heads, more keys than rows, and blocks of 3 rows."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 10, 16, generator=generator)
    key, value = torch.randn(2, 1, 2, 10, 16, generator=generator)
    mask = torch.randn(1, 1, 10, 10, generator=generator).masked_fill(torch.rand(10, 10, generator=generator) < 0.3, -1e30)
    kwargs = {"causal": causal, "mask": mask if masked else None, "scale": 0.3}
    monkeypatch.setattr(attention, "SCORE_BYTES", 4 * 4 * 3 * 10)  # fp32 scores of 4 heads x 3 rows x 10 keys
    out, lse = attention.attend_with_lse_by_scores(query, key, value, **kwargs)
    kernel_out, kernel_lse = attention.attend_with_lse(query, key, value, **kwargs)
    assert (out - kernel_out).abs().max() <= 1e-5 and (lse - kernel_lse).abs().max() <= 1e-5


def _ppl(model, ids, first):
    with torch.no_grad():
        logits = model(ids).logits[0, first - 1 : -1]
    return torch.nn.functional.cross_entropy(logits, ids[0, first:]).exp().item()


def test_fp32_rounding_past_the_window_is_that_of_plain_attention(tiny_model, heldout_ids):
    """The attention calls merged by log-sum-exp add no error beyond fp32 rounding: against the same
    model in fp64, the patched fp32 logits are about as close as plain attention's (measured 1.17e-5
    against 9.9e-6 at 4x the window)."""
    window = tiny_model.config.max_position_embeddings
    ids = heldout_ids[None, : 4 * window]
    exact = copy.deepcopy(tiny_model).double()
    with torch.no_grad():
        plain_error = (tiny_model(ids).logits.double() - exact(ids).logits).abs().max()
        rope_ext.patch(tiny_model, "self_extend", factor=4)
        rope_ext.patch(exact, "self_extend", factor=4)
        error = (tiny_model(ids).logits.double() - exact(ids).logits)[:, window:].abs().max()
    assert error <= 2 * plain_error, (error, plain_error)


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
    info = rope_ext.patch(tiny_model, "self_extend", factor=4)  # window 128/4, the group DEFAULT_GROUP_RULE picks
    assert (info.params["group"], info.params["window"]) == self_extend.choose(4, window, self_extend.DEFAULT_GROUP_RULE)
    assert info.params["group_rule"] == self_extend.DEFAULT_GROUP_RULE and info.max_length == 4 * window
    info = rope_ext.patch(tiny_model, "self_extend", factor=2, group=8, window=64)  # factor only sets max_length
    assert info.max_length == 2 * window and info.params["group"] == 8
    assert rope_ext.describe(tiny_model)["method"] == "self_extend"
    assert tiny_model.config.max_position_embeddings == window  # a plain reload is the unscaled model


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"group": 1}, "group must be >= 2"),
        ({"group": 4, "window": 128}, "must be smaller than the trained window"),
        ({"factor": 8, "group": 4, "window": 32}, "reaches 416 tokens"),
        ({"group": 4, "granularity": 4}, "unknown parameter"),  # a record's old schedule: tests/method/test_attention_side.py
        ({"group": 4, "beta_fast": 4}, "unknown parameter"),
        ({"group": 2.5}, "must be an int"),
        ({"factor": 4, "group_rule": "widest"}, "group_rule must be None or one of 'reach', 'authors'"),
        (
            {"factor": 4, "group": 7, "group_rule": "reach"},
            r"group 7 is not what group_rule='reach' picks for 512 tokens at window 32 \(6\)",
        ),
        ({"factor": 4, "window": 100, "group_rule": "authors"}, "no group follows its authors' rule at window 100"),
    ],
)
def test_bad_parameters_change_nothing(tiny_model, kwargs, message):
    # the messages name the tiny model's 128-token window: refused on that model, not a random one
    assert_refused_unchanged("self_extend", kwargs, message, model=tiny_model)


# SelfExtend's authors' rule: W + (N - W)/G within 2/3 of the trained window L.


def test_the_authors_rule_at_32k_of_an_8k_window():
    limit = self_extend.rule_limit(8192)
    assert limit == Fraction(16384, 3)  # 5461.33
    assert self_extend.grouped_span(32768, 6, 2048) == 2048 + Fraction(30720, 6) == 7168 > limit
    assert not self_extend.follows_rule(8192, 32768, 6, 2048)
    assert self_extend.grouped_span(32768, 10, 2048) == 5120 and self_extend.follows_rule(8192, 32768, 10, 2048)
    # exactly at the limit holds; one group less does not
    assert self_extend.grouped_span(32768, 9, 2048) == limit and self_extend.follows_rule(8192, 32768, 9, 2048)
    assert not self_extend.follows_rule(8192, 32768, 8, 2048)
    assert self_extend.longest_within_rule(8192, 6, 2048) == 22528
    assert self_extend.follows_rule(8192, 22528, 6, 2048) and not self_extend.follows_rule(8192, 22529, 6, 2048)


@pytest.mark.parametrize("trained, window", [(8192, 2048), (128, 32)])
def test_each_group_rule_picks_the_smallest_group_it_allows(trained, window):
    target = 4 * trained
    assert self_extend.choose(4, trained, "reach") == (6, window)
    assert self_extend.choose(4, trained, "authors") == (9, window)
    assert self_extend.capacity(trained, 6, window) >= target > self_extend.capacity(trained, 5, window)
    assert self_extend.capacity(trained, 9, window) >= target
    assert self_extend.follows_rule(trained, target, 9, window) and not self_extend.follows_rule(trained, target, 8, window)


def test_the_authors_rule_needs_a_window_below_two_thirds_of_the_trained_one():
    # 5461 is 1/3 below the limit: (32768 - 5461) / (1/3) groups bring the span down to it
    assert self_extend.choose(4, 8192, "authors", window=5461) == (81921, 5461)
    with pytest.raises(ValueError, match="no group follows its authors' rule at window 5462"):
        self_extend.choose(4, 8192, "authors", window=5462)


def rule_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "authors' rule" in str(w.message)]


def patch_recording(model, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = rope_ext.patch(model, "self_extend", **kwargs)
    return info, rule_warnings(caught)


def test_patch_info_states_the_rule_and_the_choice(tiny_model):
    info, warned = patch_recording(tiny_model, factor=4, group_rule="reach")
    assert warned == []  # a group the rule picks never warns, even one that breaks the authors' rule
    rule = info.to_dict()["notes"]["authors_rule"]
    assert (info.params["group"], info.params["group_rule"]) == (6, "reach")
    assert rule["target"] == 512 and rule["value"] == 32 + 480 / 6 and rule["limit"] == 256 / 3 and rule["holds"] is False
    info, warned = patch_recording(tiny_model, factor=4, group_rule="authors")
    assert warned == [] and (info.params["group"], info.params["group_rule"]) == (9, "authors")
    assert info.notes["authors_rule"]["holds"] is True and info.notes["authors_rule"]["value"] == pytest.approx(256 / 3)
    info, warned = patch_recording(tiny_model, factor=4)
    assert warned == [] and info.params["group_rule"] == self_extend.DEFAULT_GROUP_RULE
    assert rope_ext.patch(tiny_model, "yarn", factor=4).notes == {}


def test_a_given_group_that_breaks_the_rule_warns_with_the_fix(tiny_model):
    info, warned = patch_recording(tiny_model, factor=4, group=6)
    assert info.params["group_rule"] is None
    assert warned == [
        "self_extend: group 6 with window 32 breaks its authors' rule at 512 tokens: W + (N - W)/G = 112 > "
        "2/3 x 128 = 85.3333 (Jin et al. 2024); for 512 tokens use group >= 9 (what group_rule='authors' picks "
        "at this window), or keep this pair to targets of at most 352 tokens"
    ]
    _, warned = patch_recording(tiny_model, factor=4, group=9)
    assert warned == []
    _, warned = patch_recording(tiny_model, factor=4, window=100, group=40)  # no group follows at this window
    assert len(warned) == 1 and warned[0].endswith("lower the window below 85.3333: no group follows the rule at window 100")
    _, warned = patch_recording(tiny_model, group=9, window=32)  # no factor: meant for its whole reach, 891 tokens
    assert len(warned) == 1 and "at 891 tokens" in warned[0]
    _, warned = patch_recording(tiny_model, factor=4, window=16)  # the window alone: the group is the rule's
    assert warned == []


def test_a_reload_warns_only_for_a_group_the_caller_gave(tiny_model, tmp_path):
    for kwargs, expected in (({"factor": 4}, 0), ({"factor": 4, "group": 6}, 1)):
        rope_ext.patch(tiny_model, "self_extend", **kwargs)
        tiny_model.save_pretrained(tmp_path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reloaded = rope_ext.from_pretrained(tmp_path, dtype=torch.float32)
        assert len(rule_warnings(caught)) == expected
        assert rope_ext.describe(reloaded)["params"] == rope_ext.describe(tiny_model)["params"]


def test_the_command_line_asks_for_the_authors_rule():
    params = loading.parse_params(["group_rule=authors"])
    assert params == {"group_rule": "authors"}
    loading.check_method("self_extend", 4, params)
