"""Write a model's weights into a Triton version directory, for the `weights` parameter.

    python scripts/export_weights.py googlenet model_repository/googlenet/1 --pretrained
    python scripts/export_weights.py resnet50 /tmp/repo/resnet50/1 --seed 7 --format state_dict

--pretrained takes the real weights from torchvision, timm or the HuggingFace hub
(this needs network access to the hub, or its local cache); otherwise the zoo's
seeded initialisation with --seed is used. The default format, a torch.export
archive (weights.pt2), keeps the source model exactly as it is (for example
torchvision's input transform of pretrained GoogLeNet); `state_dict` writes the
zoo architecture's state_dict (weights.pt). The script prints the config.pbtxt
parameter that serves the file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from opara_core import zoo


def pretrained(name: str) -> torch.nn.Module:
    """The zoo architecture with its published weights."""
    if name in ("googlenet", "inception_v3", "resnet50"):
        import torchvision

        kwargs = {"aux_logits": False} if name != "resnet50" else {}
        return getattr(torchvision.models, name)(weights="DEFAULT", **kwargs)
    if name == "nasnet":
        import timm

        return timm.create_model("nasnetalarge", pretrained=True)
    if name == "bert":
        from transformers import BertModel

        from opara_core.models.hf import BertLastHiddenState

        return BertLastHiddenState(BertModel.from_pretrained("bert-base-uncased", add_pooling_layer=False, attn_implementation="sdpa"))
    if name == "t5":
        from transformers import T5Model

        from opara_core.models.hf import T5DecoderLastHiddenState

        return T5DecoderLastHiddenState(T5Model.from_pretrained("t5-small", use_cache=False))
    raise ValueError(f"{name} has no published weights; use --seed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help=f"one of {', '.join(zoo.names())}")
    parser.add_argument("version_dir", type=Path)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--pretrained", action="store_true")
    source.add_argument("--seed", type=int, default=zoo.SEED)
    parser.add_argument("--format", choices=("pt2", "state_dict"), default="pt2")
    args = parser.parse_args(argv)
    try:
        entry = zoo.get(args.model)
        module = (pretrained(args.model) if args.pretrained else entry.build(seed=args.seed)).eval()
    except (KeyError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    args.version_dir.mkdir(parents=True, exist_ok=True)
    if args.format == "state_dict":
        path = args.version_dir / "weights.pt"
        torch.save(module.state_dict(), path)
    else:
        path = args.version_dir / "weights.pt2"
        program = torch.export.export(module, entry.example_inputs(batch=2), dynamic_shapes=entry.dynamic_shapes())
        torch.export.save(program, str(path))
    print(f"wrote {path}; serve it with this in {args.model}'s config.pbtxt:")
    print(f'parameters {{ key: "weights" value: {{ string_value: "{path.name}" }} }}')
    return 0


if __name__ == "__main__":
    sys.exit(main())
