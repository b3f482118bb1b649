"""`rope_ext.method.check`: the one check of a method spec. The four entry points that take a spec
(rope_ext.patch, the eval commands, the lm-eval model type, the fine-tune config) refuse each fault
through it, in its words, before anything loads."""

from __future__ import annotations

import re

import pytest
import yaml
from helpers import REQUIRED, YARN_PARAMS, cli_error_line, random_model, required_params
from lm_eval.models.huggingface import HFLM

import rope_ext
from rope_ext import method as methods
from rope_ext.evals.lm_eval_model import ModelArgsError, RopeExtLM
from rope_ext.training.config import ConfigError, parse_args

# (method, factor, params, the message of the fault)
FAULTS = [
    ("rope2", 4.0, {}, "unknown method 'rope2' (did you mean 'rerope' or 'longrope'?); valid methods: linear, ntk, dynamic"),
    ("yarn", None, {}, "method 'yarn' needs a factor (the scale relative to the original window, > 1)"),
    ("yarn", 1.0, {}, "factor must be a finite number > 1 and <= 1048576, got 1.0"),
    ("yarn", 4.0, {"beta_fast": "x"}, "yarn: parameter beta_fast must be a number, got 'x'"),
]
IDS = ["unknown method", "no factor", "bad factor", "bad parameter"]


def message_of(name, factor, params) -> str:
    with pytest.raises(ValueError) as raised:
        methods.check(name, factor, params)
    return str(raised.value)


def test_check_gives_the_bound_method_the_factor_and_the_params():
    method, factor, params = methods.check("yarn", 4, {"beta_fast": 16})
    assert method is methods.REGISTRY["yarn"]
    assert factor == 4.0 and isinstance(factor, float)
    assert params == YARN_PARAMS
    assert methods.check("alibi_hybrid", 4, {"rope": "yarn"})[0].rope is methods.REGISTRY["yarn"]


def test_check_takes_no_factor_where_the_method_needs_none():
    assert not methods.REGISTRY["self_extend"].factor_required and not methods.REGISTRY["rerope"].factor_required
    assert methods.check("self_extend", None, {"group": 4})[1] is None
    assert methods.check("rerope", None, {"leak": 8})[1] is None


@pytest.mark.parametrize("name, factor, params, message", FAULTS, ids=IDS)
def test_check_refuses_each_fault_with_one_message(name, factor, params, message):
    assert message_of(name, factor, params).startswith(message)


@pytest.mark.parametrize("name, factor, params, message", FAULTS, ids=IDS)
def test_the_api_refuses_through_check(name, factor, params, message):
    model = random_model()
    with pytest.raises(ValueError, match=f"^{re.escape(message_of(name, factor, params))}$"):
        rope_ext.patch(model, name, factor, **params)
    assert rope_ext.describe(model) is None


@pytest.mark.parametrize("name, factor, params, message", FAULTS, ids=IDS)
def test_the_eval_commands_refuse_through_check_before_the_model_loads(no_model, tmp_path, capsys, name, factor, params, message):
    argv = ["eval", "ppl", "--lengths", "64", "--method", name, "--output", str(tmp_path / "p")]
    argv += [] if factor is None else ["--factor", str(factor)]
    argv += [arg for key, value in params.items() for arg in ("--param", f"{key}={value}")]
    assert cli_error_line(argv, capsys) == f"rope-ext eval ppl: error: {message_of(name, factor, params)}"


@pytest.mark.parametrize("name, factor, params, message", FAULTS, ids=IDS)
def test_the_lm_eval_model_refuses_through_check_before_the_model_loads(monkeypatch, name, factor, params, message):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the model_args were checked")

    monkeypatch.setattr(HFLM, "__init__", refuse)
    with pytest.raises(ModelArgsError) as raised:
        RopeExtLM(pretrained="smollm2", method=name, factor=factor, **params)
    assert str(raised.value) == f"model_args: {message_of(name, factor, params)}"


@pytest.mark.parametrize("method, params", [("self_extend", {"group": 4}), ("rerope", {"leak": 8})])
def test_the_lm_eval_model_takes_no_factor_where_the_method_needs_none(tiny_path, method, params):
    lm = RopeExtLM(pretrained=str(tiny_path), method=method, **params)
    described = rope_ext.describe(lm.model)
    assert described["method"] == method and lm.max_length == described["max_length"] == lm.patch_info.max_length


@pytest.mark.parametrize("name, factor, params, message", FAULTS, ids=IDS)
def test_the_fine_tune_config_refuses_through_check(tmp_path, name, factor, params, message):
    config = tmp_path / "finetune.yaml"
    config.write_text(yaml.safe_dump({"patch": {"method": name, "factor": factor, "params": params}}))
    with pytest.raises(ConfigError) as raised:
        parse_args(["--config", str(config)])
    assert str(raised.value) == message_of(name, factor, params)


