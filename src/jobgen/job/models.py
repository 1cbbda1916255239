"""The typed job description: one source of truth for every scheduler, template and the trainer.

Everything a user can write in a job file is a field here. Unknown keys are errors (with a
suggestion, see `jobgen.job.layers`), values are checked where they are declared, and derived values
(world size, global batch, time limit in seconds) are computed once, here.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator, model_validator

from jobgen.job import nccl
from jobgen.job.yamlfile import Sexagesimal

ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
# A variable's value: text once validated, but a number or boolean in the file (`jobgen schema`
# tells editors so); Environment turns them into the text the shell gets.
ShellText = Annotated[str, WithJsonSchema({"type": ["string", "number", "boolean"]})]
# Slurm/PBS names for partitions, queues, accounts, QoS, modules: conservative on purpose.
SCHEDULER_NAME = r"^[A-Za-z0-9_.@%+:/-]+$"
_TIME = re.compile(r"^(?:(\d+)-)?(\d+):([0-5]\d):([0-5]\d)$")
_MEMORY = re.compile(r"^(\d+)\s*([KMGT]?)B?$", re.IGNORECASE)
# A PBS chunk resource value: ':', ',', '=' and spaces would split the select line, and the
# header is written unquoted, so shell characters are out too.
_CHUNK_VALUE = re.compile(r"^[A-Za-z0-9_.+@%/-]+$")
# Chunk resources jobgen writes itself, and what to do instead.
JOBGEN_CHUNK_RESOURCES = {
    "select": "set resources.nodes instead",
    "nodes": "set resources.nodes instead",
    "ncpus": "set resources.cpus_per_node instead",
    "ppn": "set resources.cpus_per_node instead",
    "ngpus": "set resources.gpus_per_node instead",
    "gpus": "set resources.gpus_per_node instead",
    "mem": "set resources.memory_per_node instead",
    "mpiprocs": "one per chunk, so the nodefile lists each node once",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Names other tools give these fields (Hugging Face TrainingArguments, LLaMA-Factory, axolotl,
    # Slurm): an unknown key that is one of them is answered with the field, which spelling
    # closeness alone misses (`lr` is closer to `lora` than to `learning_rate`).
    other_names: ClassVar[dict[str, str]] = {}


def parse_time_limit(text: str) -> int:
    """Seconds in `[D-]HH:MM:SS`; raises ValueError naming the accepted forms."""
    match = _TIME.match(text.strip())
    if not match:
        raise ValueError("expected [D-]HH:MM:SS, e.g. 04:00:00 or 1-12:00:00")
    days, hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total <= 0:
        raise ValueError("must be longer than zero")
    return total


def refuse_number_as_time(value: object, key: str, example: str) -> object:
    """Before a [D-]HH:MM:SS field's own check: a number is refused with how to write the time.
    YAML 1.1 reads an unquoted `24:00:00` as 86400 (base 60); the message then quotes the user's text."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if isinstance(value, Sexagesimal):
        raise ValueError(
            f'expected [D-]HH:MM:SS in quotes, e.g. {key}: "{value.text}"; unquoted, YAML 1.1 reads {value.text} '
            f"as the number {int(value)} (base 60)"
        )
    raise ValueError(f'expected [D-]HH:MM:SS in quotes, e.g. {key}: "{example}"')


def parse_memory_mb(text: str) -> int:
    """Megabytes in `64G`, `512M`, `1T` (a bare number is megabytes, as in Slurm)."""
    match = _MEMORY.match(str(text).strip())
    if not match:
        raise ValueError("expected a size such as 64G, 512M or 1T")
    number, unit = int(match.group(1)), match.group(2).upper()
    factor = {"": 1, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}[unit]
    megabytes = int(number * factor)
    if megabytes <= 0:
        raise ValueError("must be at least 1M")
    return megabytes


