"""The adapter's checks, without a server: config, parameters, per-request validation."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch

from opara_core import zoo
from opara_core.engine.build import EngineSettings
from opara_core.parameters import BATCH, VARLEN, parse, strings
from opara_core.serving.launcher import DEFAULT_MODEL_REPOSITORY
from opara_core.serving.model_dir import read_config
from opara_core.serving.triton_backend import (
    RangeCheck,
    RequestError,
    check_config,
    check_ranges,
    engine_settings,
    output_memory,
    request_tensors,
    torch_threads,
)


def config_of(model: str, repository: Path = DEFAULT_MODEL_REPOSITORY) -> dict:
    """The model's config.pbtxt as Triton's JSON gives it to `initialize`."""
    return read_config(repository / model)


@pytest.mark.parametrize("model", zoo.names())
def test_every_repository_config_passes_the_load_checks(model):
    config = config_of(model)
    entry = zoo.get(model)
    values = parse(VARLEN if entry.lengths else BATCH, strings(config))
    if not entry.lengths:  # variable lengths: serving.varlen checks the config (tests/test_varlen.py)
        check_config(entry, config)
    assert isinstance(engine_settings(values), EngineSettings)
    check_ranges(entry, values)
    assert output_memory(config) == values["output_memory"] == "host"


@pytest.mark.parametrize("model", zoo.names())
def test_batch_models_let_gpu_inputs_through(model):
    """FORCE_CPU_ONLY_INPUT_TENSORS "no" is Triton's own parameter: the adapter
    lets it through (before, any parameter it did not know failed the load)."""
    if zoo.get(model).serving != zoo.BATCH:
        pytest.skip("gpt2 reads its inputs in the generation loop")
    assert config_of(model)["parameters"]["FORCE_CPU_ONLY_INPUT_TENSORS"] == {"string_value": "no"}


@pytest.mark.parametrize(
    ("parameters", "problem"),
    [
        ({"FORCE_CPU_ONLY_INPUT_TENSORS": "false"}, "parameter FORCE_CPU_ONLY_INPUT_TENSORS is 'false'; allowed: yes, no"),
        ({"output_memory": "device"}, "parameter output_memory is 'device'; allowed: host, auto, gpu"),
    ],
)
def test_bad_transport_parameters_are_named(parameters, problem):
    """Also where output_memory is read alone, from another model's config (the floor model)."""
    with pytest.raises(ValueError, match=re.escape(problem)):
        output_memory({"parameters": {k: {"string_value": v} for k, v in parameters.items()}})
    with pytest.raises(ValueError, match=re.escape(problem)):
        parse(BATCH, parameters)


def threads_of(value: str | None, device: str) -> int | None:
    return torch_threads(parse(BATCH, {} if value is None else {"torch_threads": value})["torch_threads"], torch.device(device))


def test_torch_threads_auto_is_one_on_a_gpu_instance_and_torch_default_on_a_cpu_instance():
    """A GPU instance only copies on the CPU; a CPU instance computes on its threads."""
    assert threads_of(None, "cuda") == 1 and threads_of("auto", "cuda") == 1
    assert threads_of(None, "cpu") is None
    assert threads_of("0", "cuda") is None and threads_of("4", "cpu") == 4


@pytest.mark.parametrize("value", ["many", "-1", "1.5", ""])
def test_a_bad_torch_threads_value_is_named(value):
    with pytest.raises(ValueError, match=re.escape(f"parameter torch_threads is {value!r}; allowed: auto, or an integer >= 0")):
        threads_of(value, "cuda")


def test_a_config_that_differs_from_the_model_fails_at_load():
    config = config_of("googlenet")
    config["input"][0]["dims"] = [3, 299, 299]
    with pytest.raises(ValueError, match="image"):
        check_config(zoo.get("googlenet"), config)


def test_published_id_ranges_must_match_the_model():
    config = config_of("bert")
    config["parameters"]["value_range.input_ids"] = {"string_value": "0,100"}
    with pytest.raises(ValueError, match=re.escape("parameter value_range.input_ids is '0,100', the model's is '0,30522'")):
        check_ranges(zoo.get("bert"), parse(VARLEN, strings(config)))
    del config["parameters"]["value_range.input_ids"]
    with pytest.raises(ValueError, match=re.escape("parameter value_range.input_ids is not set, the model's is '0,30522'")):
        check_ranges(zoo.get("bert"), parse(VARLEN, strings(config)))
    config["parameters"]["value_range.image"] = {"string_value": "0,1"}
    with pytest.raises(ValueError, match=re.escape("parameter value_range.image is '0,1', the model's is not set")):
        check_ranges(zoo.get("bert"), parse(VARLEN, strings(config)))


