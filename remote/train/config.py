"""The configs of the train stage's steps: vocab, train, export (standard library only, so the
controller imports them)."""
from __future__ import annotations

from dataclasses import dataclass, field

EXPORT_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True, kw_only=True)
class VocabConfig:
    data: str  # the prepare step's folder or its data.parquet
    out_dir: str  # where vocab.safetensors and manifest.json go (through out_dir.partial)
    target: str = ""  # the target's folder (config.json gives the vocabulary size); or set target_vocab_size
    target_vocab_size: int = 0  # rows of the target's embedding; 0: read from target/config.json
    draft_vocab_size: int = 32000  # N: the most frequent loss tokens kept

    def __post_init__(self):
        if self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size}: must be at least 1")
        if not self.target and self.target_vocab_size < 1:
            raise ValueError("give target (a model folder) or target_vocab_size")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    capture_dir: str  # a finished capture step folder (remote.capture.store format)
    vocab_dir: str  # a finished vocab step folder (vocab.safetensors)
    out_dir: str  # where the trained draft goes (through out_dir.partial, which also holds checkpoints)
    target: str = ""  # the target's folder (config.json, embedding, lm_head, final norm); "": the capture's
    ttt_steps: int = 7  # unrolled training-time-test steps
    step_decay: float = 0.8  # loss weight of step k is step_decay**k
    token_budget: int = 8192  # tokens in one micro-batch of one rank (samples packed, longer ones cut)
    grad_accum: int = 1  # micro-batches per rank per optimizer step
    epochs: float = 1.0  # passes over the train split, fractions allowed (ignored when max_steps > 0)
    max_steps: int = 0  # optimizer steps; 0: as many as the epochs give
    lr: float = 1e-4  # peak learning rate of AdamW
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 0  # linear warmup steps
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas
    grad_clip: float = 0.5  # max global gradient norm; 0: no clipping
    checkpoint_every: int = 500  # optimizer steps between checkpoints (one is always written at the end)
    keep_checkpoints: int = 1  # how many of the newest checkpoints survive
    seed: int = 0  # draft initialisation and the data order
    device: str = "auto"  # "auto" (cuda when there is one), "cuda" or "cpu"
    compile: str = "auto"  # "auto" (on cuda), "yes" or "no": torch.compile the dense layer parts and flex attention
    pad_multiple: int = 0  # pad each micro-batch to a multiple of this (0: token_budget when compiled, else 1)
    train_lm_head: bool = True  # train the draft lm_head (False: keep the target's rows frozen)
    init_lm_head_from_target: bool = True  # start lm_head from the target's rows of the draft vocabulary
    drop_outside_top1: bool = True  # drop positions whose target top-1 is outside the draft vocabulary
    draft_overrides: dict = field(default_factory=dict)  # DraftConfig fields that differ from the target's
    warm_start: str = ""  # an exported draft folder (remote.train.export) to start from; lm_head rows mapped by token
    nproc_per_node: int = 1  # processes on this host (GPUs, or gloo processes on a CPU)
    nnodes: int = 1  # hosts in the job
    node_rank: int = 0  # this host's index (0 runs the rendezvous when rdzv_endpoint is empty)
    rdzv_endpoint: str = ""  # host:port of the rendezvous for nnodes > 1
    local_addr: str = ""  # this host's address as the other hosts reach it (torchrun --local-addr); "": its hostname
    log_every: int = 1  # emit a train event every this many steps

    def __post_init__(self):
        if self.epochs <= 0:
            raise ValueError(f"epochs={self.epochs}: must be positive")
        for name in ("ttt_steps", "token_budget", "grad_accum", "checkpoint_every", "keep_checkpoints",
                     "nproc_per_node", "nnodes", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device={self.device!r}: choose auto, cuda or cpu")
        if self.compile not in ("auto", "yes", "no"):
            raise ValueError(f"compile={self.compile!r}: choose auto, yes or no")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"nnodes={self.nnodes} needs rdzv_endpoint (host:port of node 0)")
        object.__setattr__(self, "betas", tuple(self.betas))


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    train_dir: str  # a finished train step folder
    vocab_dir: str  # the vocab step folder the draft was trained with (d2t, t2d)
    out_dir: str  # the exported draft (through out_dir.partial)
    dtype: str = "bfloat16"  # weight dtype of the export
    name: str = ""  # a name for the model card; "": the folder's name

    def __post_init__(self):
        if self.dtype not in EXPORT_DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {sorted(EXPORT_DTYPES)}")
