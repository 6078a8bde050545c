"""Ollama's request `options`: type coercion, merge order, defaults, and value checks."""

from __future__ import annotations

import math
from typing import Any

import pytest

from sidecar.config.options import MAX_CTX, OptionError, coerce
from sidecar.engine.sampling import SamplingParams
from sidecar.runtime.options import Effective, effective

pytestmark = pytest.mark.pure

# -- coerce ----------------------------------------------------------------------------------------


def test_none_is_no_options() -> None:
    assert coerce(None) == {}
    assert coerce({}) == {}


@pytest.mark.parametrize("options", [[], "temperature=1", 3, True])
def test_options_must_be_an_object(options: Any) -> None:
    with pytest.raises(OptionError, match=r"^options must be an object$"):
        coerce(options)


def test_integers_accept_numbers_and_truncate_floats() -> None:
    out = coerce({"top_k": 3.9, "num_predict": -2.5, "seed": 42, "num_ctx": 4096.0})
    assert out == {"top_k": 3, "num_predict": -2, "seed": 42, "num_ctx": 4096}
    assert all(type(v) is int for v in out.values())


def test_floats_accept_integers() -> None:
    out = coerce({"temperature": 1, "top_p": 0, "repeat_penalty": 1.1})
    assert out == {"temperature": 1.0, "top_p": 0.0, "repeat_penalty": 1.1}
    assert all(type(v) is float for v in out.values())


@pytest.mark.parametrize(
    ("key", "value", "kind"),
    [
        ("top_k", True, "integer"),
        ("top_k", "40", "integer"),
        ("seed", [1], "integer"),
        ("num_ctx", math.inf, "integer"),
        ("num_predict", math.nan, "integer"),
        ("temperature", False, "float32"),
        ("temperature", "0.7", "float32"),
        ("top_p", {"v": 1}, "float32"),
        ("use_mmap", 1, "boolean"),
        ("use_mmap", "true", "boolean"),
        ("stop", "\n", "array"),
        ("stop", ["a", 1], "array"),
        ("stop", {"a": 1}, "array"),
    ],
)
def test_wrong_types_get_ollamas_message(key: str, value: Any, kind: str) -> None:
    with pytest.raises(OptionError) as e:
        coerce({key: value})
    assert str(e.value) == f'option "{key}" must be of type {kind}'


def test_stop_is_an_array_of_strings() -> None:
    assert coerce({"stop": ["\n", "User:"]}) == {"stop": ["\n", "User:"]}
    assert coerce({"stop": []}) == {"stop": []}


def test_booleans_are_kept() -> None:
    assert coerce({"use_mmap": False}) == {"use_mmap": False}


def test_unknown_keys_and_nulls_are_ignored() -> None:
    out = coerce({"mirostat": 2, "tfs_z": "x", "temperature": None, "stop": None, "top_k": 5})
    assert out == {"top_k": 5}


# -- effective -------------------------------------------------------------------------------------


def test_defaults_are_ollamas() -> None:
    eff = effective()
    s = eff.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p) == (0.8, 40, 0.9, 0.0)
    assert (s.repeat_penalty, s.repeat_last_n, s.seed) == (1.0, 64, -1)
    assert (s.presence_penalty, s.frequency_penalty) == (0.0, 0.0)
    assert s == SamplingParams()
    assert eff == Effective(sampling=SamplingParams(), num_predict=-1, stop=[], num_ctx=None,
                            draft_num_predict=None)


def test_later_layers_win() -> None:
    """Defaults < model params < pair parameters < request options."""
    model = {"temperature": 0.5, "top_k": 10, "stop": ["<|im_end|>"], "num_ctx": 2048}
    pair = {"temperature": 0.7, "num_ctx": 4096}
    request = {"temperature": 0.0, "seed": 7}
    eff = effective(model, pair, request)
    assert eff.sampling.temperature == 0.0
    assert eff.sampling.top_k == 10
    assert eff.sampling.seed == 7
    assert eff.stop == ["<|im_end|>"]
    assert eff.num_ctx == 4096
    assert effective(request, pair, model).sampling.temperature == 0.5


