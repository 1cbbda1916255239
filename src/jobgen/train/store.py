"""The prepared data store: the data set tokenized once, memory-mapped by every rank.

A store is a folder named by its key, the hash of everything the tokens depend on (`StoreInputs`:
the data files' content, the tokenizer's files, the chat layout, max_length, the data format):

    KEY/tokens.int32     every sample's input ids, one after the other (a sample: a conversation, or a
                         text's piece or pretokenized record, jobgen.train.samples)
    KEY/learned.uint8    1 where the label is the token, 0 where it is -100
    KEY/offsets.npy      int64, conversation i is tokens[offsets[i]:offsets[i+1]]
    KEY/label_counts.npy int32, labels each conversation is trained on
    KEY/ids.json         the conversations' ids (read only for the sample log)
    KEY/meta.json        the inputs, counts (the conversations cut at max_length and the tokens
                         they lost among them) and how long the preparation took
    KEY/eval/            with training.eval_fraction: the held-out conversations, in the files
                         above (meta.json their counts); the training ones are the others
    KEY/COMPLETE         written last; a folder without it is never used
    KEY/rows-C-sSEED.npz packed rows (training.packing) of capacity C and seed SEED, added on first use

The held-out split is made record by record while the store is filled
(jobgen.train.evaluation.held_out); training.eval_data is a store of its own, the same as a
training store of that file (its key, so they are shared). Ranks map both and read no data file.

The tokens do not depend on packing: packed and unpacked runs, and runs of other seeds, share
them, and each packing is a file of its own in the store (pack_rows is a function of the
lengths, the capacity and the seed).

Written once: the preparer builds in a temporary folder named by its host and pid and renames it
to KEY, so a preparation killed midway leaves only a temporary folder, removed later by a preparer
that can tell it is dead (one of its own host whose process ended, or anyone's untouched for a day).
Inside a job, rank 0 alone is the preparer and the other ranks poll the file system until KEY is
complete, or KEY.failed holds the preparer's error: polling, not a collective, cannot time out
(every 0.2 s at first, then a tenth of the time waited, at most every 15 s: see poll_interval).
Only each node's local rank 0 polls the shared folder; it tells the node's other ranks through a
file of the node's own (jobgen.train.node_relay).
No lock is trusted to span nodes (NFS local_lock, BeeGFS, Lustre localflock or no flock at all):
a preparer takes an fcntl lock on KEY.lock where it can, which keeps two jobs of one node (or of
a file system whose locks do span nodes) from building twice; without it two preparers of two
jobs may both build, and the first rename wins (the other's copy is dropped). A complete store is
never removed or replaced. In a folder that is group-writable, lock files and stores are too, so
the members of its group share them.

Where: training.prepared_cache (a site profile may set it, so that jobs share stores), else
RUN_DIR/prepared. `jobgen prepare JOB.yaml` fills it from the login node.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from jobgen.errors import UserError
from jobgen.files import fsync_directory
from jobgen.train.data import TokenDataset
from jobgen.train.node_relay import FAILED, OK, NodeRelay

log = logging.getLogger("jobgen.train")

STORE_VERSION = 2  # the layout above; a new layout is a new key (2: the held-out part in EVAL, the cut counted)
# The files of a tokenizer folder that change what it encodes (transformers' names).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "vocab.txt", "spiece.model", "chat_template.jinja", "chat_template.json",
)
COMPLETE = "COMPLETE"
EVAL = "eval"  # the held-out conversations of eval_fraction, in the same layout
HASHES = "source-hashes.json"  # content hashes by (path, size, mtime): a restart does not read the data again
POLL_SECONDS = 0.2  # the first polls of a waiting rank; then longer, see poll_interval
MAX_POLL_SECONDS = 15.0
RENAME_SECONDS = 10.0  # how long a finished build tries to rename itself past other preparers' looks


@dataclass(frozen=True)
class StoreInputs:
    """Everything the tokens depend on. The key hashes every field: a new input is one new field."""

    data_sha256: str
    data_format: str
    tokenizer_sha256: str
    chat_template: str
    max_length: int
    held_out: str  # an eval_fraction's seed and fraction: those conversations are in EVAL, not in the store
    version: int = STORE_VERSION


def store_key(inputs: StoreInputs) -> str:
    return hashlib.sha256(json.dumps(asdict(inputs), sort_keys=True).encode()).hexdigest()[:24]


def check_data_path(data: Any, field: str = "training.data") -> None:
    """Before the process group: the data files are there and of a kind read (their records are
    checked as they are tokenized)."""
    from jobgen.job.sources import data_paths, source_kind

    for path in data_paths(data):
        source_kind(path, field)


def store_folder(prepared_cache: Optional[str], run_dir: str) -> str:
    """Where the stores of a job live: training.prepared_cache, else RUN_DIR/prepared."""
    from jobgen.rundir.files import PREPARED

    return os.path.abspath(prepared_cache) if prepared_cache else os.path.join(run_dir, PREPARED)


def inputs_for(training: Any, folder: str, hashing: Optional[Callable[[int], None]] = None) -> StoreInputs:
    """The inputs of `training` (paths resolved); hashes of unchanged files come from the folder's
    cache. `hashing(bytes read so far)` is called about once a second while a file is hashed."""
    hashes = _HashCache(folder, hashing)
    data = data_sha256(training.data, hashes)
    tokenizer = tokenizer_fingerprint(training.model, hashes, getattr(training, "model_revision", "main"))
    hashes.save()
    template = training.chat_template or "default"  # the tokenizer's own when it has one: in its files' hash
    if template not in ("default", "chatml", "tokenizer"):
        template = "file " + hashes.file_sha256(template, "training.chat_template")
    held_out = f"eval_fraction {training.eval_fraction} by seed {training.seed}" if _held_out(training) else ""
    return StoreInputs(data_sha256=data, data_format=training.data_format, tokenizer_sha256=tokenizer,
                       chat_template=template, max_length=training.max_length, held_out=held_out)


def data_sha256(data: Any, hashes: "_HashCache") -> str:
    """The content of `training.data`: a file's SHA-256 (as before lists and folders were read),
    else the hash of each file's name and SHA-256, a folder's data files included, in order."""
    from jobgen.job.sources import data_files, data_paths, source_kind

    paths = data_paths(data)
    if len(paths) == 1 and source_kind(paths[0]) != "arrow":
        return hashes.file_sha256(paths[0], "training.data")
    lines = [f"{os.path.basename(name)}:{hashes.file_sha256(name, 'training.data')}" for name in data_files(data)]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _held_out(training: Any) -> bool:
    return bool(getattr(training, "eval_fraction", 0)) and not getattr(training, "eval_data", None)


def tokenizer_fingerprint(model: str, hashes: "_HashCache", revision: str = "main") -> str:
    """A local model folder: its tokenizer files' contents. A hub name: the tokenizer as loaded at
    `revision` (the run's pinned commit: jobgen.rundir.model_pin)."""
    digest = hashlib.sha256()
    if os.path.isdir(model):
        for name in TOKENIZER_FILES:
            path = os.path.join(model, name)
            if os.path.isfile(path):
                digest.update(f"{name}:{hashes.file_sha256(path, 'training.model')}\n".encode())
        return digest.hexdigest()
    from jobgen.train.modeling import load_tokenizer

    tokenizer = load_tokenizer(model, revision)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update((backend.to_str() if backend is not None else repr(tokenizer.get_vocab())).encode())
    digest.update(json.dumps([tokenizer.special_tokens_map, getattr(tokenizer, "chat_template", None)],
                             sort_keys=True, default=str).encode())
    return digest.hexdigest()


class _HashCache:
    """SHA-256 of files by (path, size, mtime), kept in the store folder. `progress(bytes read)`
    about once a second while a file is read: the first start on a large data set hashes it, for
    longer than the start-up's hang bound may allow without a sign of life."""

    def __init__(self, folder: str, progress: Optional[Callable[[int], None]] = None) -> None:
        self.path = os.path.join(folder, HASHES)
        try:
            with open(self.path, encoding="utf-8") as handle:
                self.entries: dict[str, str] = json.load(handle)
        except (OSError, ValueError):
            self.entries = {}
        self.changed = False
        self.progress, self.read = progress, 0

    def file_sha256(self, path: str, field: str) -> str:
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            raise UserError(f"{field}: file {path!r} does not exist") from None
        key = f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}"
        if key not in self.entries:
            from jobgen.train.health import LARGE_FILE, hash_into

            if stat.st_size >= LARGE_FILE:
                log.info("data: hashing %s (%.1f GB) to name its store; later starts read the hash from %s",
                         path, stat.st_size / 1e9, self.path)
            digest = hashlib.sha256()
            try:
                with open(path, "rb") as handle:
                    self.read = hash_into(digest, handle, 1 << 24, self.read, self.progress)
            except IsADirectoryError:
                raise UserError(f"{field}: {path!r} is a directory; give a .json or .jsonl file") from None
            except OSError as exc:
                raise UserError(f"{field}: cannot read {path!r}: {exc.strerror}") from None
            self.entries[key] = digest.hexdigest()
            self.changed = True
        return self.entries[key]

    def save(self) -> None:
        if not self.changed:
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            temp = f"{self.path}.tmp-{socket.gethostname()}-{os.getpid()}"
            with open(temp, "w", encoding="utf-8") as handle:
                json.dump(self.entries, handle)
            os.replace(temp, self.path)
        except OSError:
            pass  # only a cache: the next start hashes again


