"""scripts/varlen_bench.py's repository: the configs it serves must still pass the
model's load checks with its overrides and instance count."""

from __future__ import annotations


import pytest
from conftest import load_script
from test_triton_backend import config_of
from test_varlen import KEPT, first_use_runners_with_kept_table

from opara_core import zoo
from opara_core.parameters import VARLEN, parse, strings
from opara_core.parameters import get as get_parameter
from opara_core.serving.varlen import check_config, varlen_settings

load_script("serving_bench")  # varlen_bench imports it by name
varlen_bench = load_script("varlen_bench")


def test_overrides_instances_and_queue_delay_reach_a_config_that_loads(tmp_path):
    overrides = {"bert": {"scheduler": "greedy", "compiler": "engine", "policy": "sequential"}}
    repository = varlen_bench.make_repository(["bert", "t5"], tmp_path, overrides, queue_delay_us=250, instances=2)
    for model in ("bert", "t5"):
        config = config_of(model, repository)
        assert [group["count"] for group in config["instance_group"]] == [2]
        assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == 250
        check_config(zoo.get(model), config)
        settings = varlen_settings(zoo.get(model), parse(VARLEN, strings(config)))
        assert (settings.scheduler, settings.compiler) == (("greedy", "engine") if model == "bert" else ("dp", "saved"))
    assert config_of("bert", repository)["parameters"]["policy"] == {"string_value": "sequential"}


def test_every_shape_is_built_at_load_unless_an_override_says_otherwise(tmp_path):
    """The shipped T5 captures on first use; the benchmark's levels must not pay its builds."""
    assert config_of("t5")["parameters"]["capture"] == {"string_value": "first_use"}
    repository = varlen_bench.make_repository(["bert", "t5"], tmp_path / "a", {}, None)
    assert {config_of(m, repository)["parameters"]["capture"]["string_value"] for m in ("bert", "t5")} == {"load"}
    repository = varlen_bench.make_repository(["t5"], tmp_path / "b", {"t5": {"capture": "first_use"}}, None)
    assert config_of("t5", repository)["parameters"]["capture"] == {"string_value": "first_use"}


def test_precision_reaches_every_config_a_models_own_set_wins_and_a_bad_one_is_refused(tmp_path, capsys):
    """--precision bf16 (issue 72) in every model's config, once; `--set t5:precision=fp16` wins
    for t5; without --precision the configs keep their own."""
    parser = varlen_bench.argument_parser()
    args = parser.parse_args(["--precision", "bf16", "--set", "t5:precision=fp16", "--set", "bert:policy=sequential"])
    repository = varlen_bench.make_repository(["bert", "t5"], tmp_path / "a", varlen_bench.config_overrides(args, ["bert", "t5"]), None)
    for model, expected in (("bert", "bf16"), ("t5", "fp16")):
        config = config_of(model, repository)
        check_config(zoo.get(model), config)
        assert parse(VARLEN, strings(config))["precision"] == expected
    assert config_of("bert", repository)["parameters"]["policy"] == {"string_value": "sequential"}
    repository = varlen_bench.make_repository(["bert"], tmp_path / "b", varlen_bench.config_overrides(parser.parse_args([]), ["bert"]), None)
    assert parse(VARLEN, strings(config_of("bert", repository)))["precision"] == parse(VARLEN, strings(config_of("bert")))["precision"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--precision", "bf17"])
    error = capsys.readouterr().err
    assert "argument --precision: invalid choice: 'bf17'" in error
    assert all(repr(choice) in error for choice in get_parameter("precision").choices)


def test_a_bad_override_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="parameter sched uler"):
        varlen_bench.make_repository(["bert"], tmp_path, {"bert": {"sched uler": "dp"}}, None)


def test_the_cost_table_is_read_back_from_a_first_use_report_with_kept_timings(tmp_path, monkeypatch):
    """A first-use start's report marks the cells an earlier start timed (s); the
    prediction must read those rows too, not stop at the first of them."""
    _, runners = first_use_runners_with_kept_table(tmp_path, monkeypatch)
    read = varlen_bench.cost_table(runners.report.summary())
    assert read == pytest.approx({f"{shape[0]}x{batch}": seconds * 1e3 for (shape, batch), seconds in KEPT.items()})


def test_each_model_gets_its_floor_with_its_own_config_unless_asked_not_to(tmp_path):
    overrides = {"bert": {"precision": "bf16"}}
    repository = varlen_bench.make_repository(["bert", "t5"], tmp_path / "a", overrides, queue_delay_us=250, instances=2)
    for model in ("bert", "t5"):
        config, floor = config_of(model, repository), config_of(model + "_floor", repository)
        assert {k: v for k, v in floor.items() if k != "name"} == {k: v for k, v in config.items() if k != "name"}
        assert "FloorModel" in (repository / f"{model}_floor" / "1" / "model.py").read_text()
    repository = varlen_bench.make_repository(["bert"], tmp_path / "b", {}, None, floor=False)
    assert sorted(p.name for p in repository.iterdir()) == ["bert"]


def test_the_ratio_table_sets_the_dp_against_padding_greedy_and_the_floor_that_bounds_them():
    rows = [
        {"model": "bert", "concurrency": 16, "scheduler": "floor", "throughput_rps": 2400.0},
        {"model": "bert", "concurrency": 16, "scheduler": "padded", "throughput_rps": 1200.0},
        {"model": "bert", "concurrency": 16, "scheduler": "greedy", "throughput_rps": 1500.0},
        {"model": "bert", "concurrency": 16, "scheduler": "dp", "throughput_rps": 1800.0},
        {"model": "bert", "concurrency": 64, "scheduler": "padded", "throughput_rps": 1000.0},  # a cut run: no dp, no floor
    ]
    header, _, c16, c64 = varlen_bench.ratios(rows).splitlines()
    assert header.split(" | ")[2:6] == ["floor", "padded", "greedy", "dp"]
    assert header.split(" | ")[6:] == ["dp / padded", "dp / greedy", "dp / floor", "floor / padded |"]
    assert c16.split(" | ")[2:] == ["2400.0", "1200.0", "1500.0", "1800.0", "1.50x", "1.20x", "0.75x", "2.00x |"]
    assert c64.split(" | ")[2:] == ["-", "1000.0", "-", "-", "-", "-", "-", "- |"]