def node_counts(value: object) -> Optional[tuple[int, int]]:
    """resources.nodes as written (4, "4", " 2 - 4 ") as (MIN, MAX); None when it is neither."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", str(value))
    return (int(match.group(1)), int(match.group(2) or match.group(1))) if match else None


class Resources(_Strict):
    """What the scheduler is asked for."""

    other_names: ClassVar[dict[str, str]] = {
        "gpus": "gpus_per_node", "ntasks_per_node": "gpus_per_node", "time": "time_limit", "walltime": "time_limit",
        "mem": "memory_per_node", "memory": "memory_per_node", "queue": "partition", "cpus_per_task": "cpus_per_node",
    }

    nodes: int | str = Field(
        1,
        description="a node count, or on Slurm a range MIN-MAX (\"2-4\"): the job takes what the partition can "
        "give in the range, and each restart may land on another count (the global batch stays the job's)",
    )
    spare_nodes: int = Field(
        0, ge=0, le=64,
        description="nodes allocated beyond resources.nodes and kept idle: when a node hangs or fails, the job "
        "restarts at once inside its allocation with a spare in the bad node's place, instead of waiting in the "
        "queue for a continuation (Slurm, PBS Pro, Torque)",
    )
    gpus_per_node: int = Field(0, ge=0, le=64, description="0 runs on CPUs with the gloo backend")
    cpus_per_node: Optional[int] = Field(
        None, ge=1, le=4096, examples=[64],
        description="defaults to one per process (launch.procs_per_node); more for data loader workers",
    )
    memory_per_node: Optional[str] = Field(
        None, examples=["480G"],
        description="memory asked for on each node, e.g. 480G, 512M or 1T (a bare number is megabytes, as in Slurm): "
        "Slurm --mem; PBS Pro mem in each node's chunk; Torque -l mem, times the nodes. Unset: the scheduler's default",
    )
    time_limit: str = Field(
        "04:00:00", examples=["12:00:00"],
        description="[D-]HH:MM:SS, in quotes: the wall time of each segment; requeue.signal warns requeue.warning_seconds "
        "before it, and the job checkpoints and requeues itself to go on",
    )
    partition: Optional[str] = Field(
        None, pattern=SCHEDULER_NAME, examples=["gpu"],
        description="Slurm partition (--partition) or PBS Pro / Torque queue (-q); unset: the scheduler's default",
    )
    account: Optional[str] = Field(
        None, pattern=SCHEDULER_NAME, examples=["ml"],
        description="the account the job is charged to: Slurm --account, PBS Pro and Torque -A",
    )
    qos: Optional[str] = Field(
        None, pattern=SCHEDULER_NAME, examples=["high"],
        description="Slurm's quality of service (--qos); PBS Pro and Torque have none, and warn that it is not used",
    )
    constraint: Optional[str] = Field(
        None, pattern=r"^[A-Za-z0-9_.&|\[\]()*:-]+$", examples=["a100&ib"],
        description="Slurm node features the nodes must have (--constraint, e.g. a100 or 'a100&ib'); PBS Pro and Torque "
        "warn that it is not used: resources.chunk_resources says the same there",
    )
    exclusive: bool = Field(
        False,
        description="whole nodes that no other job shares: Slurm --exclusive, PBS Pro -l place=scatter:excl, Torque -n",
    )
    chunk_resources: dict[str, bool | int | str] = Field(
        default_factory=dict, examples=[{"ompthreads": 8, "bigmem": True}],
        description=(
            "site resources every node's chunk needs, e.g. {ompthreads: 8, bigmem: true}: PBS Pro adds them "
            "to the one '-l select' line (NAME=VALUE), Torque adds each NAME: true to 'nodes=' as a node "
            "property and warns about the rest; Slurm has no chunks and warns (use constraint there)"
        ),
    )

    @field_validator("nodes", mode="before")
    @classmethod
    def _nodes_count_or_range(cls, value: object) -> object:
        counts = node_counts(value)
        if counts is None:
            raise ValueError('expected a node count (4) or, on Slurm, a range MIN-MAX ("2-4")')
        low, high = counts
        if not 1 <= low <= high <= 4096:
            raise ValueError("node counts go from 1 to 4096, a range's smaller one first")
        return low if low == high else f"{low}-{high}"

    @property
    def allocated_nodes(self) -> int:
        """Nodes asked of the scheduler: resources.nodes (its largest, for a range) and the spares."""
        return self.max_nodes + self.spare_nodes

    @property
    def min_nodes(self) -> int:
        return int(str(self.nodes).split("-")[0])

    @property
    def max_nodes(self) -> int:
        return int(str(self.nodes).split("-")[-1])

    @field_validator("chunk_resources", mode="before")
    @classmethod
    def _chunk_resources_are_pbs_words(cls, value: object) -> object:
        # Before the type check, so a wrong value gets this one line rather than one per union member.
        for name, item in value.items() if isinstance(value, dict) else ():
            if not re.match(ENV_NAME, str(name)):
                raise ValueError(f"{name!r} is not a resource name (letters, digits, _; not starting with a digit)")
            if str(name).lower() in JOBGEN_CHUNK_RESOURCES:
                raise ValueError(f"{name!r} is set by jobgen: {JOBGEN_CHUNK_RESOURCES[str(name).lower()]}")
            if not isinstance(item, (bool, int, str)) or (isinstance(item, str) and not _CHUNK_VALUE.match(item)):
                raise ValueError(
                    f"{name}: {item!r} must be true/false, a whole number or a word of letters, digits and "
                    "_.+@%/- (':', ',', '=' and spaces would split the select line)"
                )
        return value

    @field_validator("time_limit", mode="before")
    @classmethod
    def _time_limit_is_text(cls, value: object) -> object:
        return refuse_number_as_time(value, "time_limit", "01:30:00")

    @field_validator("time_limit")
    @classmethod
    def _time_limit_parses(cls, value: str) -> str:
        parse_time_limit(value)
        return value.strip()

    @field_validator("memory_per_node")
    @classmethod
    def _memory_parses(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            parse_memory_mb(value)
        return value

    @property
    def time_limit_seconds(self) -> int:
        return parse_time_limit(self.time_limit)

    @property
    def memory_mb(self) -> Optional[int]:
        return parse_memory_mb(self.memory_per_node) if self.memory_per_node else None


class Launch(_Strict):
    """How one process per GPU is started on every node."""

    other_names: ClassVar[dict[str, str]] = {"nproc_per_node": "procs_per_node", "nnodes": "resources.nodes"}

    procs_per_node: Optional[int] = Field(
        None, ge=1, le=64, examples=[2],
        description="training processes (ranks) per node: defaults to gpus_per_node, one per GPU; required when "
        "gpus_per_node is 0",
    )
    master_port: int | Literal["auto"] = Field(
        "auto", description="'auto' is a hash of the whole job id, from 20000 up to the master node's ephemeral "
        "ports (ip_local_port_range), so two jobs on one node seldom collide"
    )
    rendezvous: Literal["static", "c10d"] = Field(
        "static",
        description="how the nodes' torchrun agents meet at MASTER_ADDR:MASTER_PORT (the job's first node): static "
        "gives each node its rank by NODE_RANK (--master-addr); c10d is torchrun's c10d rendezvous (--rdzv-backend), "
        "which assigns ranks itself, so rank 0 may be on another node",
    )
    network: Literal["auto", "infiniband", "roce", "ethernet"] = Field(
        "auto", description="the NCCL variables of this fabric (docs/nccl.md); auto leaves NCCL to detect it"
    )
    health_check: bool = Field(
        True, description="check every node (GPUs, package versions, data, bandwidth) before the model loads"
    )
    socket_ifname: Optional[str] = Field(
        None, pattern=r"^[\^=]?[A-Za-z0-9_.,-]+$", examples=["ib0"],
        description="the interface of NCCL's and gloo's sockets (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME); unset, "
        "each node takes the one that routes to MASTER_ADDR",
    )
    nccl_debug: Optional[Literal["VERSION", "WARN", "INFO", "TRACE"]] = Field(
        None, examples=["INFO"],
        description="NCCL_DEBUG on every node: how much NCCL logs (INFO names the transport, interfaces and topology it "
        "chose); unset, it is not exported",
    )
    collective_timeout_minutes: int = Field(
        30, ge=1, le=24 * 60,
        description="how long a jobgen-train rank waits in one collective (a step's all-reduce, a barrier, the "
        "agreement on a checkpoint) before it fails: a rank that died or hangs ends the others after this long "
        "instead of never. Make it longer than anything one rank may do while the others wait for it: "
        "loading the model, one step, a synchronous checkpoint save",
    )
    entrypoint: Literal["jobgen-train", "jobgen-probe"] = Field(
        "jobgen-train", description="jobgen-probe checks ranks and rendezvous in seconds, without a model"
    )
    command: Optional[list[str]] = Field(
        None, examples=[["python", "finetune.py", "--deepspeed", "ds_config_zero2.json"]],
        description="the job's own program in place of jobgen-train, started by torchrun once per process on every "
        "node (same rendezvous, environment, containers, logs), e.g. [python, finetune.py, --deepspeed, ds.json]: "
        "a list of words, as torchrun starts it (no shell between them, each written shell-quoted), so a YAML flow "
        "list reads as the command line and a word with spaces stays one word. training is then not given: the "
        "program reads its own settings. docs/guides/own-script.md",
    )
    stop_signal: Literal["TERM", "USR1", "USR2", "INT"] = Field(
        "TERM",
        description="launch.command only: the signal every rank gets at the time limit's warning or a stop request, "
        "then requeue.warning_seconds to save and exit 0 (a preemption on Slurm also sends SIGTERM to every process)",
    )
    resume_argument: Optional[str] = Field(
        None, examples=["--resume_from_checkpoint {checkpoint}"],
        description="launch.command only: words added to the command when a complete checkpoint exists, "
        "{checkpoint} standing for its path, e.g. '--resume_from_checkpoint {checkpoint}'; none at the first start",
    )
    checkpoints: str = Field(
        "trainer_output/checkpoint-*", min_length=1,
        description="launch.command only: a glob of the program's checkpoint folders, relative to the working "
        "directory (the Hugging Face Trainer's output_dir/checkpoint-*); the highest number in a name is the newest",
    )
    checkpoint_complete_file: Optional[str] = Field(
        "trainer_state.json",
        description="launch.command only: the file a checkpoint holds once it is complete (the Trainer writes "
        "trainer_state.json last); a match without it is never passed. null: every match is complete",
    )
    report_to: list[Literal["wandb", "mlflow"]] = Field(
        default_factory=list, examples=[["wandb", "mlflow"]],
        description="launch.command only: the trackers the program reports to; jobgen keeps one run of each for the "
        "jobgen run and exports WANDB_RUN_ID, WANDB_RESUME=allow, WANDB_DIR, WANDB_MODE (offline unless set), "
        "MLFLOW_TRACKING_URI, MLFLOW_RUN_ID, so that every requeue continues it. docs/guides/trackers.md",
    )
    launcher: Optional[Literal["srun", "pbsdsh", "pbs_tmrsh", "ssh", "mpiexec", "local"]] = Field(
        None, description="per-node launcher; the scheduler's default when unset"
    )
    ssh_options: list[str] = Field(
        default_factory=list, examples=[["-p", "2222"]],
        description="options for the ssh launcher, one argument each (passed shell-quoted, so no ~ or $VAR), "
        "e.g. ['-p', '2222', '-i', '/home/me/.ssh/id_cluster'] or ['-F', '/etc/jobgen/ssh_config']; "
        "options that keep ssh from running the node script or tying it to the connection "
        "(-f -G -N -O -Q -s -T -V -W) are refused",
    )

    @field_validator("master_port")
    @classmethod
    def _port_in_range(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1024 <= value <= 65535:
            raise ValueError("must be between 1024 and 65535, or 'auto'")
        return value

    @field_validator("ssh_options")
    @classmethod
    def _ssh_options(cls, value: list[str]) -> list[str]:
        check_ssh_options(value)
        return value

    @property
    def command_line(self) -> Optional[str]:
        """launch.command as one shell line (words with spaces quoted), for messages and comments."""
        import shlex

        return shlex.join(self.command) if self.command is not None else None

    @field_validator("command", mode="before")
    @classmethod
    def _command_is_words(cls, value: object) -> object:
        if isinstance(value, str):
            import shlex

            raise ValueError(f"give the program and its arguments as a list of words, e.g. command: {_flow_list(shlex.split(value) or ['python', 'train.py'])}")
        return value

    @field_validator("command")
    @classmethod
    def _command_has_a_program(cls, value: Optional[list[str]]) -> Optional[list[str]]:
        if value is not None and (not value or not value[0].strip()):
            raise ValueError("needs the program and its arguments, e.g. [python, finetune.py]")
        for word in value or ():
            if "\n" in word or "\r" in word or "\0" in word:
                raise ValueError(f"{word!r}: each word is one line; give several words instead")
        return value

    @field_validator("resume_argument")
    @classmethod
    def _resume_names_the_checkpoint(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and "{checkpoint}" not in value:
            raise ValueError(f"{value!r} does not say where the checkpoint goes: write {{checkpoint}} for its path, "
                             "e.g. '--resume_from_checkpoint {checkpoint}'")
        return value

    @field_validator("checkpoint_complete_file")
    @classmethod
    def _complete_file_is_a_name(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and (not value or "/" in value or not value.isprintable()):
            raise ValueError(f"{value!r} must be one file name inside a checkpoint folder, e.g. trainer_state.json")
        return value

    @model_validator(mode="after")
    def _command_or_entrypoint(self) -> "Launch":
        if self.command is not None and "entrypoint" in self.model_fields_set:
            raise ValueError(f"launch.command and launch.entrypoint ({self.entrypoint}) are both set: give one, "
                             "the job's own program or jobgen's")
        if self.command is None:
            own = [name for name in ("resume_argument", "stop_signal", "checkpoints", "checkpoint_complete_file", "report_to")
                   if name in self.model_fields_set]
            if own:
                raise ValueError(f"launch.{own[0]} is for a program of the job's own: set launch.command too, or drop it")
        return self


def _flow_list(words: list[str]) -> str:
    """Words as a YAML flow list, for an error message: [python, train.py, --lr, '1e-4']."""
    import json

    return "[" + ", ".join(w if re.fullmatch(r"[A-Za-z_./-][\w./=-]*", w) and w not in ("true", "false", "null") else json.dumps(w) for w in words) + "]"


# OpenSSH's (9.x) option letters: flags, options that take a value, and options that would keep
# ssh from running the node script, or from tying it to the connection (-T: no terminal).
_SSH_FLAGS = set("1246AaCgKkMnqtvXxYy")
_SSH_VALUE_OPTIONS = set("BbcDEeFIiJLlmoPpRSw")
_SSH_REFUSED = set("fGNOQsTVW")


def check_ssh_options(words: list[str]) -> None:
    """Raises ValueError unless `words` are ssh options (`-p 2222`, `-p2222`, `-vC`), nothing else."""
    index = 0
    while index < len(words):
        word = words[index]
        if not word.startswith("-") or len(word) < 2 or "\n" in word:
            raise ValueError(f"{word!r} is not an ssh option; give options only, e.g. ['-p', '2222']")
        for position, letter in enumerate(word[1:], start=1):
            if letter in _SSH_REFUSED:
                raise ValueError(f"ssh option -{letter} is refused: the ssh launcher runs the node script in the "
                                 "foreground, on a terminal (-tt) that ties it to the connection")
            if letter in _SSH_VALUE_OPTIONS:
                if position == len(word) - 1:
                    index += 1
                    if index == len(words):
                        raise ValueError(f"ssh option -{letter} needs a value after it")
                break
            if letter not in _SSH_FLAGS:
                raise ValueError(f"-{letter} is not an ssh option")
        index += 1


class Environment(_Strict):
    """What every node runs before the trainer starts."""

    modules: list[str] = Field(
        default_factory=list, examples=[["cuda/12.4"]],
        description="`module load` names, loaded on every node (Lmod or Environment Modules); one that does not load "
        "stops the node with the module system's message",
    )
    setup: list[str] = Field(
        default_factory=list, examples=[['source "$HOME/venvs/finetune/bin/activate"']],
        description="shell lines run as written, e.g. 'source ~/venvs/ft/bin/activate'",
    )
    variables: dict[str, ShellText] = Field(
        default_factory=dict, examples=[{"HF_HOME": "/shared/hf", "NCCL_IB_TIMEOUT": 22}],
        description="exported on every node; a number as written, true/false as 1/0 (quote 'true' for the word)",
    )
    secrets: list[str] = Field(
        default_factory=list, examples=[["HF_TOKEN"]],
        description="names of variables passed from the submitting shell; values never written",
    )
    workdir: Optional[str] = Field(
        None, examples=["/scratch/me/finetune"], description="directory the job runs in; the submit directory by default",
    )

    @field_validator("modules")
    @classmethod
    def _module_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not re.match(SCHEDULER_NAME, name):
                raise ValueError(f"module name {name!r} has characters a module name cannot have")
        return value

    @field_validator("setup")
    @classmethod
    def _one_line_each(cls, value: list[str]) -> list[str]:
        for line in value:
            if "\n" in line or "\r" in line:
                raise ValueError("each setup entry must be one line; give several entries instead")
        return value

    @field_validator("variables", mode="before")
    @classmethod
    def _numbers_as_shell_text(cls, value: object) -> object:
        # NCCL's settings are numbers (NCCL_IB_GID_INDEX: 3); the shell only has text.
        if not isinstance(value, dict):
            return value
        return {name: shell_text(item, name) for name, item in value.items()}

    @field_validator("variables")
    @classmethod
    def _variable_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            _check_env_name(name)
        return value

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, value: list[str]) -> list[str]:
        for name in value:
            _check_env_name(name)
        return value


def shell_text(value: object, name: object) -> object:
    """A variable's value as the shell holds it: a number as written in decimal, true/false as 1/0
    (what NCCL, PyTorch and the Hugging Face libraries read as on/off; quote 'true' for the word),
    a time YAML read in base 60 (1:30) as its text. Text passes; anything else is refused."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, Sexagesimal):
        return value.text
    if isinstance(value, (int, float)) and math.isfinite(value):
        return str(value)
    raise ValueError(f"{name}: {_short(value)} is not a value for a variable; give text, a number or true/false")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_env_name(name: str) -> None:
    if not re.match(ENV_NAME, name):
        raise ValueError(f"{name!r} is not a shell variable name (letters, digits, _; not starting with a digit)")
    # The scheduler's own names (SLURM_*, PBS_*) are refused by the chosen scheduler, at render.
    if name in {"MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NNODES"}:
        raise ValueError(f"{name!r} is set by the scheduler or by jobgen and cannot be overridden")