# --- written once ---------------------------------------------------------------------------------


def is_complete(path: str) -> bool:
    """A folder with its COMPLETE marker, or a file that is there (renamed into place whole). One
    stat either way: every waiting rank asks this of the shared file system."""
    try:
        os.stat(os.path.join(path, COMPLETE))
        return True
    except NotADirectoryError:
        return True  # a file store
    except FileNotFoundError:
        return False


def _complete_on_server(path: str) -> bool:
    """is_complete, asked by opening the marker (or the file): a network file system revalidates on
    open (close-to-open), where a stat or a listing may answer from a cache seconds old."""
    try:
        with open(os.path.join(path, COMPLETE) if os.path.isdir(path) else path, "rb"):
            return True
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return False


def preparer_rank(rank: int) -> bool:
    """Whether global rank `rank` prepares a job's stores: rank 0 alone (local rank 0 of node 0),
    since no lock is trusted to span nodes; every other rank waits for COMPLETE."""
    return rank == 0


def prepare_once(target: str, build: Callable[[str], None], preparer: bool,
                 waiting: Optional[Callable[[float], None]] = None, relay: Optional[NodeRelay] = None) -> str:
    """Make `target` (a folder or a file) with `build(temporary_path)` unless it is complete.
    A preparer takes TARGET.lock where the file system gives one, and builds; the others poll until
    it is complete. Returns "found", "waited" (another process made it meanwhile) or "prepared".
    Raises the preparer's UserError on every process (from TARGET.failed).

    With a node's `relay` (jobgen.train.node_relay), only the node's local rank 0 polls the shared
    folder once the target is not found at the first look; the node's other ranks learn the end of
    its wait from it.

    Correct without locks that span nodes (NFS local_lock, BeeGFS, Lustre localflock or no flock):
    each build has its own temporary path, nothing another process may still write is removed, a
    complete target is never removed or replaced, and the first rename wins."""
    if relay is not None and not relay.leader and not preparer:
        if is_complete(target):
            return "found"
        relay.wait(poll_interval, waiting)
        return "waited"
    try:
        outcome = _prepare_or_wait(target, build, preparer, waiting)
    except UserError as error:
        if relay is not None and relay.leader:
            relay.publish(FAILED, str(error))
        raise
    if relay is not None and relay.leader:
        relay.publish(OK)
    return outcome


