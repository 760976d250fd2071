"""experiments.configs: one home of every default (configs/default.py), the stored runs that
lack a key added since (with_defaults, BEFORE_THE_KEY), --help's key list."""

import json

import ml_collections
import pytest

from experiments.configs import (BEFORE_THE_KEY, config_changes, describe_keys, keys_help,
                                 load_config, with_defaults)


def _without(config: dict, *keys: str) -> dict:
    """``config`` (a dict) without the dotted ``keys``, as a run stored before them."""
    out = json.loads(json.dumps(config))
    for key in keys:
        *sections, name = key.split(".")
        node = out
        for section in sections:
            node = node[section]
        del node[name]
    return out


def test_a_stored_config_gets_the_keys_it_lacks_at_the_value_it_had():
    new = load_config("default").to_dict()
    stored = _without(new, "train.optimizer", "train.muon", "model.attention", "data.tokens",
                      "data.suffixes", "precision.backend")
    stored["precision"]["policy_sha256"] = "ab" * 32  # what config_record adds stays
    before = json.dumps(stored)
    full = with_defaults(stored)
    assert json.dumps(stored) == before  # not changed in place
    assert full["precision"]["policy_sha256"] == "ab" * 32
    assert (full["train"]["optimizer"], full["model"]["attention"], full["data"]["tokens"],
            full["precision"]["backend"]) == ("adamw", "einsum", None, "auto")
    assert full["train"]["muon"] == new["train"]["muon"]
    # a data folder gave only its .py files before data.suffixes existed
    assert BEFORE_THE_KEY == {"data.suffixes": (".py",)}
    assert full["data"]["suffixes"] == (".py",) != new["data"]["suffixes"]
    assert with_defaults(new) == new  # a whole config: nothing to fill
    # read back as a config, it trains the model and reads the data a fresh one does
    from experiments.step import model_config

    back = ml_collections.ConfigDict(with_defaults(_without(new, "model.mlp_saved")))
    assert model_config(back) == model_config(load_config("default"))


def test_a_key_added_since_is_no_change_at_the_value_the_run_had():
    new = load_config("default").to_dict()
    old = _without(new, "data.suffixes", "precision.backend")
    assert config_changes(old, new) == {"data.suffixes": (None, [])}
    assert config_changes(old, load_config("default", ["data.suffixes=('.py',)"]).to_dict()
                          ) == {}
    assert config_changes(old, load_config("default", ["precision.backend=xla"]).to_dict()
                          ) == {"data.suffixes": (None, []), "precision.backend": (None, "xla")}


def test_the_configs_start_from_the_defaults_and_help_lists_every_key():
    def keys(config):
        return {line.split(" = ")[0].strip() for line in describe_keys(config).splitlines()}

    default = load_config("default")
    assert len(keys(default)) == 82
    for name in ("tiny", "muon", "sweep_tiny", "beyond"):
        assert keys(load_config(name)) >= keys(default)
    text = keys_help()
    assert text.startswith("config keys (override with key=value) and their defaults in "
                           "configs/default.py:\n")
    assert text.endswith(describe_keys(default))
    assert "  train.muon.consistent_rms = 0.2" in text and "  data.tokens = None" in text


def test_a_muon_key_the_defaults_do_not_have_is_refused():
    from experiments.optimizers import make_optimizer

    t = load_config("tiny", ["train.optimizer=muon"]).train
    t.muon.ns_stepz = 3  # a typo, set from Python (an override of it is refused already)
    with pytest.raises(ValueError, match=r"train.muon has unknown keys \['ns_stepz'\]; "
                                         "known: adam_lr_ratio, beta, consistent_rms"):
        make_optimizer(t)