def test_the_fine_tune_config_takes_no_factor_where_the_method_needs_none(tmp_path):
    config = tmp_path / "finetune.yaml"
    config.write_text(yaml.safe_dump({"patch": {"method": "self_extend", "factor": None, "params": {"group": 4}}}))
    cfg, _ = parse_args(["--config", str(config)])
    assert cfg["patch"] == {"method": "self_extend", "factor": None, "params": {"group": 4}}


# A value other than the default for every parameter rope_ext.methods() lists (a parameter added
# to a method adds one here)
SET_TO = {
    "causal": False,
    "granularity": 2,
    "logn": True,
    "beta_fast": 16.0,
    "beta_slow": 2.0,
    "truncate": False,
    "attention_factor": 1.2,
    "low_freq_factor": 2.0,
    "high_freq_factor": 8.0,
    "rope": "yarn",
    "w": 16,
    "heads": [0, 1],
    "slope_scale": 0.5,
    "trainable": True,
    "group": 8,
    "window": 16,
    "group_rule": "authors",
    "leak": 8,
    "shift": 24,
    "local": 8,
    "temperature": True,
    "chunk_size": 48,
    "local_size": 8,
    "sinks": 2,
    "alpha": 4.0,
    "mscale": 0.5,
    "mscale_all_dim": 0.5,
    "partial_rotary_factor": 0.5,
    "short_factor": lambda pairs: [1.1] * pairs,
    "long_factor": lambda pairs: [3.0] * pairs,
    "scales": lambda pairs: [2, 8],
    "inside_window": True,
    "attn_scale": 0.1,
    "floor_scale": 32,
}


@pytest.mark.parametrize("name", list(rope_ext.methods()))
def test_the_listing_shows_only_parameters_a_user_can_set(name):
    """Every parameter rope_ext.methods() lists for a method takes a value other than its default:
    rope_ext.patch applies it and describes the patch with it."""
    listed = {key: default for key, default in rope_ext.methods()[name]["params"].items() if key != "factor"}
    assert set(listed) <= set(SET_TO), sorted(set(listed) - set(SET_TO))
    for key, default in listed.items():
        model = random_model()
        pairs = model.config.hidden_size // model.config.num_attention_heads // 2
        value = SET_TO[key](pairs) if callable(SET_TO[key]) else SET_TO[key]
        assert value != default
        info = rope_ext.patch(model, name, factor=4, **{**required_params(name, pairs), key: value})
        assert info.params[key] == value, (key, info.params[key])


def test_the_parameters_a_method_requires_are_the_ones_its_params_declare():
    """tests/helpers.py REQUIRED supplies each parameter a Param declares `required`, and no other."""
    declared = {
        name: sorted(key for key, spec in method.specs.items() if spec.required) for name, method in methods.REGISTRY.items()
    }
    required = {name: sorted(REQUIRED[name](8)) if name in REQUIRED else [] for name in methods.REGISTRY}
    assert {name: keys for name, keys in declared.items() if keys} == {
        name: [key for key in keys if key in declared[name]] for name, keys in required.items() if keys
    }
    for name in REQUIRED:
        spec = methods.REGISTRY[name]
        with pytest.raises(ValueError, match="is required"):
            methods.check(name, 4, {})
        assert methods.check(name, 4, REQUIRED[name](8))[0] is spec


def test_no_method_checks_its_parameters_in_code_of_its_own():
    """A method's parameters are Params and constraints, checked by Method.validate alone (what old
    records hold is read in today's terms where records are read, rope_ext.record.migrated)."""
    from rope_ext.method.base import Method

    assert {type(m).validate for m in methods.REGISTRY.values()} == {Method.validate}
    assert all(type(m).accept_factor is Method.accept_factor for m in methods.REGISTRY.values())


def test_a_param_states_its_kind_and_bounds_in_its_message():
    from rope_ext.method.base import MAX_FACTOR, Param, checked

    bounded = Param("p", 1.0, lo=0, lo_open=True, hi=MAX_FACTOR)
    assert checked(bounded, "m", 3) == 3 and checked(Param("p", 1.0, "float"), "m", 3) == 3.0
    with pytest.raises(ValueError, match=re.escape("m: p must be a finite number in (0, 1048576], got 0")):
        checked(bounded, "m", 0)
    with pytest.raises(ValueError, match=re.escape("m: p must be None or one of 'a', got 'b'")):
        checked(Param("p", None, "choice", choices=("a",)), "m", "b")
    assert checked(Param("p", None, "list", item=Param("i", kind="size"), sort=True), "m", (3, 1)) == [1, 3]