def _prepare_or_wait(target: str, build: Callable[[str], None], preparer: bool,
                     waiting: Optional[Callable[[float], None]]) -> str:
    failed = _Failure(target + ".failed")
    waited_since = time.monotonic()
    said = 0.0
    while True:
        if is_complete(target):
            return "found" if time.monotonic() - waited_since < POLL_SECONDS else "waited"
        message = failed.this_starts()
        if message is not None:
            raise UserError(message)
        if preparer:
            with _Lock(target + ".lock") as held:
                if held:
                    # The stat above may have answered from a cached "no such file" (NFS acdirmax, up
                    # to 60 s): a store finished meanwhile is asked of the server before building.
                    if _exists_on_server(target) and _complete_on_server(target):
                        return "waited"
                    if _build_under_lock(target, build, failed.path):
                        return "prepared"
                    preparer = False  # another preparer's rename won: wait to see it, never build again
        waited = time.monotonic() - waited_since
        if waiting and waited - said >= 60:
            said = waited
            waiting(waited)
        time.sleep(poll_interval(waited))


def poll_interval(waited: float) -> float:
    """Seconds to the next look: a tenth of the time waited so far, from POLL_SECONDS up to
    MAX_POLL_SECONDS, so that a node's waiting ranks stat the shared folder a few times a
    second at first and less than once a second during a long preparation, and find the store
    at most 10% (or 15 s) after it is made."""
    return min(MAX_POLL_SECONDS, max(POLL_SECONDS, waited / 10))