# SRC:DST[:ro|rw], both absolute: the one syntax pyxis (--container-mounts) and Apptainer (--bind)
# share. Commas separate mounts in both, and ':' separates the parts.
_MOUNT = re.compile(r"^(/[^,:]*):(/[^,:]*)(?::(ro|rw))?$")
# Options jobgen writes itself for each runtime, and what to set instead.
CONTAINER_OWN_FLAGS = {
    "pyxis": {"--container-image": "set container.image", "--container-mounts": "set container.mounts"},
    "apptainer": {"--nv": "set resources.gpus_per_node", "--bind": "set container.mounts", "-B": "set container.mounts"},
}
CONTAINER_OWN_FLAGS["singularity"] = CONTAINER_OWN_FLAGS["apptainer"]


class Container(_Strict):
    """The container each node's command runs in: off unless `image` is set. A site profile may
    set `runtime` (and mounts, flags) for every job; a job then names only its image."""

    runtime: Optional[Literal["pyxis", "apptainer", "singularity"]] = Field(
        None,
        description="pyxis: srun --container-image (Slurm with the pyxis plug-in and enroot); apptainer or "
        "singularity: '<runtime> exec' around each node's command, on any scheduler",
    )
    image: Optional[str] = Field(
        None, min_length=1, examples=["nvcr.io#nvidia/pytorch:24.05-py3"], description="e.g. nvcr.io#nvidia/pytorch:24.05-py3 (pyxis) or /images/ft.sif (apptainer)"
    )
    mounts: list[str] = Field(
        default_factory=list, examples=[["/scratch/data:/data:ro"]],
        description="SRC:DST or SRC:DST:ro, absolute paths; the working and run directories are always mounted",
    )
    flags: list[str] = Field(
        default_factory=list, examples=[["--writable-tmpfs"]],
        description="more options, one argument each: srun's --container-* options (pyxis) or 'apptainer exec' options",
    )

    @field_validator("image")
    @classmethod
    def _image_is_one_word(cls, value: Optional[str], info: ValidationInfo) -> Optional[str]:
        if value is not None and (not value.isprintable() or value != value.strip() or " " in value):
            raise ValueError("must be one image name or path, without spaces or control characters")
        # (A runtime that failed its own check is not in info.data: that error is enough.)
        if value is not None and "runtime" in info.data and info.data["runtime"] is None:
            raise ValueError("needs container.runtime: pyxis, apptainer or singularity (a site profile may set it)")
        return value

    @field_validator("mounts")
    @classmethod
    def _mounts_are_src_dst(cls, value: list[str]) -> list[str]:
        for mount in value:
            if not _MOUNT.match(mount):
                raise ValueError(
                    f"{mount!r} is not SRC:DST or SRC:DST:ro with absolute paths and no ',' (e.g. /scratch/data:/data:ro)"
                )
        return value

    @field_validator("flags")
    @classmethod
    def _flags_are_options_jobgen_does_not_write(cls, value: list[str], info: ValidationInfo) -> list[str]:
        for flag in value:
            if not flag.startswith("-") or not flag.isprintable():
                raise ValueError(f"{flag!r} is not an option; give options only, one argument each, e.g. ['--writable-tmpfs']")
            fix = CONTAINER_OWN_FLAGS.get(info.data.get("runtime") or "", {}).get(flag.split("=")[0])
            if fix:
                raise ValueError(f"{flag!r} is written by jobgen; {fix} instead")
        return value


