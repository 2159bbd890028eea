"""SpeculativeConfig: vLLM's --speculative-config keys in, a ValueError naming the field out."""

from __future__ import annotations

import pytest

from pdserve.common.spec.config import SpeculativeConfig
from pdserve.common.spec.ngram import NgramProposer
from pdserve.common.spec.proposer import create_proposer
from pdserve.common.spec.suffix import SuffixProposer


def test_parse_json_text_and_mapping_agree():
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
    config = SpeculativeConfig.parse(text)
    assert config == SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
    )
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == (
        "ngram",
        3,
        5,
    )


def test_nothing_means_no_speculation():
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse("  ") is None


def test_vllm_suffix_keys_map_to_fields_and_nulls_keep_defaults():
    config = SpeculativeConfig.parse(
        {
            "method": "suffix",
            "num_speculative_tokens": 8,
            "suffix_decoding_max_tree_depth": 32,
            "suffix_decoding_max_cached_requests": 5,
            "suffix_decoding_min_token_prob": 0.2,
            "suffix_decoding_max_spec_factor": 2.0,
            "prompt_lookup_min": None,
        }
    )
    assert config.suffix_max_tree_depth == 32
    assert config.suffix_max_cached_requests == 5
    assert config.suffix_min_token_prob == 0.2
    assert config.suffix_max_spec_factor == 2.0
    assert config.prompt_lookup_min == 1


def test_suffix_k_defaults_to_tree_depth_as_in_vllm():
    config = SpeculativeConfig.parse({"method": "suffix", "suffix_max_tree_depth": 12})
    assert config.num_speculative_tokens == 12
    assert SpeculativeConfig.parse({"method": "suffix"}).num_speculative_tokens == 24


def test_round_trip_through_json():
    config = SpeculativeConfig("suffix", 5, suffix_max_cached_requests=7, adaptive=False)
    assert SpeculativeConfig.parse(config.to_json()) == config


@pytest.mark.parametrize(
    "value, field",
    [
        ('{"method": "ngram", "num_speculative_tokens": 3, "bogus": 1}', "bogus"),
        ('{"num_speculative_tokens": 3}', "method"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2.5}', "num_speculative_tokens"),
        ('{"method": "lookahead", "num_speculative_tokens": 3}', "method"),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}',
            "prompt_lookup_min",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5}',
            "prompt_lookup_max",
        ),
        (
            '{"method": "suffix", "num_speculative_tokens": 3, "suffix_max_tree_depth": 1}',
            "suffix_max_tree_depth",
        ),
        (
            '{"method": "suffix", "num_speculative_tokens": 3, "suffix_min_token_prob": 1.5}',
            "suffix_min_token_prob",
        ),
        (
            '{"method": "suffix", "num_speculative_tokens": 3, "suffix_max_cached_requests": -1}',
            "suffix_max_cached_requests",
        ),
        ('{"method": "suffix", "num_speculative_tokens": 3, "adaptive": "yes"}', "adaptive"),
    ],
)
def test_bad_field_is_named(value, field):
    with pytest.raises(ValueError, match=rf"^speculative_config\.{field}:"):
        SpeculativeConfig.parse(value)


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_methods_not_built_say_so(method):
    with pytest.raises(ValueError, match="not built yet"):
        SpeculativeConfig.parse({"method": method, "num_speculative_tokens": 3})


@pytest.mark.parametrize("value", ["{not json", "[1, 2]", '"ngram"'])
def test_not_an_object_is_refused(value):
    with pytest.raises(ValueError, match="speculative_config"):
        SpeculativeConfig.parse(value)


def test_draft_model_is_refused_on_a_decoding_node_at_tp_above_1():
    draft = SpeculativeConfig("draft_model", 3, model="/d")
    draft.check_decoding_tp(1)
    with pytest.raises(ValueError, match="speculative_config.method: draft_model drafts at "
                       "tensor parallel size 1 only, not 2"):  # fmt: skip
        draft.check_decoding_tp(2)
    for method in ("ngram", "suffix"):  # rank 0's pure-Python proposers draft at any TP
        SpeculativeConfig(method, 3).check_decoding_tp(4)


def test_registry_builds_each_method():
    assert isinstance(create_proposer(SpeculativeConfig("ngram", 3)), NgramProposer)
    assert isinstance(create_proposer(SpeculativeConfig("suffix", 3)), SuffixProposer)