def _segment() -> str:
    """This job segment, as the ranks of every node know it; empty outside a job (`jobgen prepare`)."""
    job_id = os.environ.get("JOBGEN_JOB_ID", "")
    return f"{job_id}/{os.environ.get('JOBGEN_RESTART_COUNT', '0')}" if job_id else ""


class _Failure:
    """A preparer's error (TARGET.failed) is this start's when it names this job segment, or when
    it appears or changes while this process waits. Never by comparing its mtime with this node's
    clock: the nodes' and the file server's clocks differ. An older one is redone."""

    TAG = "jobgen segment "

    def __init__(self, path: str) -> None:
        self.path = path
        self.at_start = self._identity()
        self.stale: Optional[tuple[int, int, int]] = None

    def _identity(self) -> Optional[tuple[int, int, int]]:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return None
        return stat.st_ino, stat.st_mtime_ns, stat.st_size

    def this_starts(self) -> Optional[str]:
        """The error's message when it is this start's, else None."""
        now = self._identity()
        if now is None or now == self.stale:
            return None
        try:
            with open(self.path, encoding="utf-8") as handle:
                first, _, rest = handle.read().partition("\n")
        except FileNotFoundError:
            return None
        tagged = first.startswith(self.TAG)
        message = (rest if tagged else f"{first}\n{rest}").strip()
        mine = tagged and bool(_segment()) and first[len(self.TAG):].strip() == _segment()
        if mine or now != self.at_start:
            return message
        self.stale = now  # read once: an earlier start's error, unchanged since
        return None

    @classmethod
    def text(cls, message: str) -> str:
        return f"{cls.TAG}{_segment()}\n{message}" if _segment() else message


# A temporary path not written for this long is a killed preparation's, whoever made it. A build
# writes its files continuously; clocks of nodes differ by seconds, not hours.
STALE_TEMP_SECONDS = 24 * 3600


def _temp_name(name: str, suffix: str = "") -> str:
    """A build's temporary name: its host and pid, so that no two processes of a cluster share one."""
    return f".tmp-{name}-{socket.gethostname()}-{os.getpid()}{suffix}"


def _dead_temp(folder: str, entry: str, name: str) -> bool:
    """Whether `entry` is a temporary path of `name` that no live process writes: one of this host
    whose process has ended, or anyone's untouched for STALE_TEMP_SECONDS. Another node's recent
    one may be a build in progress: a lock held through this node's mount says nothing about it."""
    prefix = f".tmp-{name}-"
    if not entry.startswith(prefix):
        return False
    host, _, pid = entry[len(prefix):].rpartition("-")
    if host == socket.gethostname() and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
        return True
    return time.time() - _newest_write(os.path.join(folder, entry)) > STALE_TEMP_SECONDS


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _newest_write(path: str) -> float:
    newest = 0.0
    try:
        newest = os.stat(path).st_mtime
        for root, _, files in os.walk(path):
            for file in files:
                newest = max(newest, os.stat(os.path.join(root, file)).st_mtime)
    except OSError:
        return time.time()  # changing under us: alive
    return newest


def _build_under_lock(target: str, build: Callable[[str], None], failed: str) -> bool:
    """Builds `target`; False when another preparer's rename came first (its copy is as good)."""
    folder, name = os.path.split(target)
    for entry in os.listdir(folder):
        if _dead_temp(folder, entry, name):
            _remove(os.path.join(folder, entry))
    temp = os.path.join(folder, _temp_name(name))
    try:
        if os.path.lexists(target):  # incomplete (asked of the server)
            _clear_incomplete(target, os.path.join(folder, _temp_name(name, "-aside")))
        _remove(failed)
        build(temp)
        _share_with_group(temp, folder)
    except PermissionError as exc:
        _remove(temp)
        raise _cannot_write(folder, exc) from None
    except UserError as exc:
        _remove(temp)
        _write_text(failed, _Failure.text(str(exc)))
        raise
    except BaseException:
        _remove(temp)
        raise
    if not _rename_into_place(temp, target):
        _remove(temp)
        return False
    fsync_directory(folder)
    return True