class Lora(_Strict):
    """The LoRA adapters that method lora and qlora train (peft's LoraConfig); ignored by method full."""

    other_names: ClassVar[dict[str, str]] = {
        "rank": "r", "lora_r": "r", "lora_rank": "r", "lora_alpha": "alpha", "lora_dropout": "dropout",
        "target": "target_modules", "lora_target": "target_modules", "lora_target_modules": "target_modules",
    }

    r: int = Field(
        16, ge=1, le=1024, examples=[8],
        description="the rank of each adapter: the inner size of its two low-rank matrices (peft's r); trainable "
        "parameters grow with it",
    )
    alpha: int = Field(
        32, ge=1, examples=[16],
        description="the adapters' scale: each adds alpha / r times its product to the layer's output (peft's lora_alpha)",
    )
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="dropout on each adapter's input while training (peft's lora_dropout)")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        examples=[["q_proj", "v_proj"]],
        description="names of the layers that get adapters (peft's target_modules): by default every attention and MLP "
        "projection of Llama-style models; a name the model does not have is refused when it loads",
    )
    modules_to_save: list[str] = Field(
        default_factory=list, examples=[["lm_head"]],
        description="modules trained in full beside the adapters and saved with them, e.g. [embed_tokens, lm_head] "
        "(peft's modules_to_save)",
    )
    bias: Literal["none", "all", "lora_only"] = Field(
        "none", description="which biases train: none, all, or those of the adapted layers (peft's bias)"
    )


