"""What remote.train.train keeps apart from the training loop: processes, checkpoints, target weights.

    dist = Distributed.from_env("auto")          # torchrun's env (RANK, WORLD_SIZE...) or one process
    ckpt = Checkpoints(stage / "checkpoints", keep=1)
    ckpt.save(step, draft, opt, history, dist, config, best_step)   # config: the run's, as a dict
    ckpt.load_latest(draft, opt, dist, train_config, free=("log_every",))  # refuses another config by key
    ckpt.save_best(step, draft, dist); ckpt.best_weights(step)       # the best held-out weights, kept aside
    flags = Top1Flags(ckpt.root, key); flags.read(); flags.write("w003", {sample_id: flags})  # a run in windows
    embed, lm_head, norm = load_target_head_weights(target_dir, draft_config)
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as tdist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from remote.step import BadInput, with_defaults, write_json_atomic


CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo's flags of bf16 arithmetic in hardware


def cpu_info() -> tuple[str, set[str]]:
    """This CPU's model name and flags from /proc/cpuinfo (its first processor); ("", set()) where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", set()
    field = lambda key: next((ln.split(":", 1)[1].strip() for ln in text.splitlines()  # noqa: E731
                              if ln.split(":", 1)[0].strip() == key and ":" in ln), "")
    return field("model name"), set(field("flags").split())


def cpu_bf16_matmuls() -> bool:
    """Whether this CPU does bf16 arithmetic in hardware (amx_bf16 or avx512_bf16). The demo's train step took 0.74x
    the float32 time in bf16 on a 2-core Xeon with AMX (bench/results/precision-cpu-amx-20261205.json; a bf16 matmul
    of the draft's shapes 7-9x the float32 rate) and ran 1.3x the float32 tokens/s on an EPYC with avx512_bf16
    (cpu-precision-demo-20261205.json); without either, bf16 is emulated."""
    return any(f in cpu_info()[1] for f in CPU_BF16_FLAGS)


@dataclass
class Distributed:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    local_world: int = 1  # processes on this host; several hosts: each host trains on its own capture
    node_group: object = None  # the process group of this host's ranks (several hosts only)

    @classmethod
    def from_env(cls, device: str = "auto") -> "Distributed":
        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if device == "cuda" and not torch.cuda.is_available():
            raise BadInput("device=cuda but torch sees no GPU")
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if use_cuda:
            torch.cuda.set_device(local_rank)
            dev = torch.device("cuda", local_rank)
        else:
            dev = torch.device("cpu")
            if local_world > 1:  # gloo processes on one CPU: share the cores instead of oversubscribing
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        if world > 1 and not tdist.is_initialized():
            tdist.init_process_group("nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None)
        node_group = None
        if local_world < world:  # torchrun numbers each host's ranks contiguously
            node_group, _ = tdist.new_subgroups(group_size=local_world)
        return cls(rank, world, local_rank, dev, local_world, node_group)

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.world == 1:
            return module
        from torch.nn.parallel import DistributedDataParallel

        # Frozen tensors (target head, embedding) are no buffers to sync; gradients are bucketed
        # and all-reduced while the backward still runs.
        return DistributedDataParallel(module, device_ids=[self.local_rank] if self.device.type == "cuda" else None,
                                       broadcast_buffers=False)

    def no_sync(self, model, last: bool):
        """Skip the gradient all-reduce on all but the last accumulated micro-batch."""
        return model.no_sync() if self.world > 1 and not last else contextlib.nullcontext()

    def all_reduce(self, t: torch.Tensor, op: str = "sum", node: bool = False) -> torch.Tensor:
        """Sum (or "min") over every rank, or over this host's ranks only (node=True)."""
        if (self.local_world if node else self.world) > 1:
            tdist.all_reduce(t, op=tdist.ReduceOp.MIN if op == "min" else tdist.ReduceOp.SUM,
                             group=self.node_group if node else None)
        return t

    def gather_objects(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        tdist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            tdist.barrier()

    def close(self) -> None:
        if self.world > 1 and tdist.is_initialized():
            tdist.destroy_process_group()


# ----------------------------------------------------------------------------- checkpoints
def _rng_state() -> dict:
    s = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["cuda"] = torch.cuda.get_rng_state()
    return s


def _set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])