def _clear_incomplete(target: str, aside: str) -> None:
    """An incomplete target: made by hand, by a jobgen without the marker, or the empty folder of
    another preparer's look (_exists_on_server), there for a moment and maybe gone already."""
    try:
        os.rmdir(target)  # empty: nothing a rank could have mapped
        return
    except FileNotFoundError:
        return
    except OSError:  # not empty, or a file
        pass
    try:
        # Moved aside, not removed: a rank that mapped it keeps its pages; the age bound removes it later.
        os.rename(target, aside)
    except FileNotFoundError:
        pass


def _rename_into_place(temp: str, target: str) -> bool:
    """Renames the finished `temp` to `target`; False when another preparer's store is there
    first. A rename onto a folder that exists fails (EEXIST or ENOTEMPTY here, EPERM through
    sftp): one there is another's complete store (only those are renamed into place), or for a
    moment the empty folder of another's look at the target, after which this tries again."""
    deadline = time.monotonic() + RENAME_SECONDS
    while True:
        try:
            os.rename(temp, target)
            return True
        except OSError:
            if _exists_on_server(target) and _complete_on_server(target):
                return False
            if time.monotonic() > deadline:
                if _exists_on_server(target):
                    return False  # not complete to this node yet (a cache): the other's all the same
                raise
            time.sleep(0.05)


def _exists_on_server(path: str) -> bool:
    """Whether `path` exists, asked so that no cache answers: an exclusive create (mkdir) is decided
    by the file server, where a stat or an open may trust a cached "no such file". A waiter's
    isfile finds no store in the empty folder it makes for a moment."""
    try:
        os.mkdir(path)
    except FileExistsError:
        return True
    except PermissionError:  # a folder we may not write: the cached answer (the build says why it cannot)
        return os.path.lexists(path)
    except FileNotFoundError:
        # Seen through sshfs under load while another node renamed its store onto this name: the
        # server had no answer for a moment. Not there as far as this look can tell; the caller asks again.
        return False
    try:
        os.rmdir(path)
    except OSError:  # another preparer's folder was renamed onto the empty one meanwhile
        return True
    return False


def _share_with_group(path: str, folder: str) -> None:
    """A store made in a group-writable folder (a prepared_cache shared by a group) is the group's
    too: its folders group-writable, so that another member adds packed rows to it (the folder's
    setgid bit gives them its group)."""
    if not os.stat(folder).st_mode & stat.S_IWGRP:
        return
    for root, _, files in os.walk(path):
        os.chmod(root, os.stat(root).st_mode | stat.S_IRWXG)
        for file in files:
            full = os.path.join(root, file)
            os.chmod(full, os.stat(full).st_mode | stat.S_IRGRP)
    if os.path.isfile(path):
        os.chmod(path, os.stat(path).st_mode | stat.S_IRGRP | stat.S_IWGRP)


def _cannot_write(folder: str, exc: OSError) -> UserError:
    import grp
    import pwd

    info = os.stat(folder)
    try:
        owner, group = pwd.getpwuid(info.st_uid).pw_name, grp.getgrgid(info.st_gid).gr_name
    except KeyError:
        owner, group = str(info.st_uid), str(info.st_gid)
    return UserError(f"training.prepared_cache: cannot write in {folder!r} ({exc.strerror}; owner {owner}, group {group}, "
                     f"mode {stat.filemode(info.st_mode)}): its owner can share it with a group you are in "
                     f"(chgrp -R GROUP, chmod -R g+w and g+s on its folders), or give a folder you can write")