class Training(_Strict):
    """The fine-tune `jobgen-train` runs."""

    other_names: ClassVar[dict[str, str]] = {
        "lr": "learning_rate",
        "batch_size": "per_device_batch_size", "micro_batch_size": "per_device_batch_size",
        "per_device_train_batch_size": "per_device_batch_size", "train_batch_size": "global_batch_size",
        "gradient_accumulation_steps": "gradient_accumulation",
        "lr_scheduler": "lr_schedule", "lr_scheduler_type": "lr_schedule", "scheduler": "lr_schedule",
        "warmup": "warmup_steps", "num_warmup_steps": "warmup_steps",
        "num_train_epochs": "epochs", "num_epochs": "epochs",
        "model_name_or_path": "model", "base_model": "model", "dataset": "data", "train_file": "data",
        "max_seq_length": "max_length", "max_seq_len": "max_length", "sequence_len": "max_length",
        "cutoff_len": "max_length", "model_max_length": "max_length",
        "save_steps": "save_interval", "save_total_limit": "keep_checkpoints", "logging_steps": "logging_interval",
        "eval_steps": "eval_interval", "bf16": "precision", "fp16": "precision", "deepspeed": "deepspeed_config",
        "finetuning_type": "method", "lora_r": "lora.r", "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout",
        "lora_target": "lora.target_modules", "lora_target_modules": "lora.target_modules",
        "use_liger_kernel": "liger_kernel", "enable_liger_kernel": "liger_kernel", "attn_implementation": "attention",
        "flash_attn": "attention", "flash_attention": "attention",
    }

    model: str = Field(
        ..., examples=["meta-llama/Meta-Llama-3-8B"],
        description="local path or hub name of a causal LM: a folder with config.json, or a name loaded from the "
        "Hugging Face cache the nodes use (`jobgen prepare` stages it there)",
    )
    model_revision: str = Field(
        "main", min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_./-]*$",
        description="a hub model's branch, tag or 40-character commit (a commit pins it); ignored for a local folder. "
        "Staged in the nodes' cache (`jobgen prepare`), the nodes load it with the hub offline",
    )
    data: Union[str, list[str]] = Field(
        ..., examples=["data/conversations.jsonl"], description="the training records: a path, or a list of paths read in order; each a JSON array, JSONL, "
        ".parquet file or a folder written by datasets' save_to_disk",
    )
    data_format: Literal["auto", "sharegpt", "openai", "alpaca", "text", "pretokenized"] = Field(
        "auto",
        description="the records' format: sharegpt ({'conversations': [{'from', 'value'}]}), openai ({'messages': "
        "[{'role', 'content'}]}), alpaca ({'instruction', 'input', 'output'}), text ({'text'}: continued "
        "pre-training) or pretokenized ({'input_ids', 'labels'}); auto detects it from the records' fields, file by "
        "file (one format per file)",
    )
    trust_remote_code: bool = Field(
        False,
        description="run the Python code a model ships with (config.json 'auto_map'), on every node, for a model type "
        "transformers lacks (e.g. Qwen/Qwen-7B-Chat); its files are named in the start-up log. A site profile may "
        "forbid it",
    )
    chat_template: Optional[str] = Field(
        None, min_length=1, examples=["chatml"],
        description="the layout conversations are trained in: tokenizer (the model's own chat template, the default "
        "where its tokenizer has one), chatml (<|im_start|>role ... <|im_end|>, the default where it has none) or "
        "the path of a Jinja file. The assistant's part (its words and end of turn) is what is learned",
    )
    eval_data: Optional[Union[str, list[str]]] = Field(
        None, examples=["data/eval.jsonl"], description="held-out records (files as training.data) whose loss is measured every eval_interval steps",
    )
    eval_fraction: float = Field(
        0.0, ge=0, lt=1,
        description="hold out this fraction of training.data as the eval set instead of eval_data: each conversation "
        "with this chance, by its place in the data and seed (so about, not exactly, this fraction); the rest trains",
    )
    eval_interval: Optional[int] = Field(
        None, ge=1, examples=[100], description="optimizer steps between evaluations (and one at the last step); default save_interval",
    )
    keep_best: bool = Field(
        False,
        description="keep the checkpoint of the lowest eval loss (saved at that evaluation) out of keep_checkpoints' "
        "rotation, named by OUTPUT_DIR/checkpoints/best.json, and save its weights to OUTPUT_DIR/best at the end; "
        "needs eval_data or eval_fraction",
    )
    method: Literal["full", "lora", "qlora"] = Field(
        "lora",
        description="full: every parameter trains; lora: a LoRA adapter (training.lora) on the frozen model; qlora: "
        "the same adapter on the model loaded in 4-bit NF4 by bitsandbytes (or on a GPTQ or AWQ checkpoint's own "
        "quantization)",
    )
    zero_stage: Literal[2, 3] = Field(
        2,
        description="DeepSpeed ZeRO stage: 2 shards the optimizer state and gradients over the ranks; 3 shards the "
        "weights too, for a full fine-tune too big for one GPU (not with qlora)",
    )
    precision: Literal["bf16", "fp16", "fp32"] = Field(
        "bf16",
        description="the training's number format (DeepSpeed's bf16 or fp16 section): bf16 needs a GPU of compute "
        "capability 8.0 or newer (A100, H100); fp16 for older GPUs; fp32 runs with TF32 matmuls on GPUs, and is "
        "usually fastest on CPUs",
    )
    per_device_batch_size: int = Field(
        1, ge=1, examples=[4],
        description="samples (packed rows with packing) each rank computes in one forward and backward pass, the "
        "micro-batch; lower it first when a GPU runs out of memory",
    )
    gradient_accumulation: int = Field(
        1, ge=1, examples=[2],
        description="micro-batches summed into one optimizer step: the global batch is per_device_batch_size x "
        "gradient_accumulation x world size, unless global_batch_size is set",
    )
    global_batch_size: Optional[int] = Field(
        None, ge=1, examples=[64],
        description="samples (packed rows with packing) per optimizer step; default per_device_batch_size x "
        "gradient_accumulation x world size. A checkpoint keeps its global batch: resumed on another world size, "
        "it is split into micro-batches of at most per_device_batch_size and as many accumulation rounds as needed",
    )
    learning_rate: float = Field(
        2e-4, gt=0, le=1, examples=[1e-4],
        description="AdamW's peak learning rate, reached at the end of the warmup and then shaped by lr_schedule; "
        "LoRA usually trains at 1e-4 to 3e-4, a full fine-tune at about 1e-5",
    )
    lr_schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine",
        description="the learning rate after the warmup, as transformers' schedules: cosine and linear decay to 0 at "
        "the run's last step, constant stays at learning_rate",
    )
    warmup_steps: int = Field(
        0, ge=0, examples=[100],
        description="optimizer steps of linear warmup from 0 to learning_rate; give it or warmup_ratio",
    )
    warmup_ratio: float = Field(
        0.0, ge=0, le=1, description="warmup as a fraction of the run's optimizer steps (rounded up), as the Hugging "
        "Face Trainer's; give it or warmup_steps",
    )
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW's beta1 (fills 'auto' in a DeepSpeed config)")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW's beta2 (fills 'auto' in a DeepSpeed config)")
    adam_epsilon: float = Field(1e-8, gt=0, lt=1, description="AdamW's epsilon (fills 'auto' in a DeepSpeed config)")
    weight_decay: float = Field(
        0.0, ge=0, examples=[0.01], description="AdamW's weight decay (fills 'auto' in a DeepSpeed config)",
    )
    epochs: int = Field(1, ge=1, description="passes over the data; ignored when max_steps is set")
    max_steps: Optional[int] = Field(
        None, ge=1, examples=[1000],
        description="train exactly this many optimizer steps: overrides epochs and cycles the data epoch after epoch, "
        "as max_steps does in the Hugging Face Trainer; the LR schedule ends at it. A checkpoint resumes only "
        "with the same total steps (unless lr_schedule is constant)",
    )
    max_length: int = Field(
        2048, ge=8, examples=[4096],
        description="tokens per sample: a longer conversation or pretokenized record is cut to it (the cut ones are "
        "counted when the data is prepared), a longer text record is split into samples of this length; with packing, "
        "the length of a row. Refused above the positions the model has",
    )
    prepared_cache: Optional[str] = Field(
        None, examples=["/shared/jobgen-prepared"],
        description="folder of tokenized data stores, shared by the jobs that name it (a site profile may set it); "
        "default: the run directory's prepared/. Relative to the working directory, as training.data",
    )
    save_interval: int = Field(200, ge=1, description="optimizer steps between periodic checkpoints")
    keep_checkpoints: int = Field(
        2, ge=1,
        description="periodic checkpoints kept in OUTPUT_DIR/checkpoints: the newest ones; an older one is deleted once "
        "a newer one is complete (the one keep_best names is kept besides)",
    )
    async_save: bool = Field(
        True,
        description="training pauses at a checkpoint only to copy its state into host memory (one more copy "
        "of each rank's share of it); writing, fsync, hashing and the commit run in the background, and a stop "
        "waits for them. false: training waits for the whole save and needs no host copy",
    )
    snapshot_every: Optional[int] = Field(
        None, ge=0, examples=[1],
        description="optimizer steps between snapshots of the trainable state kept in host memory on this node and "
        "the next (a rank's share of the adapter's weights and optimizer state, twice); after a failure nobody announced (a killed or hung rank, a node "
        "powered off) the run resumes from the newest step the surviving nodes hold whole, when it is newer than the "
        "newest checkpoint. Default 1 for lora and qlora, 0 (none) for full, whose state is the whole model's",
    )
    step_seconds_estimate: Optional[float] = Field(
        None, gt=0, examples=[2.5], description="your estimate of one optimizer step, used only to warn about save_interval"
    )
    output_dir: str = Field("output", description="adapters, checkpoints and metrics; relative to the run directory")
    init_from: Optional[str] = Field(
        None, min_length=1, examples=["runs/llama3-8b-lora/output/final"],
        description="start this run from another run's weights: its checkpoint folder (OUTPUT_DIR/checkpoints/"
        "step-NNNNNN) or, for lora and qlora, its adapter folder (OUTPUT_DIR/final). Weights only: the run starts at "
        "step 0 with a fresh optimizer and its own LR schedule, and once it has a checkpoint of its own it resumes "
        "from that. For a full model folder, set training.model to it instead. Relative to the working directory",
    )
    lora: Lora = Field(default_factory=Lora)
    gradient_checkpointing: bool = Field(
        False,
        description="recompute activations in the backward pass instead of keeping them: much less memory for about a "
        "third more compute",
    )
    attention: Literal["auto", "sdpa", "flash_attention_2", "eager"] = Field(
        "auto",
        description="transformers' attn_implementation: auto keeps the model's default (sdpa where it has it); "
        "flash_attention_2 needs GPUs and the flash-attn package on the nodes",
    )
    liger_kernel: bool = Field(
        False,
        description="Liger's Triton kernels for RMSNorm, SwiGLU and RoPE in place of transformers' own, for the "
        "model types Liger knows (Llama, Mistral, Qwen, Gemma, Phi-3, ...): faster and leaner on GPUs; needs "
        "`pip install liger-kernel` on the nodes",
    )
    group_by_length: bool = Field(
        False,
        description="put samples of similar length in the same step, for less padding: each epoch's order is cut into "
        "megabatches of 50 steps, each sorted by length, and the steps shuffled (as transformers' LengthGroupedSampler)",
    )
    packing: bool = Field(
        False,
        description="pack several conversations into each row of up to max_length tokens, each attending only to "
        "itself (position ids restart per conversation), with the same loss as unpacked: for data of many short "
        "conversations, where padding would be most of the compute. per_device_batch_size then counts rows",
    )
    seed: int = Field(
        42,
        description="seeds the data order, the records eval_fraction holds out, the initial adapter weights (the same "
        "on every rank) and each rank's random streams (seed + rank, e.g. dropout)",
    )
    logging_interval: int = Field(
        1, ge=1, examples=[10],
        description="optimizer steps between the records in metrics.jsonl, the log and the trackers; the last step, a "
        "stop and an evaluation are always recorded",
    )
    tensorboard: bool = Field(False, description="the same as tensorboard in report_to (its older spelling)")
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, examples=[["tensorboard", "wandb"]],
        description="experiment trackers that rank 0 logs each logging step to, named as the Hugging Face Trainer "
        "names them; one tracker run per jobgen run however often it is requeued (its ids are kept in the run "
        "directory's trackers.json). W&B runs offline unless WANDB_MODE is set, into RUN_DIR/wandb; MLflow logs to "
        "MLFLOW_TRACKING_URI (environment.variables), else to a file store in RUN_DIR/mlruns",
    )
    deepspeed_config: Optional[str] = Field(
        None, examples=["ds_config_zero2.json"],
        description="a DeepSpeed JSON in place of the bundled ZeRO config, as Hugging Face users write it: 'auto' "
        "values are filled from the job as the Trainer fills them, other values must agree with the job, and a "
        "'scheduler' section of 'auto' values runs as the Hugging Face Trainer runs it (WarmupLR: constant after the "
        "warmup, WarmupDecayLR: linear, WarmupCosineLR: cosine) in place of lr_schedule",
    )

    @model_validator(mode="after")
    def _one_warmup(self) -> "Training":
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("training.warmup_steps and training.warmup_ratio are both set; give one")
        if self.eval_data and self.eval_fraction:
            raise ValueError("training.eval_data and training.eval_fraction are both set; give one")
        for name in ("data", "eval_data"):
            if getattr(self, name) == []:
                raise ValueError(f"training.{name} is an empty list; give a path or a list of paths")
        if self.keep_best and not (self.eval_data or self.eval_fraction):
            raise ValueError(
                "training.keep_best needs an evaluation to rank checkpoints by: set training.eval_data or "
                "training.eval_fraction (evaluated every training.eval_interval steps), or drop keep_best"
            )
        return self

    def trackers(self) -> list[str]:
        """report_to, with tensorboard where the older `tensorboard: true` asks for it."""
        return list(dict.fromkeys([*self.report_to, *(["tensorboard"] if self.tensorboard else [])]))

    def snapshot_steps(self) -> int:
        """snapshot_every, or its default for the method (0: no snapshots)."""
        if self.snapshot_every is not None:
            return self.snapshot_every
        return 0 if self.method == "full" else 1

    def warmup_of(self, total_steps: int) -> int:
        """Warmup steps of a run of `total_steps` (warmup_ratio rounded up, as the Hugging Face Trainer)."""
        return self.warmup_steps or math.ceil(total_steps * self.warmup_ratio)


