"""The exported draft folder, the one format every kind is served in: its one writer and its one reader.

    write_folder(out, kind.export_config(cfg, dtype, engines), export_tensors(kind, weights, cfg, vocab, dtype, out))
    folder = read_folder(out)         # config.json and the tensors' shapes (headers only); BadInput names what is wrong
    folder.kind                       # its DraftKind, by config.json's architectures (BadInput: no registered kind)
    folder.draft_config()             # the kind's config, read back from config.json
    folder.weights()                  # every tensor: the draft's weights by its own names, d2t and t2d
    read_weights(folder_or_train_dir, where)   # the tensors alone (a warm start also takes a train step's folder)

config.json is what the serving engine reads (remote.draft.<kind> writes it); model.safetensors holds the draft's
weights under the engine's names in the export dtype, `d2t` [n] int64 (target id = draft id + d2t[draft id]) and
`t2d` [V] bool; never the target's embedding (the engines share the target's). The export step
(remote.train.export), the evaluate step (offline and online) and the trainer's warm start read it here.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from remote.draft.registry import DraftKind, kind_of_export
from remote.draft.vocab import DraftVocab
from remote.step import BadInput, write_json_atomic

CONFIG, WEIGHTS = "config.json", "model.safetensors"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}  # the export's dtypes


@dataclass(frozen=True)
class DraftFolder:
    path: str
    config: dict  # its config.json
    tensors: dict[str, tuple[int, ...]]  # weight name -> shape (read from the safetensors headers)

    @property
    def kind(self) -> DraftKind:
        return kind_of_export(self.config, f"draft {self.path}")

    def draft_config(self):
        """The kind's config of this folder, read back from config.json."""
        return self.kind.config_from_export(self.config)

    def weights(self) -> dict[str, torch.Tensor]:
        return read_weights(self.path, f"draft {self.path}")


def read_folder(draft_dir: str | os.PathLike) -> DraftFolder:
    from safetensors import safe_open

    d = Path(draft_dir)
    if not (d / CONFIG).is_file():
        raise BadInput(f"draft {d}: no config.json (not an exported draft folder)")
    try:
        cfg = json.loads((d / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise BadInput(f"draft {d}/config.json is not valid JSON: {e}") from e
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                shapes[k] = tuple(h.get_slice(k).get_shape())
    if not shapes:
        raise BadInput(f"draft {d}: no *.safetensors weights")
    return DraftFolder(str(d), cfg, shapes)


def read_weights(folder: str | os.PathLike, where: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's *.safetensors files; BadInput (`where`: no weights) when there is none."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise BadInput(f"{where}: no *.safetensors weights")
    weights = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def weight_names(kind: DraftKind, cfg) -> list[str]:
    """The tensors an exported draft of this config holds (d2t and t2d aside): the model's own names."""
    with torch.device("meta"):  # the names and nothing else: no memory for a large target's shapes
        return list(kind.model(cfg).trainable_state_dict())


def export_tensors(kind: DraftKind, w: dict, cfg, vocab: DraftVocab, dtype: torch.dtype, where) -> dict:
    """The exported tensors: the draft's weights under its own names (the engines' names) in dtype, d2t and t2d."""
    names = weight_names(kind, cfg)
    missing = [k for k in names if k not in w]
    if missing:
        raise BadInput(f"{where}: draft weights lack {missing}")
    tensors = {k: w[k].to(dtype).contiguous() for k in names}
    tensors["d2t"] = vocab.d2t.to(torch.int64).contiguous()
    tensors["t2d"] = vocab.t2d.to(torch.bool).contiguous()
    return tensors


def write_folder(out: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """model.safetensors and config.json into out (the export step's staging folder)."""
    from safetensors.torch import save_file

    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    write_json_atomic(out / CONFIG, config)


def load_model(folder: DraftFolder, cfg, embed: torch.Tensor, dtype: torch.dtype):
    """(the exported draft as its kind's model of config cfg (folder.draft_config()), with the target's embedding
    `embed` in dtype, frozen; t2d [V] bool)."""
    weights = folder.weights()
    weights.pop("d2t")  # offline guesses are compared in draft ids; t2d maps the target's
    t2d = weights.pop("t2d").bool()
    draft = folder.kind.model(cfg)
    missing, unexpected = draft.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    if set(missing) != {"embed_tokens.weight"} or unexpected:
        raise BadInput(f"draft {folder.path}: weights missing {sorted(set(missing) - {'embed_tokens.weight'})}, "
                       f"unexpected {sorted(unexpected)}")
    draft.embed_tokens.weight = torch.nn.Parameter(embed.to(dtype), requires_grad=False)
    return draft, t2d
