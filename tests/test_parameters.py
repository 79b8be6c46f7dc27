"""opara_core.parameters: every config.pbtxt parameter declared once, the one
parser, the settings dataclasses built from it, and docs/configuration.md
generated from it (no server, no torch in the module itself)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from opara_core import parameters
from opara_core.parameters import BATCH, GENERATION, VARLEN, ParameterError, parse
from opara_core.serving import model_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "configuration.md"


def test_the_committed_docs_are_the_generated_ones():
    """docs/configuration.md is the schema's markdown: a parameter documented
    but not declared (or declared but not documented) shows as a difference."""
    committed = DOCS.read_text() if DOCS.exists() else ""
    documented = set(re.findall(r"^\| `([^`]+)` \|", committed, re.M))
    declared = {p.name for p in parameters.SCHEMA}
    assert committed == parameters.markdown(), (
        f"docs/configuration.md is not what opara_core/parameters.py generates: run `{parameters.COMMAND}` "
        f"(documented, not declared: {sorted(documented - declared)}; declared, not documented: {sorted(declared - documented)})"
    )


def test_the_command_prints_the_docs(capsys):
    assert parameters.main(["--markdown"]) == 0
    assert capsys.readouterr().out == parameters.markdown()


def test_the_schema_imports_no_torch():
    code = "import sys, opara_core.parameters; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_every_parameter_is_declared_once_and_accepted_by_some_kind():
    names = [p.name for p in parameters.SCHEMA]
    assert len(names) == len(set(names))
    for p in parameters.SCHEMA:
        assert p.kinds and set(p.kinds) <= set(parameters.KINDS), p.name
        assert p.help and "\n" not in p.help, p.name
        if not p.family and p.default is not None:
            p.check(p.default)  # every default is an allowed value
    # one boolean spelling: no parameter of ours is a 0/1 or yes/no flag (Triton's own keeps yes/no)
    flags = [p.name for p in parameters.SCHEMA if p.type == "choice" and set(p.choices) <= {"yes", "no", "0", "1", "on", "off"}]
    assert flags == ["FORCE_CPU_ONLY_INPUT_TENSORS"]


def test_the_settings_dataclasses_are_the_declared_groups():
    """EngineSettings, VarLenSettings and GenerationSettings take their fields'
    defaults from the schema: their fields are exactly their group's parameters,
    in declaration order (VarLenSettings' `axes` is the length_buckets family)."""
    from opara_core.engine.build import EngineSettings
    from opara_core.serving.generation import GenerationSettings
    from opara_core.serving.varlen import VarLenSettings

    for settings, group, extra in (
        (EngineSettings, parameters.ENGINE, []),
        (VarLenSettings, parameters.VARLEN_GROUP, ["axes"]),
        (GenerationSettings, parameters.GENERATION_GROUP, []),
    ):
        declared = parameters.group(group)
        assert [f.name for f in dataclasses.fields(settings)] == extra + [p.name for p in declared], settings
        defaults = {f.name: f.default for f in dataclasses.fields(settings) if f.name not in extra}
        assert defaults == {p.name: p.default for p in declared}, settings


def test_choices_come_from_the_code_that_implements_them():
    from opara_core.planning import batching, iteration, policies

    assert parameters.get("policy").choices == ("auto", *policies.names())
    assert parameters.get("scheduler").choices == tuple(batching.SCHEDULERS)
    assert parameters.get("scheduling").choices == iteration.MODES


@pytest.mark.parametrize("text, value", [("true", True), ("false", False), (" true ", True)])
def test_a_boolean_is_true_or_false(text, value):
    assert parse(BATCH, {"guard": text})["guard"] is value


@pytest.mark.parametrize("text", ["yes", "no", "1", "0", "on", "off", "True", "FALSE", ""])
def test_any_other_boolean_spelling_is_refused_naming_the_parameter_the_value_and_the_allowed_ones(text):
    with pytest.raises(ParameterError) as refused:
        parse(BATCH, {"profile": text})
    assert str(refused.value) == f"parameter profile is {text.strip()!r}; allowed: true, false"


def test_defaults_fill_what_a_config_leaves_out():
    values = parse(GENERATION, {"max_active": "3"})
    assert values["max_active"] == 3 and values["max_context"] == 256 and values["merge_tokens"] is True
    assert values.given == {"max_active"}
    assert values.settings(parameters.GENERATION_GROUP)["admit_every"] == 4


def test_unknown_parameters_are_named_with_the_known_ones_of_the_kind():
    with pytest.raises(ParameterError) as refused:
        parse(GENERATION, {"guard": "true", "colour": "blue"})
    message = str(refused.value)
    assert message.startswith("unknown parameters ['colour', 'guard'] for a generation model; known: admit_every, config_overrides, ")
    assert "max_active" in message and "policy" not in message
    with pytest.raises(ParameterError, match=re.escape("unknown parameters ['scheduler'] for a batch model")):
        parse(BATCH, {"scheduler": "dp"})
    assert parse(VARLEN, {"scheduler": "greedy"})["scheduler"] == "greedy"


def test_key_families_take_any_member_and_check_each_value():
    values = parse(VARLEN, {"length_buckets.sequence": "16, 512", "max_length.input_ids": "512", "value_range.input_ids": "0,30522"})
    assert values.family("length_buckets") == {"sequence": (16, 512)}
    assert values.family("max_length") == {"input_ids": 512} and values.family("value_range") == {"input_ids": (0, 30522)}
    assert values.family("upper_bounds") == {}
    with pytest.raises(ParameterError, match=re.escape("parameter length_buckets.sequence is '16,0'; allowed: comma-separated integers >= 1")):
        parse(VARLEN, {"length_buckets.sequence": "16,0"})
    with pytest.raises(ParameterError, match=re.escape("unknown parameters ['length_buckets.'] for a variable-length model")):
        parse(VARLEN, {"length_buckets.": "16"})  # a family member needs a name


def test_an_environment_override_replaces_the_config_and_is_named_when_bad():
    config = {"capture": "first_use"}
    assert parse(VARLEN, config, environ={})["capture"] == "first_use"
    assert parse(VARLEN, config, environ={"OPARA_CAPTURE": "load"})["capture"] == "load"
    assert parse(VARLEN, config, environ={"OPARA_CAPTURE": ""})["capture"] == "first_use"  # set but empty: not set
    with pytest.raises(ParameterError) as refused:
        parse(VARLEN, {}, environ={"OPARA_CAPTURE": "sometimes"})
    assert str(refused.value) == "parameter capture (from the environment variable OPARA_CAPTURE) is 'sometimes'; allowed: load, first_use"
    assert parameters.get("capture").env == "OPARA_CAPTURE"


def test_a_retired_value_says_it_was_removed_and_what_to_use():
    for retired in ("aot", "inductor"):
        with pytest.raises(ParameterError) as refused:
            parse(VARLEN, {"compiler": retired})
        assert f"parameter compiler is '{retired}', which was removed (" in str(refused.value)
        assert str(refused.value).endswith("; allowed: saved, engine")


def test_one_parameter_read_alone_leaves_the_others():
    """What the floor model does with a benchmarked model's config."""
    given = {"output_memory": "auto", "scheduler": "dp", "anything": "else"}
    assert parameters.value(given, "output_memory") == "auto"
    assert parameters.value({}, "output_memory") == "host"
    with pytest.raises(ParameterError, match="parameter output_memory is 'disk'"):
        parameters.value({"output_memory": "disk"}, "output_memory")


@pytest.mark.parametrize("model", sorted(p.parent.name for p in (ROOT / "model_repository").glob("*/config.pbtxt")))
def test_every_shipped_config_parses_for_its_kind_of_model(model):
    """The kind is the one the model.py's adapter reads (its base class)."""
    from test_triton_backend import config_of

    source = (ROOT / "model_repository" / model / "1" / "model.py").read_text()
    kind = {"OparaModel": BATCH, "VarLenModel": VARLEN, "GenerationModel": GENERATION}[re.search(r"class TritonPythonModel\((\w+)\)", source).group(1)]
    params = model_config.parameters(model_config.read(ROOT / "model_repository" / model / "config.pbtxt"))
    values = parse(kind, params, environ={})
    assert values.given == set(params)
    if kind != GENERATION:
        assert parameters.strings(config_of(model)) == params
