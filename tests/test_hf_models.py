"""serving.hf_models: Hugging Face checkpoints (config.json + safetensors)
described and loaded from their own configuration; add-model --hf and what it
refuses. The served path over the real server is in test_user_models."""

from __future__ import annotations

import pytest
import torch
from test_user_models import read_config, tiny_bert

from opara_core.__main__ import main
from opara_core.serving import model_dir
from opara_core.serving.add_model import add_model
from opara_core.serving.hf_models import checkpoint_spec, read_checkpoint_config
from opara_core.serving.user_models import ModelFileError


def test_a_checkpoint_is_described_by_its_own_vocabulary_limit_and_hidden_size(tmp_path):
    tiny_bert(tmp_path / "bert")
    spec = checkpoint_spec("b", read_checkpoint_config(tmp_path / "bert"))
    assert [(t.name, t.value_range) for t in spec.inputs] == [("input_ids", (0, 1000)), ("attention_mask", (0, 2))]
    assert spec.outputs[0].shape[-1] == 64 and [(a.name, a.limit) for a in spec.lengths] == [("sequence", 64)]
    from transformers import RobertaConfig, RobertaModel

    # RoBERTa counts positions from padding_idx + 1: 66 positions, pad 1 -> 64 tokens
    RobertaModel(RobertaConfig(vocab_size=500, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                               max_position_embeddings=66, pad_token_id=1)).save_pretrained(tmp_path / "roberta")
    spec = checkpoint_spec("r", read_checkpoint_config(tmp_path / "roberta"))
    assert spec.lengths[0].limit == 64 and spec.inputs[0].value_range == (0, 500) and spec.outputs[0].shape[-1] == 32


def test_a_t5_checkpoint_gets_an_encoder_and_a_decoder_axis_and_answers_as_eager(tmp_path):
    from transformers import T5Config, T5Model

    torch.manual_seed(3)
    config = T5Config(vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4, n_positions=96)
    eager = T5Model(config).eval()
    eager.save_pretrained(tmp_path / "t5")
    written = add_model("t5tiny", tmp_path / "repo", hf=tmp_path / "t5")
    assert {"config.json", "model.safetensors", "model.py", "config.pbtxt"} <= {p.name for p in written}
    pbtxt = read_config(tmp_path / "repo" / "t5tiny" / "config.pbtxt")
    assert [(t["name"], [int(d) for d in t["dims"]], t.get("allow_ragged_batch")) for t in pbtxt["input"]] == [
        ("input_ids", [-1], True), ("attention_mask", [-1], True), ("decoder_input_ids", [-1], True)]
    assert pbtxt["parameters"]["max_length.decoder_input_ids"]["string_value"] == "96"
    spec, module = model_dir.load(tmp_path / "repo" / "t5tiny")
    assert [(a.name, a.inputs, a.limit) for a in spec.lengths] == [("encoder", ("input_ids", "attention_mask"), 96), ("decoder", ("decoder_input_ids",), 96)]
    ids, decoder = torch.randint(0, 300, (2, 11)), torch.randint(0, 300, (2, 5))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        want = eager(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder, use_cache=False).last_hidden_state
        torch.testing.assert_close(module(ids, mask, decoder), want)


def test_a_config_pbtxt_that_disagrees_with_its_checkpoint_is_a_load_error_naming_the_parameter(tmp_path):
    tiny_bert(tmp_path / "bert")
    add_model("b", tmp_path / "repo", hf=tmp_path / "bert")
    path = tmp_path / "repo" / "b" / "config.pbtxt"
    path.write_text(path.read_text().replace('string_value: "0,1000"', 'string_value: "0,2000"'))
    with pytest.raises(ValueError, match="value_range.input_ids"):
        model_dir.load(tmp_path / "repo" / "b")


@pytest.mark.parametrize("layout, message", [
    ("no config", "holds no config.json"),
    ("pickled weights", "pytorch_model.bin (a pickle, which could run code)"),
    ("architecture", "architecture 'gpt2' is not served here"),
    ("model.py", "its model.py would take the place of the adapter's"),
])
def test_what_add_model_refuses_of_a_checkpoint_is_one_clear_line(tmp_path, capsys, layout, message):
    checkpoint = tmp_path / "ckpt"
    if layout == "architecture":
        from transformers import GPT2Config, GPT2Model

        GPT2Model(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100, n_positions=32)).save_pretrained(checkpoint)
    elif layout != "no config":
        tiny_bert(checkpoint)
        if layout == "pickled weights":
            (checkpoint / "model.safetensors").rename(checkpoint / "pytorch_model.bin")
        else:
            (checkpoint / "model.py").write_text("")
    else:
        checkpoint.mkdir()
    with pytest.raises(ModelFileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        add_model("m", tmp_path / "repo", hf=checkpoint)
    capsys.readouterr()  # what saving the checkpoint printed
    assert main(["add-model", "m", "--repository", str(tmp_path / "repo"), "--hf", str(checkpoint)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.gpu
def test_on_a_gpu_a_checkpoint_builds_its_whole_model_graphs_and_answers_each_length_as_eager(tmp_path, monkeypatch):
    """The served GPU path of a checkpoint of no zoo size: the whole-model
    Inductor artifact captured per shape, mixed lengths batched by the DP
    scheduler, each row against the eager checkpoint."""
    from opara_core.engine.build import EngineSettings
    from opara_core.engine.whole_model import WholeModelSaved
    from opara_core.serving.varlen import VarLenRunners, VarLenSettings, check_request

    monkeypatch.setenv("OPARA_CACHE_DIR", str(tmp_path / "cache"))
    eager = tiny_bert(tmp_path / "bert")
    add_model("tiny", tmp_path / "repo", hf=tmp_path / "bert")
    spec, module = model_dir.load(tmp_path / "repo" / "tiny")
    device = torch.device("cuda")
    runners = VarLenRunners(module.to(device), spec, device, EngineSettings(buckets=(1, 2, 4)), VarLenSettings(((16, 64),), capture="load"))
    assert runners.info.kind == "cuda-graph" and set(runners.report.choices.values()) == {WholeModelSaved.label}, runners.report.summary()
    requests = []
    for k, length in enumerate((3, 64, 17, 40)):
        ids = torch.randint(0, 1000, (1, length), generator=torch.Generator().manual_seed(k))
        requests.append(check_request(spec, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, "dp"))
    with torch.inference_mode():
        expected = [eager(*r.tensors) for r in requests]
    for answer, want in zip(runners.run(requests), expected):
        assert answer[0].shape == want.shape
        torch.testing.assert_close(answer[0].cpu(), want, rtol=2e-2, atol=2e-2)  # TF32 matrix products on the GPU
