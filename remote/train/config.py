"""The configs of the train stage's steps: vocab, train, export (standard library only, so the
controller imports them; remote/config.py says how a config is checked)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from remote.config import Checked, ConfigError, bounded

# The block drafters among train.draft's kinds, each with its model's first drafted slot (first_slot; a test checks
# they agree): served with num_speculative_tokens = block_size - first_slot. Torch-free, for the controller.
BLOCK_FIRST_SLOT = {"dflash": 1, "dspark": 0}


@dataclass(frozen=True, kw_only=True)
class VocabOptions(Checked):
    draft_vocab_size: int = bounded(32000, ge=1)
    """tokens of the draft's vocabulary, the most frequent loss tokens (fewer when the data has fewer)"""


@dataclass(frozen=True, kw_only=True)
class VocabConfig(VocabOptions):
    data: str
    """the prepare step's folder or its data.parquet"""
    out_dir: str
    """where vocab.safetensors and manifest.json go (through out_dir.partial)"""
    target: str = ""
    """the target's folder (config.json gives the vocabulary size); or set target_vocab_size"""
    target_vocab_size: int = bounded(0, ge=0)
    """rows of the target's embedding; 0: read from target/config.json"""

    def __post_init__(self):
        super().__post_init__()
        if not self.target and self.target_vocab_size < 1:
            raise ConfigError("target: give a model folder, or target_vocab_size")


