"""User weights: state_dicts (weights_only) and torch.export archives, served for real."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch
import tritonclient.http as httpclient
from conftest import server_config
from serving import assert_close, example, infer, served_precision, served_tolerance

from opara_core import zoo
from opara_core.engine import precision
from opara_core.serving.launcher import REPO_ROOT, TritonServer
from opara_core.engine.trace_cache import named_tensors
from opara_core.serving.weights import WeightsError, load_module, seeded_module, weights_path

SCRIPT = REPO_ROOT / "scripts" / "export_weights.py"


def export(model: str, version_dir, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), model, str(version_dir), *args], capture_output=True, text=True, check=True
    )
    return result.stdout


def test_a_state_dict_replaces_the_seeded_weights(tmp_path):
    export("deepfm", tmp_path, "--seed", "7", "--format", "state_dict")
    entry = zoo.get("deepfm")
    module = load_module(entry, weights_path(tmp_path, "weights.pt"))
    seeded_7 = entry.build(seed=7)
    assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), seeded_7.state_dict().values()))
    assert not torch.equal(module.state_dict()["embeddings.0.weight"], entry.build().state_dict()["embeddings.0.weight"])


def test_a_pickle_that_runs_code_is_refused(tmp_path):
    class Exploit:
        def __reduce__(self):
            return (print, ("this would have run",))

    (tmp_path / "weights.pt").write_bytes(pickle.dumps({"weight": Exploit()}))
    with pytest.raises(WeightsError, match="refusing weights.pt"):
        load_module(zoo.get("deepfm"), weights_path(tmp_path, "weights.pt"))


def test_weights_that_do_not_fit_the_model_are_refused(tmp_path):
    torch.save({"not_a_layer.weight": torch.zeros(3)}, tmp_path / "weights.pt")
    with pytest.raises(WeightsError, match="does not fit deepfm"):
        load_module(zoo.get("deepfm"), weights_path(tmp_path, "weights.pt"))


def test_weights_must_lie_inside_the_version_directory(tmp_path):
    (tmp_path / "outside.pt").write_bytes(b"")
    (tmp_path / "1").mkdir()
    with pytest.raises(WeightsError, match="inside the version directory"):
        weights_path(tmp_path / "1", "../outside.pt")
    with pytest.raises(WeightsError, match="does not exist"):
        weights_path(tmp_path / "1", "missing.pt")


def test_an_exported_archive_is_served_as_is(tmp_path):
    stdout = export("deepfm", tmp_path, "--seed", "5")
    assert 'string_value: "weights.pt2"' in stdout
    module = load_module(zoo.get("deepfm"), weights_path(tmp_path, "weights.pt2"))
    arrays = example("deepfm", 3, seed=2)
    with torch.inference_mode():
        got = module(*(torch.from_numpy(a) for a in arrays)).numpy()
        want = zoo.get("deepfm").build(seed=5)(*(torch.from_numpy(a) for a in arrays)).numpy()
    assert_close(got, want)


@pytest.mark.server
def test_the_server_serves_exported_weights(tmp_path):
    """A repository whose googlenet has a state_dict and whose deepfm has an
    export archive: both answer with their weights' outputs, not the seed's."""
    repository = tmp_path / "models"
    for model, args in (("googlenet", ("--seed", "3", "--format", "state_dict")), ("deepfm", ("--seed", "4"))):
        source = REPO_ROOT / "model_repository" / model
        (repository / model / "1").mkdir(parents=True)
        (repository / model / "1" / "model.py").write_text((source / "1" / "model.py").read_text())
        stdout = export(model, repository / model / "1", *args)
        parameter = stdout.strip().splitlines()[-1]
        (repository / model / "config.pbtxt").write_text((source / "config.pbtxt").read_text() + parameter + "\n")
    with TritonServer(server_config(repository), tmp_path / "server.log") as server:
        client = httpclient.InferenceServerClient(server.http_url)
        try:
            for model, seed in (("googlenet", 3), ("deepfm", 4)):
                arrays = example(model, 2, seed=9)
                entry = zoo.get(model)
                module = precision.cast(entry.build(seed=seed), entry, served_precision(model))  # the weights' oracle
                with torch.inference_mode():
                    expected = module(*(torch.from_numpy(a) for a in arrays)).numpy()
                assert_close(infer(client, model, arrays), expected, served_tolerance(model))
        finally:
            client.close()


@pytest.mark.parametrize("name", ["deepfm", "bert", "t5"])
def test_seeded_weights_from_the_cache_are_the_seeded_weights(name, tmp_path):
    """BERT has non-persistent buffers, T5 an embedding shared by its encoder
    and decoder: the second start maps the first one's file in, and the module
    is the seeded one, tensor for tensor and answer for answer."""
    entry = zoo.get(name)
    want = entry.build()
    seeded_module(entry, tmp_path)
    (saved,) = tmp_path.glob(f"{name}-*.pt")
    got = seeded_module(entry, tmp_path)
    assert not any(t.is_meta for _, t in named_tensors(got)) and not got.training
    assert got.state_dict().keys() == want.state_dict().keys()
    for key, tensor in want.state_dict().items():
        assert torch.equal(got.state_dict()[key], tensor), key
    x = entry.example_inputs(2, seed=3)
    with torch.inference_mode():
        torch.testing.assert_close(got(*x), want(*x), rtol=0, atol=0)
    saved.write_bytes(b"damaged")  # drawn again, and saved again
    torch.testing.assert_close(seeded_module(entry, tmp_path).state_dict(), want.state_dict(), rtol=0, atol=0)
    assert saved.stat().st_size > 100


def test_a_module_that_cannot_be_built_on_meta_is_drawn_as_usual(tmp_path):
    def needs_real_tensors():
        module = torch.nn.Linear(3, 2)
        module.scale = float(module.weight.sum())  # reads a value: fails on the meta device
        return module

    entry = zoo.ZooModel(name="real", builder=needs_real_tensors, inputs=zoo.get("deepfm").inputs, outputs=zoo.get("deepfm").outputs)
    module = seeded_module(entry, tmp_path)
    assert not module.weight.is_meta and not list(tmp_path.iterdir())


def test_seeded_weights_that_cannot_be_saved_still_serve(tmp_path, monkeypatch):
    """A full disk (torch.save fails mid-file) leaves no partial file behind and
    the model its freshly drawn weights."""
    entry = zoo.get("deepfm")

    def full_disk(obj, handle, *args, **kwargs):
        handle.write(b"partial")
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(torch, "save", full_disk)
    module = seeded_module(entry, tmp_path)
    assert not list(tmp_path.iterdir())
    torch.testing.assert_close(module.state_dict(), entry.build().state_dict(), rtol=0, atol=0)