class Requeue(_Strict):
    """What happens at preemption and at the time limit."""

    enabled: bool = Field(
        True,
        description="requeue the job after a preemption and at the time limit, from its last checkpoint (Slurm "
        "--requeue, PBS Pro and Torque -r y); false: the job ends there, and resources.spare_nodes cannot be used",
    )
    signal: Literal["USR1", "USR2", "TERM", "INT"] = Field(
        "USR1", description="sent to the batch shell warning_seconds before the time limit"
    )
    warning_seconds: int = Field(
        180, ge=30, le=3600,
        description="seconds before the time limit at which the scheduler sends requeue.signal (Slurm --signal=B:SIG@N); "
        "also how long the ranks have to save a checkpoint and exit after any stop request",
    )
    max_restarts: int = Field(
        5, ge=0, le=1000, examples=[10],
        description="restarts of one submission at most, its own requeues and the scheduler's (Slurm after a lost node, "
        "a PBS server's rerun), after a failure, a preemption or a time limit that saved nothing new; a continuation at "
        "the time limit after a segment that saved a newer checkpoint is not counted, so a long run in time-limit "
        "chunks completes. Past it the job stops and keeps its checkpoints, and submitting it again continues",
    )
    max_restarts_without_progress: int = Field(
        3, ge=1, le=1000,
        description="segments in a row that end without a newer complete checkpoint before the job stops (a restart storm)",
    )
    hang_seconds: Optional[int] = Field(
        None, ge=10, le=86400, examples=[600],
        description="seconds without a new step after which a job counts as hung; by default derived from its step times",
    )