@dataclass(frozen=True, kw_only=True)
class TrainOptions(Checked):
    """How the draft is trained: the training-time-test objective, AdamW (or Muon for the matrices) on a decaying schedule, a
    budget from the data size, held-out acceptance measured during training and the best draft kept
    (docs/TRAINING.md has the measurements behind each default: ttt_steps 3, the lm_head frozen, Muon at lr 6e-3 won the
    ablation in bench/results/defaults-ablation-h100-20261207.json at k = 3 and k = 5; tests/test_defaults.py)."""

    # -- the draft and its objective
    draft: Literal["auto", "eagle3", "dflash", "eagle3_mla", "dspark"] = "auto"
    """the draft's kind (remote/draft/registry.py's KINDS; docs/TRAINING.md, "Choosing the draft"): auto, eagle3_mla
    for a target with MLA attention (DeepSeek-V3, Kimi-K2.5), else eagle3; eagle3, one Llama layer proposing a
    chain (vLLM method eagle3); dflash, block drafting (method dflash), its block_size (train.draft_overrides)
    served with eval.num_speculative_tokens = block_size - 1; eagle3_mla, the EAGLE-3 draft with a DeepSeek MLA
    layer (method eagle3, vLLM only); dspark, DFlash's block with every slot drafted and a Markov head (method
    dspark, vLLM's GPU runner only), served with num_speculative_tokens = block_size"""
    ttt_steps: int = bounded(3, ge=1)
    """training-time-test steps unrolled (dflash: the drafted slots of a block trained, at most block_size - 1)"""
    step_decay: float = bounded(1.0, gt=0)
    """loss weight of TTT step k is step_decay**k (1.0: every step alike)"""
    drop_outside_top1: bool = True
    """drop positions whose target top-1 is outside the draft vocabulary"""
    train_lm_head: bool = False
    """train the draft lm_head (false: keep the target's rows frozen)"""
    init_lm_head_from_target: bool = True
    """start lm_head from the target's rows of the draft vocabulary"""
    draft_overrides: dict = field(default_factory=dict)
    """DraftConfig fields that differ from the target's (e.g. norm_before_fc, norm_before_residual, norm_output)"""
    # -- the budget (the first that is set of: max_steps, train_tokens, epochs, auto_train_tokens)
    token_budget: int = bounded(8192, ge=16)
    """tokens packed in one micro-batch of one process (samples packed, longer ones cut)"""
    grad_accum: int = bounded(1, ge=1)
    """micro-batches per process per optimizer step"""
    max_steps: int = bounded(0, ge=0)
    """optimizer steps; 0: as many as the token budget or the epochs give"""
    train_tokens: int = bounded(0, ge=0)
    """tokens to train on, all processes and hosts together; 0: from epochs"""
    epochs: float = bounded(0.0, ge=0)
    """passes over the train split, fractions allowed; 0: auto_train_tokens' worth"""
    auto_train_tokens: int = bounded(25_000_000, ge=1)
    """with epochs 0: train on about this many tokens, at least 1 and at most 10 epochs"""
    max_seconds: float = bounded(0.0, ge=0)
    """a deadline, in seconds from the train step's start (loading, the top-1 check and compiling count): once
    the steps' pace is measured the budget above is cut to the steps that fit, and set again to what fits as their
    pace moves, never past the budget (the learning rate schedule follows); 0: none. Not with windows"""
    # -- the optimiser and its schedule
    optimizer: Literal["muon", "adamw"] = "muon"
    """muon: Muon for the draft's hidden weight matrices, AdamW for the rest; adamw: AdamW for all"""
    lr: float = bounded(6e-3, gt=0)
    """peak learning rate (AdamW; Muon's too unless muon_lr is set)"""
    muon_lr: float = bounded(0.0, ge=0)
    """peak learning rate of Muon (its update scaled to AdamW's RMS); 0: lr"""
    muon_momentum: float = bounded(0.95, ge=0, lt=1)
    """Muon's (Nesterov) momentum"""
    muon_weight_decay: float = bounded(0.1, ge=0)
    """Muon's decoupled weight decay"""
    weight_decay: float = bounded(0.01, ge=0)
    """AdamW's decoupled weight decay"""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas"""
    schedule: Literal["linear", "cosine"] = "linear"
    """after warmup the learning rate falls to lr * min_lr_ratio, linearly or as a cosine"""
    min_lr_ratio: float = bounded(0.0, ge=0, le=1)
    """where the schedule ends, as a share of the peak"""
    warmup: float = bounded(0.01, ge=0, lt=1)
    """linear warmup, as a share of the optimizer steps"""
    warmup_steps: int = bounded(0, ge=0)
    """linear warmup in steps; > 0 replaces warmup"""
    grad_clip: float = bounded(1.0, ge=0)
    """max global gradient norm; 0: no clipping"""
    # -- held-out evaluation, best checkpoint, early stop
    eval_every: int = bounded(0, ge=0)
    """optimizer steps between held-out acceptance measurements (and one at the end); 0: 20 over the run"""
    eval_tokens: int = bounded(65536, ge=0)
    """held-out tokens a measurement reads at most (all processes together); 0: no measurement"""
    eval_k: int = bounded(0, ge=0)
    """speculative tokens of the held-out acceptance length (at most ttt_steps: a larger one is refused); 0: ttt_steps,
    the chain the draft is trained to make"""
    patience: int = bounded(5, ge=0)
    """stop after this many held-out measurements without a better one; 0: never early"""
    # -- checkpoints, processes, devices
    checkpoint_every: int = bounded(200, ge=1)
    """optimizer steps between checkpoints (one is always written at the end)"""
    keep_checkpoints: int = bounded(1, ge=1)
    """how many of the newest checkpoints survive"""
    seed: int = 0
    """draft initialisation and the data order"""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """auto (cuda when there is one), cuda or cpu"""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """of the draft's forward: bf16 (autocast over float32 weights) or fp32; auto: bf16 on cuda, and on a CPU that
    does bf16 in hardware (amx_bf16 or avx512_bf16 in /proc/cpuinfo) for a draft of hidden size 256 or more; else fp32"""
    compile: Literal["auto", "yes", "no"] = "auto"
    """torch.compile the dense layer parts and flex attention: auto (on cuda), yes or no"""
    pad_multiple: int = bounded(0, ge=0)
    """pad each micro-batch to a multiple of this (0: token_budget when compiled, else 1)"""
    warm_start: str = ""
    """a draft folder to start from (the nightly run's current draft); empty: from scratch"""
    nproc_per_node: int = bounded(1, ge=1)
    """training processes on each host (one a GPU, or gloo processes on a CPU)"""
    log_every: int = bounded(1, ge=1)
    """emit a train event every this many steps"""
    profile_steps: int = bounded(0, ge=0)
    """profile this many steps, from the third on, with max_seconds once the deadline's cut is made (torch.profiler:
    the ops by device time, then host time, into profile.txt, profile.rank<N>.txt beside it for other ranks); 0: none"""

    def __post_init__(self):
        super().__post_init__()
        if self.eval_k and self.eval_k > self.ttt_steps:
            raise ConfigError(f"eval_k={self.eval_k} > ttt_steps={self.ttt_steps}: the held-out acceptance length is "
                              "measured over the trained TTT steps; set eval_k <= ttt_steps")


@dataclass(frozen=True, kw_only=True)
class TrainConfig(TrainOptions):
    capture_dir: str
    """a finished capture step folder (remote.capture.store format)"""
    vocab_dir: str
    """a finished vocab step folder (vocab.safetensors)"""
    out_dir: str
    """where the trained draft goes (through out_dir.partial, which also holds checkpoints)"""
    target: str = ""
    """the target's folder (config.json, embedding, lm_head, final norm); "": the capture's"""
    nnodes: int = bounded(1, ge=1)
    """hosts in the job"""
    node_rank: int = bounded(0, ge=0)
    """this host's index (0 runs the rendezvous when rdzv_endpoint is empty)"""
    rdzv_endpoint: str = ""
    """host:port of the rendezvous for nnodes > 1"""
    local_addr: str = ""
    """this host's address as the other hosts reach it (torchrun --local-addr); "": its hostname"""
    windows: str = ""
    """a windows step folder (a run that captures in windows): train only window `window`'s steps of its plan,
    checkpoint at its end, and publish the draft only at the run's end; "": train on the whole capture"""
    window: int = bounded(0, ge=0)
    """the window of `windows` this step trains (its capture_dir holds that window's samples)"""
    checkpoint_dir: str = ""
    """where checkpoints are kept; "": <out_dir>.partial/checkpoints (the windows of a run share one)"""
    offline_only: bool = False
    """train a draft vLLM cannot serve beside this target (its kind's serving_problems), to measure it offline (a
    study: bench/quality_arms.json's MLA draft of a GQA target); False refuses one before any step runs"""

    def __post_init__(self):
        super().__post_init__()
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(f"rdzv_endpoint: nnodes={self.nnodes} needs host:port of node 0")


@dataclass(frozen=True, kw_only=True)
class WindowsConfig(Checked):
    dataset: str
    """the prepare step's data.parquet"""
    target: str
    """the target model folder (config.json: hidden size, layers, dtype)"""
    out_dir: str
    """where windows.json and the windows' sample lists go"""
    capture: dict
    """the capture options (remote.capture.config.CaptureOptions): the disk budget, storage dtype, layer ids, shards"""
    train: dict
    """the train options (TrainOptions): the budget in steps or epochs, the packing, processes and grad_accum"""


# The windows step's sample lists in its out_dir, which each capture of a windowed run takes (sample_ids).
HELDOUT_IDS = "heldout.ids.json"  # the held-out samples: captured once, kept for the whole run


def window_ids_file(window: int) -> str:
    """The file of window `window`'s samples: its train samples and the held-out ones."""
    return f"window-{window:03d}.ids.json"


@dataclass(frozen=True, kw_only=True)
class ExportConfig(Checked):
    train_dir: str
    """a finished train step folder"""
    vocab_dir: str
    """the vocab step folder the draft was trained with (d2t, t2d)"""
    out_dir: str
    """the exported draft (through out_dir.partial)"""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """weight dtype of the export"""
    name: str = ""
    """a name for the model card; "": the folder's name"""
    engines: list[str] = field(default_factory=list)
    """the engines the folder is written for: "vllm", and "sglang" when it should serve the draft too (each must
    run the draft as trained, or the export is refused naming what it lacks); empty: vLLM, and SGLang too when it
    can run this draft as trained (the model card says which)"""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.engines and ("vllm" not in self.engines or not set(self.engines) <= {"vllm", "sglang"}):
            raise ConfigError(f"engines: expected 'vllm' (eaglet evaluates the draft in it) and optionally 'sglang', "
                              f"got {self.engines!r}")