def test_a_null_in_a_later_layer_does_not_erase_an_earlier_value() -> None:
    assert effective({"temperature": 0.2}, {"temperature": None}).sampling.temperature == 0.2


def test_layers_are_not_modified() -> None:
    a = {"temperature": 0.2}
    effective(a, {"temperature": 0.3})
    assert a == {"temperature": 0.2}


def test_coerced_request_options_flow_into_effective() -> None:
    eff = effective({"num_ctx": 2048}, coerce({"top_k": 5.0, "temperature": 1, "stop": ["x"]}))
    assert eff.sampling.top_k == 5 and eff.sampling.temperature == 1.0
    assert eff.stop == ["x"] and eff.num_ctx == 2048



def test_num_gpu_flows_into_effective() -> None:
    """The request's count wins over the pair's parameters; every negative is -1, Ollama's "not set"
    (runtime.manager then takes what is loaded, or the pair's runtime: count)."""
    assert effective().num_gpu == -1
    assert effective({"num_gpu": 8}, coerce({"num_gpu": 3.0})).num_gpu == 3
    assert effective({"num_gpu": 8}, coerce({})).num_gpu == 8
    assert effective(coerce({"num_gpu": -7})).num_gpu == -1


@pytest.mark.parametrize(("num_predict", "expected"), [(-1, -1), (-2, -1), (0, 0), (128, 128)])
def test_num_predict(num_predict: int, expected: int) -> None:
    assert effective({"num_predict": num_predict}).num_predict == expected


def test_edge_values_that_are_allowed() -> None:
    eff = effective({"temperature": 0, "top_p": 1.0, "min_p": 1.0, "top_k": 0, "repeat_last_n": -1,
                     "num_ctx": MAX_CTX, "draft_num_predict": 0})
    assert eff.sampling.greedy
    assert eff.sampling.top_k == 0 and eff.sampling.repeat_last_n == -1
    assert eff.num_ctx == MAX_CTX and eff.draft_num_predict == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_ctx": 10**9}, f'option "num_ctx" must be between 0 and {MAX_CTX}'),
        ({"num_ctx": -1}, f'option "num_ctx" must be between 0 and {MAX_CTX}'),
        ({"num_predict": -5}, 'option "num_predict" must be >= -2 (-1 = no limit, -2 = fill the context)'),
        ({"top_k": -1}, 'option "top_k" must be >= 0 (0 disables it)'),
        ({"temperature": math.nan}, 'option "temperature" must be a finite number'),
        ({"temperature": math.inf}, 'option "temperature" must be a finite number'),
        ({"temperature": -0.1}, 'option "temperature" must be >= 0'),
        ({"top_p": 1.5}, 'option "top_p" must be between 0 and 1'),
        ({"top_p": -0.1}, 'option "top_p" must be between 0 and 1'),
        ({"min_p": 2.0}, 'option "min_p" must be between 0 and 1'),
        ({"repeat_penalty": 0.0}, 'option "repeat_penalty" must be > 0'),
        ({"presence_penalty": -math.inf}, 'option "presence_penalty" must be a finite number'),
        ({"frequency_penalty": math.nan}, 'option "frequency_penalty" must be a finite number'),
        ({"repeat_last_n": -2}, 'option "repeat_last_n" must be >= -1 (-1 = num_ctx, 0 = off)'),
        ({"draft_num_predict": -1}, 'option "draft_num_predict" must be >= 0 (0 disables speculation)'),
    ],
)
def test_absurd_values_are_rejected_with_clear_messages(options: dict[str, Any], message: str) -> None:
    with pytest.raises(OptionError) as e:
        effective({"temperature": 0.5}, options)
    assert str(e.value) == message


def test_a_bad_value_in_an_earlier_layer_overridden_later_is_fine() -> None:
    assert effective({"top_p": 7.0}, {"top_p": 0.5}).sampling.top_p == 0.5