class _Lock:
    """An fcntl lock on a file, taken without waiting; `held` is falsy when another process of this
    node has it. Where locks are missing (ENOSYS, EOPNOTSUPP, ENOLCK) or the lock file is another
    user's and read-only to us, the lock is taken as held: preparation is correct without it
    (prepare_once); it only saves a second build on one node or where locks span nodes."""

    def __init__(self, path: str) -> None:
        self.path, self.fd = path, -1

    def __enter__(self) -> Optional["_Lock"]:
        try:  # lockf needs a read-write open; 0o664: another member of a shared folder's group may open it so
            try:  # the folder is there but once: no mkdir on every try of a waiting preparer
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o664)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o664)
        except PermissionError:
            return self  # a lock file we may not write, or a folder we may not write (the build says so)
        if os.stat(os.path.dirname(self.path)).st_mode & stat.S_IWGRP:
            try:  # the umask took the group's write away
                os.fchmod(self.fd, 0o664)
            except PermissionError:  # not ours: its owner made it so
                pass
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _write_text(path: str, text: str) -> None:
    temp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"  # pid alone is not unique across nodes
    with open(temp, "w", encoding="utf-8") as handle:
        handle.write(text + "\n")
    os.replace(temp, path)


# --- mapped by every rank -------------------------------------------------------------------------


class StoredDataset(TokenDataset):
    """A complete store, mapped read-only: the pages are the page cache's, shared by the node's ranks."""

    def __init__(self, path: str) -> None:
        import numpy as np

        self.path = path
        with open(os.path.join(path, "meta.json"), encoding="utf-8") as handle:
            self.meta = json.load(handle)
        self.pad_id = int(self.meta["pad_token_id"])  # the tokenizer's, a function of its files
        self.offsets = np.load(os.path.join(path, "offsets.npy"), mmap_mode="r")
        # Python ints, as the per-rank path's: the loss divides by their sum.
        self.label_counts = np.load(os.path.join(path, "label_counts.npy")).tolist()
        total = int(self.meta["tokens"])
        self.token_ids = _map(os.path.join(path, "tokens.int32"), np.int32, total)
        self.learned = _map(os.path.join(path, "learned.uint8"), np.uint8, total)
        self._lengths: Optional[list[int]] = None
        self._ids: Optional[list[str]] = None

    @property
    def lengths(self) -> list[int]:
        if self._lengths is None:  # a list: BatchOrder and pack_rows index it one by one
            import numpy as np

            self._lengths = np.diff(self.offsets).tolist()
        return self._lengths

    @property
    def ids(self) -> list[str]:  # type: ignore[override]
        if self._ids is None:  # only the sample log reads them
            with open(os.path.join(self.path, "ids.json"), encoding="utf-8") as handle:
                self._ids = json.load(handle)
        return self._ids

    def held_out(self) -> Optional["StoredDataset"]:
        """The held-out part (training.eval_fraction), mapped; None in a store without one."""
        path = os.path.join(self.path, EVAL)
        return StoredDataset(path) if os.path.isdir(path) else None

    def sample(self, index: int) -> tuple[Any, Any]:
        import numpy as np

        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        ids = np.array(self.token_ids[start:end], dtype=np.int64)
        return ids, np.where(self.learned[start:end] != 0, ids, -100)

    def packed_rows(self, capacity: int, seed: int, preparer: bool) -> list[list[int]]:
        """pack_rows' rows for this store, computed once and kept in it."""
        import numpy as np

        from jobgen.train.data import pack_rows

        target = os.path.join(self.path, f"rows-{capacity}-s{seed}.npz")

        def build(temp: str) -> None:
            rows = pack_rows(self.lengths, capacity, seed)
            flat = np.fromiter((i for row in rows for i in row), dtype=np.int64)
            bounds = np.cumsum([0] + [len(row) for row in rows], dtype=np.int64)
            with open(temp, "wb") as handle:  # np.savez would add ".npz" to a bare name
                np.savez(handle, samples=flat, bounds=bounds)
                handle.flush()
                os.fsync(handle.fileno())

        prepare_once(target, build, preparer, relay=NodeRelay.for_target(target))
        with np.load(target) as saved:
            flat, bounds = saved["samples"].tolist(), saved["bounds"].tolist()
        return [flat[bounds[r]:bounds[r + 1]] for r in range(len(bounds) - 1)]


def _map(path: str, dtype: Any, count: int) -> Any:
    import numpy as np

    if count == 0:  # mmap cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


# --- filled once ----------------------------------------------------------------------------------