def _fsync_tree(d: Path) -> None:
    for p in d.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpoints:
    """step-NNNNNNNN/ folders: model.safetensors, optimizer.pt, state.pt, meta.json (step, history, config);
    best-NNNNNNNN/model.safetensors: the weights of the best held-out evaluation so far.

    Written under a dot-name by each host's first rank (every host resumes from its own disk) and
    renamed when whole: a kill mid-save leaves the previous checkpoint as the newest one. A best
    folder is pruned only once a checkpoint names a later best, so the one a resume goes back to
    is still there; one newer than the checkpoint resumed from is dropped (drop_bests_after).
    """

    def __init__(self, root: Path, keep: int = 1):
        self.root, self.keep = Path(root), keep

    def _all(self, kind: str = "step") -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob(f"{kind}-*") if (p / "meta.json").is_file())

    def _write(self, name: str, dist: Distributed, files) -> Path:
        """On each host's first rank: files(tmp) fills a dot-named folder, renamed to `name` when whole."""
        final = self.root / name
        if dist.local_rank == 0:
            tmp = self.root / f".tmp-{name}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            files(tmp)
            _fsync_tree(tmp)
            shutil.rmtree(final, ignore_errors=True)  # a best of the same step written before a kill
            os.replace(tmp, final)
        return final

    def save(self, step: int, draft, opt, history: list[dict], dist: Distributed, config: dict,
             best_step: int | None = None) -> Path:
        rngs = dist.gather_objects(_rng_state())

        def files(tmp: Path) -> None:
            save_weights(draft, tmp)
            torch.save(opt.state_dict(), tmp / "optimizer.pt")
            torch.save({"rng": rngs}, tmp / "state.pt")
            write_json_atomic(tmp / "meta.json", {"step": step, "history": history, "config": config})

        final = self._write(f"step-{step:08d}", dist, files)
        if dist.local_rank == 0:
            for old in self._all()[:-self.keep] + [b for b in self._all("best") if _step_of(b) != best_step]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    def save_best(self, step: int, draft, dist: Distributed) -> Path:
        def files(tmp: Path) -> None:
            save_weights(draft, tmp)
            write_json_atomic(tmp / "meta.json", {"step": step})

        final = self._write(f"best-{step:08d}", dist, files)
        dist.barrier()
        return final

    def best_weights(self, step: int) -> Path:
        return self.root / f"best-{step:08d}" / "model.safetensors"

    def drop_bests_after(self, step: int, dist: Distributed) -> None:
        """Best weights kept aside after `step` (the checkpoint resumed from) belong to a run that was cut."""
        if dist.local_rank == 0:
            for b in self._all("best"):
                if _step_of(b) > step:
                    shutil.rmtree(b, ignore_errors=True)
        dist.barrier()

    def load_latest(self, draft, opt, dist: Distributed, config, free: tuple[str, ...] = ()) -> dict | None:
        """Restore the newest checkpoint; a checkpoint of another config (a dataclass: its keys outside `free`) is
        refused by name; one written before an option existed was trained at that option's default."""
        found = self._all()
        if not found:
            return None
        p = found[-1]
        meta = json.loads((p / "meta.json").read_text())
        _check_same_config(p, with_defaults(type(config), meta.get("config")), asdict(config), free)
        weights = load_file(str(p / "model.safetensors"), device=str(dist.device))
        missing, unexpected = draft.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not k.startswith("embed_tokens.")]
        if missing or unexpected:
            raise BadInput(f"checkpoint {p} does not fit this draft (missing {missing}, unexpected {unexpected}); "
                           "delete it or use the config it was trained with")
        opt.load_state_dict(torch.load(p / "optimizer.pt", map_location=dist.device, weights_only=False))
        state = torch.load(p / "state.pt", weights_only=False)
        if len(state["rng"]) == dist.world:
            _set_rng_state(state["rng"][dist.rank])
        return {"step": meta["step"], "history": meta["history"], "path": str(p)}


def _check_same_config(p: Path, saved: dict | None, config: dict, free: tuple[str, ...]) -> None:
    """A resumed run continues the same training: any other key that differs is named, with the fix."""
    if saved is None:
        raise BadInput(f"checkpoint {p} records no config (written by an older eaglet); delete {p.parent} "
                       "to train from scratch")
    config = json.loads(json.dumps(config))  # as the checkpoint stored it (tuples as lists)
    differ = sorted(k for k in set(saved) | set(config) if k not in free and saved.get(k) != config.get(k))
    if differ:
        shown = "; ".join(f"{k}: checkpoint {saved.get(k)!r}, now {config.get(k)!r}" for k in differ)
        raise BadInput(f"checkpoint {p} was trained with another config ({shown}); resume with the config it was "
                       f"trained with, or delete {p.parent} to train from scratch")


