"""The model zoo: names, deterministic builds, output specs, and input range checks.

Export and tracing are tested in tests/test_graph.py; here every model is built
(twice, for determinism) and run once eagerly at batch 1, so this file stays
within about a minute on two cores.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opara_core import zoo
from opara_core.models.deepfm import CRITEO_VOCAB_SIZES, DeepFM

EXPECTED_NAMES = ["googlenet", "inception_v3", "resnet50", "nasnet", "deepfm", "bert", "t5"]
GENERATION_NAMES = ["gpt2"]
ALL_NAMES = EXPECTED_NAMES + GENERATION_NAMES


def _spec(model: str, name: str) -> zoo.TensorSpec:
    return next(s for s in zoo.get(model).inputs if s.name == name)


SPARSE = _spec("deepfm", "sparse")
INPUT_IDS = _spec("bert", "input_ids")


def test_names_are_the_seven_models_in_order():
    assert zoo.names() == zoo.names(zoo.BATCH) == EXPECTED_NAMES


def test_generation_models_are_listed_apart():
    """gpt2 streams tokens from a decoupled model; the engine's tests and tools,
    which iterate names(), trace batch models only."""
    assert zoo.names(zoo.GENERATE) == GENERATION_NAMES
    assert zoo.names(None) == ALL_NAMES


def test_unknown_name_raises_key_error_listing_the_names():
    with pytest.raises(KeyError) as info:
        zoo.get("alexnet")
    message = str(info.value)
    assert "alexnet" in message
    assert all(name in message for name in ALL_NAMES)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_entry_specs_are_consistent(name):
    model = zoo.get(name)
    assert model.name == name
    assert model.description
    assert len(model.outputs) == 1 and model.outputs[0].dtype == torch.float32
    for spec in model.inputs:
        # An integer input without a range could index out of a table inside a CUDA graph.
        assert spec.dtype.is_floating_point or spec.value_range is not None, spec.name


@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_dynamic_shapes_make_the_batch_dim_of_every_input_dynamic(name):
    model = zoo.get(name)
    shapes = model.dynamic_shapes()
    assert len(shapes) == len(model.inputs)
    dims = [spec[0] for spec in shapes]
    assert all(list(spec) == [0] for spec in shapes)
    assert all(dim is dims[0] for dim in dims)  # one shared batch symbol


@pytest.mark.parametrize("name", ALL_NAMES)
def test_example_inputs_satisfy_the_specs(name):
    model = zoo.get(name)
    inputs = model.example_inputs(batch=3)
    assert len(inputs) == len(model.inputs)
    for spec, x in zip(model.inputs, inputs):
        assert x.shape == (3, *spec.shape) and x.dtype == spec.dtype
        assert spec.check(x.numpy()) is None
    again = model.example_inputs(batch=3)
    assert all(torch.equal(a, b) for a, b in zip(inputs, again))


# ---- building and running every model (module-scoped: one build shared per model)


@pytest.fixture(scope="module", params=ALL_NAMES)
def built(request):
    return zoo.get(request.param), zoo.get(request.param).build()


def test_build_is_deterministic(built):
    entry, model = built
    other = entry.build()
    ours, theirs = model.state_dict(), other.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_build_follows_the_seed():
    """A builder that ignored torch's seed would be deterministic by accident only."""
    entry = zoo.get("deepfm")  # the cheapest build; the others draw from the same RNG
    a, b = entry.build(seed=0).state_dict(), entry.build(seed=1).state_dict()
    assert not torch.equal(a["embeddings.0.weight"], b["embeddings.0.weight"])


def test_build_is_in_eval_mode(built):
    _, model = built
    assert not any(m.training for m in model.modules())


def test_forward_matches_the_output_spec(built):
    entry, model = built
    with torch.no_grad():
        out = model(*entry.example_inputs(batch=1))
    assert isinstance(out, torch.Tensor)
    assert out.shape == (1, *entry.outputs[0].shape)
    assert out.dtype == entry.outputs[0].dtype
    assert torch.isfinite(out).all()


def test_output_depends_on_the_input(built):
    """The eager model is the oracle of every equality test; an output that
    ignored its input (as randomly initialised CNNs with uncalibrated
    BatchNorm do) would let any wrong answer pass."""
    entry, model = built
    with torch.no_grad():
        out = model(*entry.example_inputs(batch=2, seed=11))
    assert (out[0] - out[1]).abs().max() > 0.05 * out.abs().max()


def test_batchnorm_statistics_are_calibrated():
    model = zoo.get("googlenet").build()
    norm = model.conv1.bn
    assert not torch.equal(norm.running_var, torch.ones_like(norm.running_var))
    assert norm.momentum == 0.1 and not norm.training


# ---- DeepFM structure


def test_deepfm_has_one_embedding_table_per_field():
    model = DeepFM()
    sizes = tuple(table.num_embeddings for table in model.embeddings)
    assert sizes == CRITEO_VOCAB_SIZES == SPARSE.upper_bounds
    assert len(sizes) == 26 and max(sizes) <= 100_000
    assert all(table.embedding_dim == 16 for table in model.embeddings)


