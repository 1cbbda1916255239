"""`jobgen export`: a finished run's model as a plain Hugging Face folder, for inference elsewhere.

The trainer saves OUTPUT_DIR/final (jobgen.train.trainer `_save_final`): for lora and qlora a peft
adapter (adapter_config.json, adapter_model.safetensors) beside the tokenizer, for full the whole
model. Exporting a LoRA adapter with `merge` loads its base model unquantized, adds each adapter's
B·A·alpha/r into the weights (peft's `merge_and_unload`) and saves the result: a folder that
`AutoModelForCausalLM.from_pretrained` loads without peft, as fast as the base at inference. A
Q-LoRA adapter merges the same way into the unquantized base: its adapters were trained against
4-bit weights, so the merged model differs from the 4-bit one it was trained on by the
quantization's rounding. Without `merge`, the adapter is copied with its base recorded where this
machine found it, so that peft loads it from anywhere.

Needs the train extra (torch, transformers, peft), imported only when an export runs.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from jobgen.errors import JobgenError, UserError
from jobgen.rundir import files as runfiles

ADAPTER_CONFIG = "adapter_config.json"
MODEL_CONFIG = "config.json"
FINAL = "final"
DTYPES = ("auto", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Source:
    """What to export: the final folder, its run's job (as the run directory keeps it), and the
    folder relative model paths of that job were read against."""

    final: Path
    job: dict[str, Any]
    workdir: Optional[Path]
    run_dir: Optional[Path]

    @property
    def is_adapter(self) -> bool:
        return (self.final / ADAPTER_CONFIG).is_file()


def find_source(target: Path) -> Source:
    """`target` is a run directory (RUN_DIR/job.yaml), an output folder (OUTPUT/final) or a final
    model folder itself; JobgenError naming what it is not."""
    from jobgen.rundir.metrics import output_dir
    from jobgen.rundir.run import RunDir

    target = target.resolve()
    if not target.is_dir():
        raise JobgenError(f"{target}: no such folder; give a run directory (runs/NAME), its output folder or OUTPUT/final")
    if (target / runfiles.JOB_FILE).is_file():
        run = RunDir(target)
        job = run.settings()
        final = output_dir(target, job) / FINAL
        if not final.is_dir():
            raise JobgenError(f"{final}: no final model yet: the run has not completed (`jobgen status {target}` says "
                              "where it stands); a checkpoint is not exported")
        return Source(final, job, _submit_folder(target, job), target)
    if (target / FINAL).is_dir():
        target = target / FINAL
    if (target / ADAPTER_CONFIG).is_file() or (target / MODEL_CONFIG).is_file():
        run_dir = target.parent.parent if (target.parent.parent / runfiles.JOB_FILE).is_file() else None
        job = _job_of(run_dir) if run_dir else {}
        return Source(target, job, _submit_folder(run_dir, job) if run_dir else None, run_dir)
    raise JobgenError(f"{target}: not a run directory ({runfiles.JOB_FILE}), an output folder ({FINAL}/) or a model "
                      f"folder ({ADAPTER_CONFIG} or {MODEL_CONFIG}); give runs/NAME or runs/NAME/output/final")


def export(source: Source, out: Path, merge: bool, base: Optional[str] = None, dtype: str = "auto") -> str:
    """Writes the exported model to `out` (made whole in a folder beside it, then renamed into
    place); returns one line saying what was written."""
    libraries = _import_libraries()
    torch, transformers = libraries["torch"], libraries["transformers"]
    temp = out.with_name(f".{out.name}.exporting")
    shutil.rmtree(temp, ignore_errors=True)
    try:
        if not source.is_adapter:  # a full fine-tune is a plain model already
            shutil.copytree(source.final, temp)
            what = "the fully fine-tuned model (no adapter to merge)" if merge else "the fully fine-tuned model"
        elif merge:
            base_ref = base or base_model(source)
            model = _load_base(transformers, torch, base_ref, source, dtype)
            from peft import PeftModel

            merged = PeftModel.from_pretrained(model, str(source.final)).merge_and_unload()
            merged.save_pretrained(str(temp), safe_serialization=True)
            what = f"{base_ref} with the adapter merged in"
        else:
            shutil.copytree(source.final, temp)
            base_ref = base or base_model(source)
            _record_base(temp / ADAPTER_CONFIG, base_ref)
            what = f"the adapter, for {base_ref} (peft loads it)"
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(source.final))
        tokenizer.save_pretrained(str(temp))
        with_the_users_umask(temp)
        if out.exists():
            shutil.rmtree(out)
        os.rename(temp, out)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return f"{what}: {out}"


def with_the_users_umask(folder: Path) -> None:
    """Every file and folder under `folder` with the modes a file the user makes gets (0644 and
    0755 under the usual umask 022): the run's files may have been written private (atomic writes
    through a temporary file are 0600), and an exported model is made to be shared and loaded."""
    mask = os.umask(0)
    os.umask(mask)
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def base_model(source: Source) -> str:
    """The base model the adapter was trained on, where this machine finds it: the run's
    training.model (relative paths against the folder the run was submitted from, then this
    one), else what the adapter records; a hub name as it is."""
    with open(source.final / ADAPTER_CONFIG) as config:
        recorded = json.load(config).get("base_model_name_or_path")
    named = (source.job.get("training") or {}).get("model") or recorded
    if not named:
        raise UserError(f"{source.final / ADAPTER_CONFIG} names no base model: give --base MODEL")
    candidates = [Path(named)] if os.path.isabs(named) else [
        *([source.workdir / named] if source.workdir else []), Path.cwd() / named]
    for candidate in candidates:
        if (candidate / MODEL_CONFIG).is_file():
            return str(candidate.resolve())
    if os.path.isabs(named) or named.startswith((".", "~")) or named.count("/") != 1:
        tried = ", ".join(str(c) for c in candidates)
        raise UserError(f"training.model {named}: no model folder ({MODEL_CONFIG}) at {tried}; give --base with where it is")
    return named  # a hub name: the Hugging Face cache, or the hub


def _load_base(transformers: Any, torch: Any, base_ref: str, source: Source, dtype: str) -> Any:
    """The base model, unquantized, on the CPU, at the commit the run trained on (a hub name)."""
    training = source.job.get("training") or {}
    revision = training.get("model_revision", "main")
    if source.run_dir is not None and training.get("model") == base_ref:
        from jobgen.rundir.model_pin import load_revision

        revision = load_revision(str(source.run_dir), base_ref, revision)  # the commit the run started with
    chosen = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    kwargs = {"torch_dtype": chosen, "trust_remote_code": bool(training.get("trust_remote_code"))}
    if not os.path.isdir(base_ref):
        kwargs["revision"] = revision
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(base_ref, **kwargs)
    except (OSError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"cannot load the base model {base_ref}: {first}; give --base with its folder or hub name") from None


def _record_base(config_path: Path, base_ref: str) -> None:
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = base_ref
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def _job_of(run_dir: Path) -> dict[str, Any]:
    from jobgen.rundir.run import RunDir

    return RunDir(run_dir).settings()


def _submit_folder(run_dir: Path, job: dict[str, Any]) -> Optional[Path]:
    """The folder the job's relative paths were read against: environment.workdir, else the folder
    `jobgen submit` ran in, which is the run directory less its run_dir (runs/NAME by default)."""
    workdir = (job.get("environment") or {}).get("workdir")
    if workdir:
        return Path(workdir)
    relative = Path(job.get("run_dir") or Path("runs") / str(job.get("name", "")))
    if relative.is_absolute() or len(relative.parts) >= len(run_dir.parts):
        return None
    if run_dir.parts[-len(relative.parts):] != relative.parts:
        return None
    return Path(*run_dir.parts[: -len(relative.parts)])


def _import_libraries() -> dict[str, Any]:
    """torch, transformers and peft; one line saying what to install where they are missing."""
    from jobgen.train.modeling import keep_bitsandbytes_out

    keep_bitsandbytes_out("lora")  # the base loads unquantized: bitsandbytes' import and its log lines are not needed
    try:
        import torch

        # peft's merge imports DeepSpeed through transformers; named, DeepSpeed's accelerator is
        # not guessed aloud ("Setting accelerator to CPU ...", a warning about nothing exported).
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        import transformers
        import peft  # noqa: F401  # merge_and_unload
    except ImportError as error:
        raise JobgenError(f"jobgen export needs the training side ({error.name} is not installed): install torch for "
                          "your machine, then pip install 'jobgen[train]'") from None
    # Their notices and progress bars are about loading, not about the export: one line says what was written.
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    return {"torch": torch, "transformers": transformers}