class Top1Flags:
    """The trainer's target top-1 check per sample (is the target's top-1 at each row a draft token), kept beside
    the checkpoints of a run in windows: a window writes the flags of the samples it checked (top1-NAME.safetensors),
    a later one (the next epoch's, whose capture takes its samples again, or one resumed after a kill) reads them
    instead of reading those samples' states and checking again: once a sample a run, as without windows. A file
    written under another `key` (what decides the flags: the run's config, the capture's layers and dtypes) is
    passed over."""

    def __init__(self, root: Path, key: dict):
        self.root, self.key = Path(root), json.loads(json.dumps(key))  # as a file's metadata gives it back

    def read(self) -> dict[str, torch.Tensor]:
        """Sample id -> its flags [length] (uint8), of every file written under this key."""
        out = {}
        for p in sorted(self.root.glob("top1-*.safetensors")):
            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata() or {}
                if json.loads(meta.get("key", "null")) != self.key:
                    continue
                flat = f.get_tensor("flags")
            out.update(zip(json.loads(meta["sample_ids"]), flat.split(json.loads(meta["lengths"]))))
        return out

    def write(self, name: str, flags: dict[str, torch.Tensor]) -> Path:
        """These samples' flags, under a dot-name renamed when whole (one rank a host writes)."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"top1-{name}.safetensors"
        tmp = self.root / f".{final.name}.tmp-{os.getpid()}"
        save_file({"flags": torch.cat([f.to(torch.uint8) for f in flags.values()])}, str(tmp),
                  metadata={"key": json.dumps(self.key), "sample_ids": json.dumps(list(flags)),
                            "lengths": json.dumps([len(f) for f in flags.values()])})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        return final


def save_weights(draft, folder: Path) -> None:
    save_file({k: v.detach().float().cpu().contiguous() for k, v in draft.trainable_state_dict().items()},
              str(folder / "model.safetensors"))


def _step_of(folder: Path) -> int:
    return int(folder.name.rsplit("-", 1)[1])


# ----------------------------------------------------------------------------- the target's weights
def _weight_files(target: Path) -> dict[str, Path]:
    """Tensor name -> file, from the safetensors index or by opening every shard."""
    idx = target / "model.safetensors.index.json"
    if idx.is_file():
        return {k: target / v for k, v in json.loads(idx.read_text())["weight_map"].items()}
    out = {}
    for f in sorted(target.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f for k in h.keys()})
    if not out:
        raise BadInput(f"target {target}: no safetensors weights")
    return out


def _pick(names, suffix: str) -> str | None:
    """The outermost text-model tensor ending with suffix (not a decoder layer's, not a vision tower's)."""
    c = [n for n in names if n.endswith(suffix) and ".layers." not in n and "vision" not in n
         and (suffix != "norm.weight" or n.endswith("model.norm.weight") or n == "norm.weight")]
    return min(c, key=len) if c else None


def load_target_head_weights(target: Path, dcfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(embedding [V, H], lm_head [V, H], final norm [H]) of the target; lm_head falls back to the
    embedding when the target ties them."""
    files = _weight_files(Path(target))
    names = {"embed": _pick(files, "embed_tokens.weight"), "lm_head": _pick(files, "lm_head.weight"),
             "norm": _pick(files, "norm.weight")}
    if names["lm_head"] is None:
        names["lm_head"] = names["embed"]  # tie_word_embeddings
    missing = [k for k, v in names.items() if v is None]
    if missing:
        raise BadInput(f"target {target}: no tensor for {missing} among its weights")
    out = {}
    for key, name in names.items():
        with safe_open(str(files[name]), framework="pt") as h:
            out[key] = h.get_tensor(name)
    v, hsz = dcfg.target_vocab_size, dcfg.hidden_size
    for key, shape in (("embed", (v, hsz)), ("lm_head", (v, hsz)), ("norm", (hsz,))):
        if tuple(out[key].shape) != shape:
            raise BadInput(f"target {target}: {names[key]} has shape {tuple(out[key].shape)}, expected {shape}")
    return out["embed"], out["lm_head"], out["norm"]