def test_deepfm_output_is_a_probability():
    entry = zoo.get("deepfm")
    with torch.no_grad():
        out = DeepFM()(*entry.example_inputs(batch=8))
    assert out.shape == (8, 1) and ((out > 0) & (out < 1)).all()


# ---- TensorSpec.random and TensorSpec.check


def test_random_respects_per_field_upper_bounds():
    ids = SPARSE.random(4000, torch.Generator().manual_seed(0))
    assert ids.dtype == torch.int64 and ids.shape == (4000, 26)
    bounds = torch.tensor(CRITEO_VOCAB_SIZES)
    assert (ids >= 0).all() and (ids < bounds).all()
    # Small fields are covered fully (vocab 3 and 4 at positions 8 and 19).
    assert set(ids[:, 8].tolist()) == {0, 1, 2}
    assert set(ids[:, 19].tolist()) == {0, 1, 2, 3}


def test_random_respects_value_range():
    ids = INPUT_IDS.random(64, torch.Generator().manual_seed(0))
    assert ids.min() >= 0 and ids.max() < 30522
    mask = _spec("bert", "attention_mask").random(64)
    assert set(mask.unique().tolist()) == {0, 1}


@pytest.mark.gpu
def test_random_draws_on_the_gpu_within_the_same_bounds():
    device = torch.device("cuda")
    ids = SPARSE.random(4000, device=device)
    assert ids.device.type == "cuda" and ids.dtype == torch.int64 and ids.shape == (4000, 26)
    assert SPARSE.check(ids) is None and set(ids[:, 8].tolist()) == {0, 1, 2}
    words = INPUT_IDS.random(64, device=device)
    assert words.is_cuda and 0 <= words.min() and words.max() < 30522
    image = _spec("nasnet", "image").random(2, device=device)
    assert image.is_cuda and image.shape[0] == 2 and image.dtype == torch.float32


def test_check_flags_an_id_beyond_its_fields_vocabulary():
    ids = SPARSE.random(4, torch.Generator().manual_seed(0)).numpy()
    assert SPARSE.check(ids) is None
    ids[2, 8] = 3  # field 8 has 3 ids, 3 is one past the end (but valid for other fields)
    problem = SPARSE.check(ids)
    assert problem is not None and "\n" not in problem
    assert "'sparse'" in problem and "position 8" in problem and "value 3" in problem
    assert "batch item 2" in problem and "[0, 3)" in problem


def test_check_flags_negative_ids_and_counts_the_rest():
    ids = np.zeros((2, 26), dtype=np.int64)
    ids[0, 5] = -1
    ids[1, 7] = 10**9
    problem = SPARSE.check(ids)
    assert "position 5" in problem and "value -1" in problem and "1 more" in problem


def test_check_token_ids_and_masks():
    ids = np.full((2, 128), 30521, dtype=np.int64)
    assert INPUT_IDS.check(ids) is None
    ids[1, 17] = 30522
    problem = INPUT_IDS.check(ids)
    assert "'input_ids'" in problem and "position 17" in problem and "value 30522" in problem
    mask = np.ones((1, 128), dtype=np.int64)
    mask[0, 0] = 2
    assert "'attention_mask'" in _spec("bert", "attention_mask").check(mask)


def test_check_accepts_any_float_and_torch_tensors():
    image = zoo.get("resnet50").inputs[0]
    assert image.check(np.full((1, 3, 224, 224), np.nan, dtype=np.float32)) is None
    assert SPARSE.check(torch.zeros(3, 26, dtype=torch.int64)) is None


def test_check_reports_a_shape_it_cannot_range_check():
    problem = SPARSE.check(np.zeros((2, 25), dtype=np.int64))
    assert "'sparse'" in problem and "shape" in problem


@settings(max_examples=60, deadline=None)
@given(position=st.integers(0, 25), value=st.integers(-(2**40), 2**40))
def test_check_agrees_with_the_bounds(position, value):
    ids = np.zeros((1, 26), dtype=np.int64)
    ids[0, position] = value
    valid = 0 <= value < CRITEO_VOCAB_SIZES[position]
    assert (SPARSE.check(ids) is None) == valid


def test_upper_bounds_must_match_the_last_axis():
    with pytest.raises(ValueError):
        zoo.TensorSpec("ids", torch.int64, (3,), value_range=(0, 10), upper_bounds=(5, 5))
    with pytest.raises(ValueError):
        zoo.TensorSpec("x", torch.float32, (2,), upper_bounds=(5, 5))


def test_at_fixes_every_variable_axis_of_inputs_and_outputs():
    t5 = zoo.get("t5").at((40, 7))
    assert [s.shape for s in t5.inputs] == [(40,), (40,), (7,)]
    assert [s.shape for s in t5.outputs] == [(7, 512)]
    assert t5.inputs[0].value_range == zoo.get("t5").inputs[0].value_range
    assert zoo.get("bert").at((3,)).outputs[0].shape == (3, 768)
    assert zoo.get("googlenet").at(()) == zoo.get("googlenet")
    with pytest.raises(ValueError, match="2 variable axes"):
        zoo.get("t5").at((40,))