@pytest.mark.parametrize(
    ("parameters", "problem"),
    [
        ({"policy": "fastest"}, "parameter policy is 'fastest'; allowed: auto, sequential, opara, nimble, asap, wavefront"),
        ({"max_streams": "0"}, "parameter max_streams is '0'; allowed: an integer >= 1"),
        ({"max_streams": "many"}, "parameter max_streams is 'many'; allowed: an integer >= 1"),
        ({"buckets": "1,two"}, "parameter buckets is '1,two'; allowed: comma-separated integers >= 1"),
        ({"buckets": "0,8"}, "parameter buckets is '0,8'; allowed: comma-separated integers >= 1"),
        ({"guard": "maybe"}, "parameter guard is 'maybe'; allowed: true, false"),
        ({"guard": "off"}, "parameter guard is 'off'; allowed: true, false"),  # one spelling of a boolean
        ({"guard": "1"}, "parameter guard is '1'; allowed: true, false"),
        ({"guard_tolerance": "tight"}, "parameter guard_tolerance is 'tight'; allowed: a number >= 0"),
        ({"layout": "nhcw"}, "parameter layout is 'nhcw'; allowed: auto, nchw, nhwc"),
        ({"colour": "blue", "fail_capture": "true"}, "unknown parameters ['colour', 'fail_capture'] for a batch model (fail_capture was removed: "),
        ({"scheduler": "dp"}, "unknown parameters ['scheduler'] for a batch model; known: FORCE_CPU_ONLY_INPUT_TENSORS, autotune, buckets, "),
        ({"fused_lanes_autotune": "true", "autotune": "false"}, "parameter fused_lanes_autotune is true, which needs autotune true too; autotune is false"),
    ],
)
def test_bad_parameters_are_named(parameters, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        parse(BATCH, parameters)


def test_parameters_become_engine_settings():
    given = {"policy": "nimble", "max_streams": "4", "buckets": "1, 8", "guard": "false", "layout": "nhwc", "fused_lanes_autotune": "true"}
    expected = EngineSettings(policy="nimble", max_streams=4, buckets=(1, 8), guard=False, layout="nhwc", fused_lanes_autotune=True)
    assert engine_settings(parse(BATCH, given)) == expected
    assert engine_settings(parse(VARLEN, given)) == expected


def good_bert(batch: int = 2) -> dict[str, torch.Tensor]:
    return dict(zip((s.name for s in zoo.get("bert").inputs), zoo.get("bert").example_inputs(batch)))


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda t: t.pop("attention_mask"), "missing input 'attention_mask'"),
        (lambda t: t.update(extra=torch.zeros((2, 1), dtype=torch.int64)), "unknown input 'extra'"),
        (lambda t: t.update(input_ids=t["input_ids"].to(torch.int32)), "datatype int32, expected int64"),
        (lambda t: t.update(input_ids=t["input_ids"][:, :64]), "shape [2, 64]"),
        (lambda t: t.update(input_ids=t["input_ids"][:1]), "has batch 2, other inputs have 1"),
        (lambda t: t.update(input_ids=t["input_ids"][:0], attention_mask=t["attention_mask"][:0]), "empty batch"),
        (lambda t: t["input_ids"].__setitem__((1, 7), 30522), "position 7"),
    ],
)
def test_each_bad_request_gets_a_message_naming_the_problem(change, problem):
    tensors = good_bert()
    change(tensors)
    with pytest.raises(RequestError) as error:
        request_tensors(zoo.get("bert"), tensors)
    assert problem in str(error.value)
    json.dumps(str(error.value))  # one plain line, fit for a response


def test_a_good_request_comes_back_in_model_order():
    tensors = good_bert()
    checked = request_tensors(zoo.get("bert"), dict(reversed(list(tensors.items()))))
    assert [a is tensors[s.name] for a, s in zip(checked, zoo.get("bert").inputs)] == [True, True]


def bert_requests(count: int, device: str) -> list[list[torch.Tensor]]:
    entry = zoo.get("bert")
    return [[t.to(device) for t in entry.example_inputs(1 + k % 3, seed=k)] for k in range(count)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_batch_range_check_names_the_same_problems_as_a_check_per_request(device):
    requests = bert_requests(6, device)
    requests[1][0][0, 7] = 30522
    requests[4][1][1, 3] = -1
    problems = RangeCheck(zoo.get("bert").inputs, torch.device(device)).problems(requests)
    assert problems == [next(filter(None, (s.check(t) for s, t in zip(zoo.get("bert").inputs, r))), None) for r in requests]
    assert [p is not None for p in problems] == [False, True, False, False, True, False]
    assert "position 7" in problems[1] and "attention_mask" in problems[4]


def test_request_tensors_leaves_host_ids_to_the_graph_when_asked():
    tensors = good_bert()
    tensors["input_ids"][1, 7] = 30522
    assert request_tensors(zoo.get("bert"), tensors, check_ids=False)[0] is tensors["input_ids"]
    with pytest.raises(RequestError, match="position 7"):
        request_tensors(zoo.get("bert"), tensors)


def test_the_batch_range_check_names_a_bad_id_at_a_length_other_than_the_specs():
    """BERT's spec says 128 tokens; a variable-length request of 40 with a bad id
    is described by its id, not refused for its length."""
    entry = zoo.get("bert")
    good = [torch.zeros(2, 40, dtype=torch.int64), torch.ones(2, 40, dtype=torch.int64)]
    bad = [t.clone() for t in good]
    bad[0][1, 39] = 30522
    problems = RangeCheck(entry.inputs, torch.device("cpu")).problems([good, bad])
    assert problems[0] is None
    assert "30522" in problems[1] and "position 39" in problems[1] and "shape" not in problems[1]


def test_ids_on_a_gpu_are_left_to_the_batch_check():
    """request_tensors checks host ids itself and leaves device ids to RangeCheck
    (a meta tensor stands in for a GPU one: it has a device and no data)."""
    tensors = {name: t.to("meta") for name, t in good_bert().items()}
    assert [t.device.type for t in request_tensors(zoo.get("bert"), tensors)] == ["meta", "meta"]


@pytest.mark.gpu
def test_a_batch_on_the_gpu_is_checked_with_one_synchronisation():
    """The old check (TensorSpec.check per request and input) waited on the GPU
    once per ranged input of every request: 16 here."""
    requests = bert_requests(8, "cuda")
    check = RangeCheck(zoo.get("bert").inputs, torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert check.problems(requests) == [None] * 8
    finally:
        torch.cuda.set_sync_debug_mode("default")
    synchronising = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(synchronising) == 1, [str(w.message) for w in caught]