class Job(_Strict):
    """A whole job file."""

    name: str = Field(
        "jobgen", min_length=1, max_length=200, examples=["llama3-8b-lora"],
        description="the job's name: the scheduler's job name and its run directory, runs/NAME (unless run_dir is set); "
        "written in ASCII letters, digits, _, . and - (a name with other letters keeps its ASCII and adds a hash)",
    )
    run_dir: Optional[str] = Field(
        None, examples=["/scratch/me/runs/llama3-8b-lora"], description="defaults to runs/<name>, relative to the submit directory (a name in another script "
        "than ASCII is written in ASCII with a hash of it, e.g. qwen-cce06f)",
    )
    resources: Resources = Field(default_factory=Resources)
    launch: Launch = Field(default_factory=Launch)
    environment: Environment = Field(default_factory=Environment)
    training: Optional[Training] = Field(
        None, description="the fine-tune jobgen-train runs; required unless launch.command names the job's own program",
    )
    requeue: Requeue = Field(default_factory=Requeue)
    container: Container = Field(default_factory=Container)
    extra_directives: list[str] = Field(
        default_factory=list, examples=[["#SBATCH --reservation=ft"]], description="site-specific header lines, e.g. '#SBATCH --reservation=ft'"
    )

    @field_validator("name")
    @classmethod
    def _printable_name(cls, value: str) -> str:
        if any(ord(ch) < 32 for ch in value):
            raise ValueError("must be one line without control characters")
        return value

    @field_validator("extra_directives")
    @classmethod
    def _directives_are_directives(cls, value: list[str]) -> list[str]:
        for line in value:
            # Which prefixes exist is the schedulers' knowledge: the chosen one checks them at render.
            if "\n" in line or "\r" in line or not re.match(r"^#[A-Za-z]\w*\s+\S", line):
                raise ValueError(f"{line!r} must be one directive line, such as '#SBATCH --reservation=ft' or '#PBS -m a'")
        return value

    @model_validator(mode="before")
    @classmethod
    def _training_or_own_command(cls, data: object) -> object:
        # Before the sections are read, so a command job with no training gets this line, not a
        # "field required" for training.model and training.data.
        if not isinstance(data, dict) or any(not isinstance(key, str) for key in data):
            return data  # a key that is not text: the line about it comes first
        launch = data.get("launch") if isinstance(data.get("launch"), dict) else {}
        if launch.get("command") is not None and data.get("training") is not None:
            raise ValueError("training is for jobgen-train; a job with launch.command runs its own program, which "
                             "reads its own settings: drop the training section (give them on the command line)")
        if launch.get("command") is None and data.get("training") is None:
            raise ValueError("training is missing: give training.model and training.data for jobgen-train, or "
                             "launch.command for a program of your own")
        return data

    @model_validator(mode="after")
    def _procs_match_gpus(self) -> "Job":
        gpus, procs = self.resources.gpus_per_node, self.launch.procs_per_node
        if gpus == 0 and procs is None:
            raise ValueError(
                "launch.procs_per_node is required when resources.gpus_per_node is 0 (CPU jobs use gloo)"
            )
        if gpus > 0 and procs is not None and procs != gpus:
            raise ValueError(
                f"launch.procs_per_node ({procs}) must equal resources.gpus_per_node ({gpus}): "
                "one process per GPU; leave procs_per_node unset"
            )
        if self.resources.spare_nodes and self.resources.min_nodes != self.resources.max_nodes:
            raise ValueError(
                f"resources.spare_nodes: a job with spare nodes trains on one node count, not a range "
                f"({self.resources.nodes}); give resources.nodes one count, such as {self.resources.min_nodes}"
            )
        if self.resources.spare_nodes and not self.requeue.enabled:
            raise ValueError("resources.spare_nodes: a spare takes a failed node's place when the job restarts, which "
                             "requeue.enabled: false turns off; enable requeue or drop spare_nodes")
        twice = nccl.conflict(self.launch, self.environment.variables)
        if twice:
            raise ValueError(twice)
        if self.training is None:
            return self  # the job's own program: its settings are its own
        if self.training.method == "qlora" and self.training.zero_stage == 3:
            raise ValueError("training.method qlora does not work with training.zero_stage 3; use zero_stage 2")
        if gpus == 0:
            # Both are CUDA kernels: on a CPU job they would fail on every node after the queue.
            if self.training.liger_kernel:
                raise ValueError("training.liger_kernel: Liger's kernels run on GPUs only; set it false for a CPU job "
                                 "(resources.gpus_per_node is 0)")
            if self.training.attention == "flash_attention_2":
                raise ValueError("training.attention: flash_attention_2 runs on GPUs only; use sdpa or auto for a CPU "
                                 "job (resources.gpus_per_node is 0)")
        # Each restart of a node range may land on another count; the global batch must split over all.
        uneven = [w for w in self.world_sizes if self.global_batch % w]
        if uneven:
            every = math.lcm(*self.world_sizes)
            raise ValueError(
                f"resources.nodes {self.resources.nodes}: the global batch of {self.global_batch} does not split "
                f"evenly over world size {uneven[0]} ({uneven[0] // self.procs_per_node} nodes x {self.procs_per_node}); set "
                f"training.global_batch_size to a multiple of {every}, which every count in the range splits"
            )
        return self

    # Derived values, computed here and nowhere else.
    @property
    def restarts_in_allocation(self) -> bool:
        """Whether a hung or failed node's segment is followed inside the same allocation, on its
        healthy nodes (job.sh.j2): with spare nodes to take its place, or a node range to shrink in."""
        res = self.resources
        return bool(res.spare_nodes or res.min_nodes != res.max_nodes) and self.requeue.enabled

    @property
    def procs_per_node(self) -> int:
        return self.launch.procs_per_node or self.resources.gpus_per_node

    @property
    def cpus_per_node(self) -> int:
        """CPUs asked for on each node: resources.cpus_per_node, else one per process."""
        return self.resources.cpus_per_node or self.procs_per_node

    @property
    def world_size(self) -> int:
        """Processes on resources.nodes, on the smallest count where it is a range."""
        return self.resources.min_nodes * self.procs_per_node

    @property
    def world_sizes(self) -> range:
        """Every world size the job may run on (one, unless resources.nodes is a range)."""
        ppn = self.procs_per_node
        return range(self.resources.min_nodes * ppn, self.resources.max_nodes * ppn + 1, ppn)

    def training_for(self, what: str) -> Training:
        """training, or JobgenError naming `what` needs it (a job with launch.command has none)."""
        if self.training is None:
            from jobgen.errors import JobgenError

            raise JobgenError(f"{what} is for jobgen-train's training section; this job runs its own program "
                              f"(launch.command: {self.launch.command[0]} ...), which jobgen does not read")
        return self.training

    @property
    def own_command(self) -> bool:
        """True when the job runs a program of its own (launch.command), not jobgen-train or jobgen-probe."""
        return self.launch.command is not None

    @property
    def global_batch(self) -> Optional[int]:
        """Samples per optimizer step; None for a program of the job's own (its batch is its own)."""
        t = self.training
        if t is None:
            return None
        return t.global_batch_size or t.per_device_batch_size * self.world_size * t.gradient_accumulation

    @property
    def backend(self) -> str:
        return "nccl" if self.resources.gpus_per_node > 0 else "gloo"

    @property
    def effective_run_dir(self) -> str:
        return self.run_dir or f"runs/{self.written_name}"

    @property
    def written_name(self) -> str:
        """The name as the scheduler's job name and the run directory take it (written_name())."""
        return written_name(self.name)


def written_name(name: str) -> str:
    """`name` in letters, digits, '_', '.' and '-', as schedulers and file systems take it on every
    site: a name already so is kept; one with other ASCII characters has them made '-' (`my job` is
    `my-job`, as it always was, so a resubmitted run finds its folder). A name with other letters
    (`训练-qwen`, `modèle`) keeps what it has in ASCII (accents dropped) and adds a hash of the whole
    name: dropping the rest would make two jobs one run directory (`训练-qwen` and `微调-qwen` both
    `qwen`), and a resubmitted job continues from the checkpoints it finds there."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.")
    if name.isascii() and slug:
        return slug
    import hashlib
    import unicodedata

    # NFC first: a name typed with a composed or a decomposed é is one job.
    same = unicodedata.normalize("NFC", name)
    digest = hashlib.sha256(same.encode("utf-8")).hexdigest()[:6]
    ascii_part = unicodedata.normalize("NFKD", same).encode("ascii", "ignore").decode()
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "-", ascii_part).strip("-.")[:57].rstrip("-.")  # 64 with the hash
    return f"{readable or 'job'}-{digest}"