def write_store(folder: str, chunks: Any, chat: Any, inputs: StoreInputs, processes: Optional[int] = None,
                progress: Optional[Callable[[int, int, int], None]] = None, total: int = 0,
                held: Optional[Callable[[int, int], Any]] = None) -> dict:
    """The store's files in `folder` (made here), COMPLETE last, from `chunks` of samples
    (read_samples', in order); returns its meta. `held(first, count)`, when given, says which of
    records first..first+count-1 (their index in the whole data) are held out: those go to
    folder/eval (EVAL), in the same layout. A record is held out whole (a long text's pieces too)."""
    from jobgen.train.encode import encode_all, usable_cpus

    started = time.monotonic()
    processes = processes or usable_cpus()
    os.makedirs(folder)
    train = _Part(folder)
    held_part = _Part(os.path.join(folder, EVAL)) if held else None
    # Where each chunk given to encode_all goes, in order: encode_all keeps the order.
    destinations: deque = deque()

    def routed() -> Any:
        first = 0
        for chunk in chunks:
            if held_part is None:
                destinations.append(train)
                yield chunk
            else:
                out = held(first, len(chunk))
                for part, keep in ((train, ~out), (held_part, out)):
                    picked = [sample for sample, kept in zip(chunk, keep) if kept]
                    if picked:
                        destinations.append(part)
                        yield picked
            first += len(chunk)

    try:
        for encoded in encode_all(routed(), chat, processes, progress, total):
            destinations.popleft().add(encoded, encoded.ids)
    finally:
        train.close()
        if held_part is not None:
            held_part.close()
    pad_id = chat.tokenizer.pad_token_id
    meta = train.finish(pad_id)
    if held_part is not None:
        held_meta = held_part.finish(pad_id)
        check_split(held_meta["conversations"], meta["conversations"], inputs.held_out)
        _write_json(os.path.join(held_part.folder, "meta.json"), held_meta)  # what StoredDataset reads
        meta["eval"] = {key: held_meta[key] for key in ("conversations", "tokens", "cut")}
    meta.update({"inputs": asdict(inputs), "processes": processes, "seconds": round(time.monotonic() - started, 3),
                 "host": socket.gethostname(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    _write_json(os.path.join(folder, "meta.json"), meta)
    _write_json(os.path.join(folder, COMPLETE), {"key": store_key(inputs)})
    return meta


class _Part:
    """One set of a store's arrays being written (the training conversations, or the held-out ones)."""

    def __init__(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self.folder = folder
        self.tokens = open(os.path.join(folder, "tokens.int32"), "wb")
        self.learned = open(os.path.join(folder, "learned.uint8"), "wb")
        self.lengths: list[Any] = []
        self.counts: list[Any] = []
        self.uncut: list[Any] = []
        self.ids: list[str] = []

    def add(self, chunk: Any, ids: list[str]) -> None:
        chunk.tokens.tofile(self.tokens)
        chunk.learned.tofile(self.learned)
        self.lengths.append(chunk.lengths)
        self.counts.append(chunk.label_counts)
        self.uncut.append(chunk.uncut)
        self.ids += ids

    def close(self) -> None:
        for handle in (self.tokens, self.learned):
            if not handle.closed:
                handle.flush()
                os.fsync(handle.fileno())
                handle.close()

    def finish(self, pad_id: Any) -> dict:
        """offsets, label counts and ids written; returns the part's counts (for its meta.json)."""
        import numpy as np

        def joined(arrays: list[Any]) -> Any:
            return np.concatenate(arrays).astype(np.int64) if arrays else np.zeros(0, dtype=np.int64)

        lengths, uncut = joined(self.lengths), joined(self.uncut)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        np.save(os.path.join(self.folder, "offsets.npy"), offsets)
        np.save(os.path.join(self.folder, "label_counts.npy"), joined(self.counts).astype(np.int32))
        _write_json(os.path.join(self.folder, "ids.json"), self.ids)
        # Conversations longer than max_length lose their end: how many, and how many tokens.
        cut = {"conversations": int((uncut > lengths).sum()), "tokens_lost": int((uncut - lengths).sum())}
        if cut["conversations"]:
            longest = int(np.argmax(uncut))
            cut["longest"] = {"id": self.ids[longest], "tokens": int(uncut[longest])}
        return {"conversations": len(lengths), "tokens": int(offsets[-1]), "pad_token_id": pad_id, "cut": cut}


def check_split(held: int, kept: int, held_out: str) -> None:
    """A split that holds out no conversation, or all of them, is the user's to change."""
    if held == 0:
        raise UserError(f"training.eval_fraction: the split ({held_out}) holds out none of the {kept} conversations "
                        "(each is held out with that chance); raise eval_fraction, or give the eval set as training.eval_data")
    if kept == 0:
        raise UserError(f"training.eval_fraction: the split ({held_out}) holds out all {held} conversations and leaves "
                        "none to train on; lower it")


def cut_summary(meta: dict, max_length: int) -> str:
    """The cut to max_length of a store's meta (or its "eval" part), for a line: "" when none was cut."""
    cut = meta.get("cut") or {}
    if not cut.get("conversations"):
        return ""
    longest = cut.get("longest") or {}
    return (f"{cut['conversations']} of {meta['conversations']} conversations cut at max_length {max_length}, "
            f"{cut['tokens_lost']} tokens lost; the longest, {longest.get('id')!r}, has {longest.get('tokens')} tokens")


def _write_json(path: str, payload: Any) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(payload, handle)
        handle.flush()
        os.fsync(handle.fileno())


def ensure_store(training: Any, run_dir: str, tokenizer: Callable[[], Any], preparer: bool, processes: Optional[int] = None,
                 progress: Optional[Callable[[int, int, int], None]] = None,
                 waiting: Optional[Callable[[float], None]] = None,
                 hashing: Optional[Callable[[int], None]] = None) -> tuple[StoredDataset, str]:
    """The store of `training` (paths resolved), prepared here if this process is a preparer and
    nobody has made it, else waited for. Returns it mapped, and prepare_once's outcome.
    `tokenizer()` gives the tokenizer; only a preparation calls it (a restart loads none here).
    `hashing`: told the bytes read while the data is hashed to name the store."""
    from jobgen.job.conversations import read_samples
    from jobgen.job.sources import count_records
    from jobgen.train.data import ChatTokenizer

    folder = store_folder(getattr(training, "prepared_cache", None), run_dir)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UserError(f"training.prepared_cache: cannot create {folder!r}: {exc.strerror}; give a folder "
                        "you can write, or remove the field to keep the store in the run directory") from None
    inputs = inputs_for(training, folder, hashing)
    target = os.path.join(folder, store_key(inputs))

    def build(temp: str) -> None:
        chunks = read_samples(training.data, training.data_format)
        chat = ChatTokenizer(tokenizer(), training.max_length, training.chat_template, training.model)
        write_store(temp, chunks, chat, inputs, processes, progress, count_records(training.data), held_split(training))

    outcome = prepare_once(target, build, preparer, waiting, NodeRelay.for_target(target))
    return StoredDataset(target), outcome


def find_store(training: Any, run_dir: str) -> Optional[StoredDataset]:
    """The complete store of `training` (paths resolved) where one is; prepares nothing."""
    folder = store_folder(getattr(training, "prepared_cache", None), run_dir)
    if not os.path.isdir(folder):
        return None
    try:
        target = os.path.join(folder, store_key(inputs_for(training, folder)))
    except UserError:  # a file missing: nothing prepared from it
        return None
    return StoredDataset(target) if is_complete(target) else None


def held_split(training: Any) -> Optional[Callable[[int, int], Any]]:
    """write_store's `held` for training.eval_fraction (by its seed); None without one."""
    if not _held_out(training):
        return None
    from jobgen.train.evaluation import held_out_mask

    return lambda first, count: held_out_mask(first, count, training.eval_fraction, training.seed)


def ensure_eval_store(training: Any, run_dir: str, tokenizer: Callable[[], Any], preparer: bool, store: StoredDataset,
                      processes: Optional[int] = None, progress: Optional[Callable[[int, int, int], None]] = None,
                      waiting: Optional[Callable[[float], None]] = None) -> tuple[Optional[StoredDataset], str]:
    """The eval set of `training` beside its training `store`, mapped, and prepare_once's outcome:
    training.eval_data's own store (prepared as ensure_store prepares a training file), or the
    store's held-out part; (None, "") without either."""
    if getattr(training, "eval_data", None):
        as_data = training.model_copy(update={"data": training.eval_data, "eval_fraction": 0.0, "eval_data": None})
        return ensure_store(as_data, run_dir, tokenizer, preparer, processes, progress, waiting)
    return store.held_out(), ""
