"""The training loop: a short loop that calls the components (data, model, checkpoints, metrics).

Order of work, the same on every rank:
1. `prepare()` (jobgen.train.prepare) checks the job, the data file and the model reference
   before any process group exists, so a user's mistake ends every rank at once with the same message.
2. The process group starts (with a timeout); stale temporary checkpoints are removed and the
   newest complete checkpoint is found and checked against this run's settings. Its world size
   may differ: the global batch (samples per optimizer step) is the checkpoint's, and this world
   size only changes how it is split into micro-batches and accumulation rounds.
3. Model, DeepSpeed engine and LR scheduler are built; a checkpoint, if any, is loaded, with
   every rank's RNG states; otherwise each rank seeds itself with seed + rank.
4. Each optimizer step runs its accumulation rounds; the loss of each is divided by the labelled
   tokens of the whole step, so the gradient is the token mean over the step however it is split.
   Then one all_gather carries loss, tokens, step time, memory and each rank's stop flag, so all
   ranks decide together.
5. Periodic checkpoints every `save_interval` steps, one at the last step, one when stopped
   (and with `keep_best`, one at each evaluation that is the best so far: jobgen/train/best.py);
   then the final model (adapters or full weights) and tokenizer go to OUTPUT_DIR/final, and the
   best checkpoint's to OUTPUT_DIR/best.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from typing import Any, Optional

from jobgen.errors import UserError
from jobgen.job.hub_cache import environment_cache, look_up
from jobgen.job.model_config import code_files_of
from jobgen.rundir.files import BEST_MODEL, FINAL_MODEL
from jobgen.rundir.model_pin import needs_pin, pin_commit
from jobgen.train import checkpoint as ckpt
from jobgen.train import health, init_from, peer_snapshot
from jobgen.train.background_save import BackgroundSaves
from jobgen.train.best import BestSoFar, restore_pointer, write_pointer
from jobgen.train.chat_template import CHATML, CHATML_JINJA
from jobgen.train.data import BatchOrder, ChatTokenizer, MicroBatches, split_global_batch
from jobgen.train.distributed import Distributed, RankInfo
from jobgen.train.dsconfig import build_config, compiled_op_notice, digest
from jobgen.train.evaluation import Evaluation
from jobgen.train.exit_report import ExitReport, NotFinite
from jobgen.train.heartbeat import Heartbeat
from jobgen.train.metrics import MetricsWriter, StartupClock, host_peak_mb, peak_memory_mb
from jobgen.train.modeling import import_deepspeed, keep_bitsandbytes_out, load_model, load_tokenizer
from jobgen.train.peer_snapshot import PeerSnapshots
from jobgen.train.prepare import Prepared, model_hidden_size
from jobgen.train.schedule import LRFactor, check_schedule_total, total_steps_of
from jobgen.train.stop import StopRequest, signal_name
from jobgen.train.store import StoredDataset, cut_summary, ensure_eval_store, ensure_store, preparer_rank
from jobgen.train.trackers import Trackers

log = logging.getLogger("jobgen.train")


def template_digest(template: str) -> str:
    return digest(template)


def check_chat_template(found_state: dict, chat: ChatTokenizer, checkpoint_name: str) -> None:
    """A resumed run must train in the layout its checkpoint trained in. Checkpoints written before
    the chat template was recorded were all trained in ChatML."""
    saved = found_state.get("chat_template", template_digest(CHATML))
    if saved == template_digest(chat.chat_template):
        return
    was = "ChatML" if saved == template_digest(CHATML) else "another chat template"
    fix = "set training.chat_template: chatml" if was == "ChatML" else "restore the template it was trained with"
    raise UserError(
        f"training.chat_template: checkpoint {checkpoint_name} was trained in {was}, this job trains in "
        f"{chat.template_name}; {fix} to resume, or use a new training.output_dir to start in the new layout"
    )


class Trainer:
    def __init__(self, prepared: Prepared, info: RankInfo, stop: StopRequest, report: ExitReport) -> None:
        self.p, self.info, self.stop, self.report = prepared, info, stop, report
        self.t = prepared.training
        self._slowest_step = 0.0
        self._warned_slow_stop = False
        self.best: Optional[BestSoFar] = None  # training.keep_best: set in run()
        self._evaluated_step: Optional[int] = None  # the newest step evaluated (keep_best: in each checkpoint)
        self.clock = StartupClock()  # from the process's start: a restart's cost, phase by phase
        self.beat = Heartbeat(info.rank, health.node_name())  # what the node's hang supervisor reads
        self.eval_set: Optional[StoredDataset] = None  # mapped in the data phase
        self.init_source: Optional[init_from.Source] = None  # training.init_from, on a run with no checkpoint yet

    # --------------------------------------------------------------- set-up
    def run(self) -> None:
        clock = self.clock
        clock.mark("start and job check")
        keep_bitsandbytes_out(self.t.method)
        deepspeed = import_deepspeed()
        import torch
        import transformers  # noqa: F401 - imported here, so that "imports" holds every import

        if self.t.method != "full":
            import peft  # noqa: F401

        clock.mark("imports")
        deepspeed.utils.logger.setLevel(logging.WARNING)
        timeout = self.p.job.launch.collective_timeout_minutes
        dist = self.dist = Distributed(self.info, self.p.placement, timeout)
        if dist.is_main:
            log.info("process group: %d ranks over %s; a collective fails after %d min (launch.collective_timeout_minutes)",
                     dist.world_size, dist.backend, timeout)
            if "JOBGEN_PG_TIMEOUT_MINUTES" in os.environ:  # what set it before the job's field
                log.warning("JOBGEN_PG_TIMEOUT_MINUTES is set but no longer read: set launch.collective_timeout_minutes in the job")
        t = self.t
        os.makedirs(self.p.output_dir, exist_ok=True)
        store = self.store = ckpt.CheckpointStore(os.path.join(self.p.output_dir, "checkpoints"), dist, t.keep_checkpoints)
        self.saves = BackgroundSaves(store, on_commit=self._committed_in_background) if t.async_save else None
        self.snapshots: Optional[PeerSnapshots] = None
        error: Optional[BaseException] = None
        found = None
        try:
            store.remove_stale_temps()
            if t.snapshot_steps():
                self.snapshots = self._peer_snapshots(store)
            found = store.find_latest()
            if found is not None:
                ckpt.check_compatible(found, self.p.config_digest, self._changed_fields(found))
            # Only a run without a checkpoint of its own starts from init_from, checked before any weight is read.
            self.init_source = init_from.check(t, t.init_from) if t.init_from and found is None else None
            self.global_batch = self._global_batch(found)
            self.micro, self.accumulation = split_global_batch(
                self.global_batch, dist.world_size, t.per_device_batch_size, self.p.job.procs_per_node
            )
            self.p.ds_config = build_config(
                t, dist.world_size, self.p.precision, t.deepspeed_config, self.micro, self.accumulation,
                **model_hidden_size(t.model, t.model_revision),
            )
            notice = compiled_op_notice(self.p.ds_config, t.deepspeed_config or "the bundled config")
            if notice and dist.is_main:
                log.warning("%s", notice)
        except UserError as exc:
            error = exc
        dist.raise_together(error)
        if self.init_source is not None and self.init_source.kind == "checkpoint":
            # Every file's sha256, the hashing spread over the ranks as a resume's is: never a damaged checkpoint.
            problem = ckpt.CheckpointStore(os.path.dirname(t.init_from), dist, t.keep_checkpoints).problem_with(t.init_from)
            if problem:
                dist.raise_together(UserError(f"training.init_from: checkpoint {t.init_from!r} does not match its "
                                              f"manifest ({problem}); give another checkpoint of that run"))
        elif t.init_from and found is not None and dist.is_main:
            log.info("training.init_from not read: this run resumes from its own checkpoint %s", found.path)
        self.report.checkpoint = found.path if found else None
        # The best by eval loss as the resumed checkpoint knew it (keep_best), and best.json to match.
        self.best = BestSoFar.from_state(found.state if found else None) if t.keep_best else None
        if self.best is not None and dist.is_main:
            restore_pointer(store.root, self.best, ckpt.step_name, store.is_complete)
        self._evaluated_step = found.state.get("evaluated_step") if found else None
        clock.mark("process group")
        if self.p.job.launch.health_check:
            # Before any weight is read: a node that differs ends the job here, in seconds.
            health.check(dist, self.p.run_dir, t.data, t.model, self.p.job.resources.gpus_per_node, self.beat.progress)
            clock.mark("health check")

        _seed_all(t.seed)  # the same initial weights (LoRA init included) on every rank
        # Loaded once, by the data phase only if it tokenizes; the final save needs it anyway.
        tokenizer = functools.lru_cache(maxsize=None)(
            lambda: load_tokenizer(t.model, t.model_revision, trust_remote_code=t.trust_remote_code))
        try:
            if dist.is_main and t.trust_remote_code:
                log.info("training.trust_remote_code: running the code that %s ships: %s", self.p.job.training.model,
                         ", ".join(code_files_of(t.model, t.model_revision)) or "none (transformers builds it)")
            chat = None
            if found is not None:  # a checkpoint resumes in its own chat layout only: said before any data work
                chat = ChatTokenizer(tokenizer(), t.max_length, t.chat_template, self.p.job.training.model)
                check_chat_template(found.state, chat, os.path.basename(found.path))
            batches = self._batches(tokenizer)
        except UserError as exc:
            error = exc
        dist.raise_together(error)
        clock.mark("data")
        try:
            self.tokenizer = tokenizer()
            chat = self.chat = chat or ChatTokenizer(self.tokenizer, t.max_length, t.chat_template, self.p.job.training.model)
            if dist.is_main:
                log.info("chat template: %s", chat.template_name)
            self.evaluation = None
            if self.eval_set is not None:
                self.evaluation = Evaluation(self.eval_set, dist.world_size, dist.rank, t.per_device_batch_size)
            loading = time.perf_counter()
            model = load_model(t, self.p.precision, dist.device, self.p.ds_config)
            if dist.is_main:
                log.info("model %s loaded in %.1f s", t.model, time.perf_counter() - loading)
                self._pin_downloaded_model()
        except UserError as exc:
            error = exc
        dist.raise_together(error)
        clock.mark("model load")

        order = batches.order
        steps_per_epoch = order.steps_per_epoch
        total_steps = total_steps_of(t, steps_per_epoch)
        factor = LRFactor(t.lr_schedule, t.warmup_of(total_steps), total_steps)
        if found is not None:
            try:
                check_schedule_total(found.state, factor, os.path.basename(found.path))
            except UserError as exc:
                error = exc
            dist.raise_together(error)
        trainable = [p for p in model.parameters() if p.requires_grad]
        engine, _, _, scheduler = deepspeed.initialize(
            model=model,
            model_parameters=trainable,
            # Every save's tag is the same constant (ckpt.DEEPSPEED_TAG): DeepSpeed's check that the
            # ranks agree on it is two all-reduces in every save and peer snapshot, for nothing. Not in
            # ds_config itself, whose digest older checkpoints carry.
            config={**self.p.ds_config, "checkpoint": {**self.p.ds_config.get("checkpoint", {}), "tag_validation": "Ignore"}},
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor),
        )
        self.engine, self.scheduler = engine, scheduler
        clock.mark("deepspeed init")
        first_step = 0
        if found is not None:
            loading = time.perf_counter()
            store.load(engine, found, scheduler, t.seed)
            first_step = int(found.state["step"])
            if dist.is_main:
                written_by = int(found.manifest["world_size"])
                resharded = "" if written_by == dist.world_size else f", written by {written_by} ranks, resharded to {dist.world_size}"
                log.info("resumed from %s (step %d%s); checkpoint loaded in %.1f s", found.path, first_step, resharded,
                         time.perf_counter() - loading)
        else:
            if self.init_source is not None:
                loading = time.perf_counter()
                init_from.load(engine, self.init_source, dist.rank)
                if dist.is_main:
                    log.info("initialized from %s %s (weights only: step 0, a fresh optimizer and this job's schedule) "
                             "in %.1f s", self.init_source.kind, self.init_source.path, time.perf_counter() - loading)
            _seed_all(t.seed + dist.rank)  # per-rank streams for dropout and anything else random
        clock.mark("checkpoint load")
        self.report.first_step = self.report.last_step = first_step
        if dist.is_main:
            log.info(
                "%s, ZeRO-%d, %s, world %d, %d steps (%d per epoch), %d trainable parameters in %s",
                t.method, t.zero_stage, self.p.precision, dist.world_size, total_steps, steps_per_epoch,
                _count(trainable), _dtype_names(engine.module),
            )
            log.info("global batch %d = %d ranks x micro-batch %d x %d accumulation", self.global_batch,
                     dist.world_size, self.micro, self.accumulation)
        self._loop(engine, batches, first_step, total_steps)

    def _peer_snapshots(self, store: ckpt.CheckpointStore) -> Optional[PeerSnapshots]:
        """Collective: first, after a failure nobody announced, the newest step the nodes of this
        world hold whole, written out as a checkpoint if it is newer than the newest on disk; then
        the snapshots of this run. None, said once, where a node cannot keep them."""
        dist = self.dist
        node = health.node_name()
        folder = peer_snapshot.node_folder(self.p.output_dir, node)
        problems = [p for p in dist.all_gather_object(peer_snapshot.usable_folder(folder)) if p]
        if problems:
            if dist.is_main:
                log.warning("training.snapshot_every: no snapshots in this segment, as a node cannot keep them (%s); "
                            "set JOBGEN_SNAPSHOT_DIR to a node-local folder it can write", problems[0])
            return None
        token = peer_snapshot.run_token(store)
        peer_snapshot.promote(store, folder, token, node)
        return PeerSnapshots(dist, folder, token, node)

    def _batches(self, tokenizer: Any) -> MicroBatches:
        """The prepared store, made by rank 0 (or found: a restart, `jobgen prepare`, another job),
        mapped by every rank; other ranks poll, not wait in a collective."""
        t, dist = self.t, self.dist
        preparer = preparer_rank(self.info.rank)
        started = time.perf_counter()

        def progress_line(text: str) -> None:
            log.info("data: %s", text)

        def still_waiting(seconds: float) -> None:
            log.info("data: waiting %.0f s for rank 0 to prepare the store", seconds)

        from jobgen.train.encode import Progress

        shown = Progress(progress_line)

        def progress(done: int, total: int, tokens: int) -> None:
            self.beat.progress(done)  # a preparation longer than the start-up bound is not a hang
            shown(done, total, tokens)

        dataset, outcome = ensure_store(t, self.p.run_dir, tokenizer, preparer, progress=progress if preparer else None,
                                        waiting=still_waiting, hashing=self.beat.progress)
        # The eval set: eval_fraction's part of this store, or eval_data's own store.
        self.eval_set, eval_outcome = ensure_eval_store(t, self.p.run_dir, tokenizer, preparer, dataset,
                                                        progress=progress if preparer else None, waiting=still_waiting)
        rows = dataset.packed_rows(t.max_length, t.seed, preparer) if t.packing else None
        if dist.is_main:
            meta = dataset.meta
            said = {"found": "found, preparation skipped", "waited": "prepared by another process",
                    "prepared": f"prepared here in {meta['seconds']:.1f} s with {meta['processes']} processes "
                                f"({meta['tokens'] / max(meta['seconds'], 1e-6) / 1e6:.2f} M tokens/s)"}[outcome]
            cut = cut_summary(meta, t.max_length)
            log.info("data: store %s (%d conversations, %d tokens%s): %s; ready in %.2f s", dataset.path,
                     meta["conversations"], meta["tokens"], f"; {cut}" if cut else "", said, time.perf_counter() - started)
            if self.eval_set is not None:
                held = self.eval_set.meta
                cut = cut_summary(held, t.max_length)
                where = (f"training.eval_data, store {self.eval_set.path} ({eval_outcome})" if t.eval_data else
                         f"eval_fraction {t.eval_fraction} of training.data held out by seed {t.seed}")
                log.info("data: eval set %d conversations, %d tokens%s: %s", held["conversations"], held["tokens"],
                         f"; {cut}" if cut else "", where)
        return MicroBatches.build(
            dataset, self.global_batch, dist.world_size, dist.rank, self.micro, self.accumulation, t.seed,
            t.group_by_length, t.max_length if t.packing else None, rows,
        )

    def _global_batch(self, found: Optional[ckpt.Found]) -> int:
        """The checkpoint's global batch when resuming (a run keeps its batch whatever its world
        size), else the job's. Raises UserError if the job names another one."""
        t = self.t
        if found is None:  # the job's, on the smallest world size of a node range
            return self.p.job.global_batch
        saved = found.state.get("global_batch")
        if saved is None:  # written before the global batch was recorded: by its own world size
            saved = t.per_device_batch_size * t.gradient_accumulation * int(found.manifest["world_size"])
        if t.global_batch_size is not None and t.global_batch_size != saved:
            raise UserError(
                f"training.global_batch_size: checkpoint {os.path.basename(found.path)} trained with {saved} samples "
                f"per step, this job says {t.global_batch_size}: set global_batch_size: {saved} (or remove it) to resume, "
                "or use a new training.output_dir to start a run with the new batch"
            )
        return int(saved)

    def _pin_downloaded_model(self) -> None:
        """Rank 0: a hub model not in the cache at the start (not pinned) was downloaded by its
        load; the commit it came at is pinned now, so that the run's restarts load it too."""
        t = self.t
        if needs_pin(t.model, t.model_revision):
            cached = look_up(t.model, t.model_revision, environment_cache())
            if cached.staged:
                pin_commit(self.p.run_dir, t.model, t.model_revision, cached.commit)

    def _changed_fields(self, found: ckpt.Found) -> list[str]:
        saved = found.state.get("training", {})
        now = self.p.resume_fields
        return sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k)) or ["deepspeed config"]

    # ----------------------------------------------------------------- loop
    def _loop(self, engine: Any, batches: MicroBatches, first_step: int, total_steps: int) -> None:
        dist, t, p = self.dist, self.t, self.p
        dataset, order = batches.dataset, batches.order
        accumulation = batches.accumulation
        # Only rank 0 reports; its refusal (a run's MLflow store moved) ends every rank together.
        trackers, error = None, None
        try:
            if dist.is_main:
                trackers = Trackers(t.trackers(), p.run_dir, p.output_dir, p.job.name,
                                    p.job.training.model_dump(mode="json"))
        except UserError as exc:
            error = exc
        dist.raise_together(error)
        metrics = MetricsWriter(p.output_dir, dist.is_main, total_steps, first_step, trackers)
        sample_log = _sample_log(p.output_dir, dist.rank)
        engine.train()
        interval = {"loss_x_tokens": 0.0, "tokens": 0.0, "inputs": 0.0, "samples": 0.0, "seconds": 0.0}
        loop_start = time.perf_counter()
        step = first_step
        self._evaluate_what_a_stop_skipped(engine, first_step, total_steps, metrics, order.steps_per_epoch)
        stop = self._agree_stop(step)  # a signal during start-up stops before the first step
        try:
            while step < total_steps and not stop:
                started = time.perf_counter()
                loss_x_tokens, tokens, inputs, samples = 0.0, 0, 0, 0
                epoch, index = divmod(step, order.steps_per_epoch)
                # Every rank knows the whole step's labelled tokens from the order alone.
                step_tokens = batches.step_label_tokens(epoch, index)
                for micro in range(accumulation):
                    units = batches.units(epoch, index, micro)
                    # The last step of an epoch may leave a rank nothing: it runs the step's first
                    # unit with weight 0, as every rank must join the step's collectives.
                    weight = 1.0 if units else 0.0
                    indices = batches.samples(units)
                    cpu_batch = batches.collate(units or order.step(epoch, index)[:1])
                    # Counted on the host copy, so the GPU path has no extra synchronisation.
                    n = int((cpu_batch["labels"][:, 1:] != -100).sum()) if units else 0
                    inputs += dataset.tokens(indices)
                    samples += len(indices)
                    batch = {k: v.to(dist.device, non_blocking=True) for k, v in cpu_batch.items()}
                    if sample_log and indices:
                        sample_log.write(json.dumps({"epoch": epoch, "step": step + 1, "ids": [dataset.ids[i] for i in indices]}) + "\n")
                    loss_sum = _token_loss_sum(engine, batch) * weight
                    # DeepSpeed averages gradients over the ranks; no division by the rounds here.
                    engine.backward(loss_sum * (dist.world_size / max(step_tokens, 1)), scale_wrt_gas=False)
                    engine.step()
                    loss_x_tokens = loss_x_tokens + loss_sum.detach()
                    tokens += n
                    self.beat.micro(micro + 1)
                loss_x_tokens = float(loss_x_tokens)
                compute_seconds = time.perf_counter() - started
                step += 1
                if p.step_delay:
                    time.sleep(p.step_delay)  # testing aid: lets a test interrupt a tiny run mid-way
                writing = self.saves is not None and self.saves.busy
                self.beat.beat(step, "training", waiting=True, writing=writing)
                rows = dist.all_gather_floats(
                    [loss_x_tokens, tokens, inputs, samples, compute_seconds,
                     *peak_memory_mb(dist.cuda), host_peak_mb(), float(self.stop.signum),
                     float(self.snapshots is not None and self.snapshots.busy)]
                )
                self.beat.beat(step, "training", writing=writing)
                check_finite(step, [row[0] for row in rows], self.report.checkpoint)
                stop = self._note_signal(max(int(row[8]) for row in rows))
                self._slowest_step = max(row[4] for row in rows)
                wall = time.perf_counter() - started - p.step_delay
                for key, column in (("loss_x_tokens", 0), ("tokens", 1), ("inputs", 2), ("samples", 3)):
                    interval[key] += sum(row[column] for row in rows)
                interval["seconds"] += wall
                self.report.last_step = step
                if step == first_step + 1:
                    self._record_startup(first_step)
                evaluated = {}
                if self.evaluation and not stop and self._eval_due(step, total_steps):
                    evaluated = self._evaluate(engine, step)
                # Every rank has the same eval loss, so all agree on a new best and save it together.
                new_best = bool(evaluated) and self.best is not None and self.best.offer(step, evaluated["eval_loss"])
                if step % t.logging_interval == 0 or step == total_steps or stop or evaluated:
                    # Rank 0 alone, the others waiting in the next step: its own phase, so that a
                    # slow tracker server is not taken for a hang (heartbeat.REPORT_SECONDS).
                    if metrics.enabled:
                        self.beat.beat(step, "reporting", writing=writing)
                    metrics.write({
                        "step": step,
                        "time": time.time(),
                        "epoch": step / order.steps_per_epoch,
                        "loss": interval["loss_x_tokens"] / max(interval["tokens"], 1.0),
                        "lr": self.scheduler.get_last_lr()[0],
                        "tokens": int(interval["inputs"]),
                        "tokens_per_s": interval["inputs"] / interval["seconds"],
                        "samples_per_s": interval["samples"] / interval["seconds"],
                        "step_seconds_max": max(row[4] for row in rows),
                        "step_seconds_min": min(row[4] for row in rows),
                        "peak_memory_mb": max(row[5] for row in rows),
                        **({"peak_reserved_mb": max(row[6] for row in rows), "host_peak_mb": max(row[7] for row in rows)}
                           if dist.cuda else {}),
                        **evaluated,
                    })
                    self.beat.beat(step, "training", writing=writing)
                    interval = dict.fromkeys(interval, 0.0)
                saved, last = stop or step % t.save_interval == 0 or step == total_steps or new_best, stop or step == total_steps
                if saved:
                    self._save_checkpoint(step, order, wait=last)
                # A checkpoint written in the background holds its step only once committed: a node
                # lost before then would cost that step, unless its snapshot is held too.
                in_background = saved and not last and self.saves is not None
                if self.snapshots is not None and (in_background or (not saved and step % t.snapshot_steps() == 0)):
                    if max(row[9] for row in rows):  # a rank's previous snapshot is still on its way: never wait
                        self.snapshots.skipped += 1
                    else:
                        self.snapshots.take(engine, step, self._checkpoint_state(step, order))
        finally:
            self.report.train_seconds = round(time.perf_counter() - loop_start, 3)
            metrics.close(completed=step >= total_steps and not stop)
            if sample_log:
                sample_log.close()
        if self.saves:
            self.saves.wait()  # a stop or the end: the save in flight is committed before anything else
        if self.snapshots is not None:
            self.snapshots.wait()  # every peer is alive to finish its exchange; none left mid-way at exit
            if dist.is_main:
                log.info("snapshots: %s", self.snapshots.summary())
        if stop:
            if self.report.checkpoint is None or not self.report.checkpoint.endswith(ckpt.step_name(step)):
                self._save_checkpoint(step, order)  # stopped before any step ran, on a fresh start
            self.report.reason = "stopped"
            self.report.message = f"stopped by {self._signal_text()} at step {step}; resume continues from {self.report.checkpoint}"
            return
        if not (self.report.checkpoint or "").endswith(ckpt.step_name(step)):
            self._save_checkpoint(step, order)
        self.beat.beat(step, "saving")
        final = self._save_final()
        if self.snapshots is not None:
            self.snapshots.close(completed=True)
        self.report.reason = "completed"
        self.report.message = f"completed {step} steps; final model in {final}{self._save_best(step)}"

    def _record_startup(self, first_step: int) -> None:
        self.clock.mark("first step")
        if self.dist.is_main:
            entry = self.clock.record(self.p.output_dir, first_step)
            log.info("start to step %d in %.1f s: %s", first_step + 1, entry["total"], self.clock.summary())

    def _agree_stop(self, step: int) -> bool:
        rows = self.dist.all_gather_floats([float(self.stop.signum)])
        return self._note_signal(max(int(row[0]) for row in rows))

    def _note_signal(self, signum: int) -> bool:
        """Record the signal any rank received (the largest number if several); True to stop."""
        if signum:
            self.report.signal = signal_name(signum)
        return signum != 0

    def _signal_text(self) -> str:
        return self.report.signal or "a signal"

    def _eval_due(self, step: int, total_steps: int) -> bool:
        return step % (self.t.eval_interval or self.t.save_interval) == 0 or step == total_steps

    def _evaluate_what_a_stop_skipped(self, engine: Any, step: int, total_steps: int, metrics: MetricsWriter,
                                      steps_per_epoch: int) -> None:
        """Collective, keep_best: a stop skips its step's evaluation; run it on resuming from that
        step's checkpoint (the same weights), so the best is the uninterrupted run's. Its line in
        metrics.jsonl has the eval fields and no training ones (the step's were logged before the stop)."""
        if self.best is None or not self.evaluation or not step or not self._eval_due(step, total_steps):
            return
        if self._evaluated_step == step:
            return
        evaluated = self._evaluate(engine, step)
        metrics.write({"step": step, "time": time.time(), "epoch": step / steps_per_epoch, **evaluated})
        if self.best.offer(step, evaluated["eval_loss"]) and self.dist.is_main:
            write_pointer(self.store.root, ckpt.step_name(step), self.best.as_state())  # the checkpoint resumed from

    def _evaluate(self, engine: Any, step: int) -> dict:
        """Collective: the eval set's loss (jobgen.train.evaluation), logged by rank 0."""
        started = time.perf_counter()
        result = self.evaluation.run(engine, self.dist, _token_loss_sum,
                                     lambda round_: self.beat.beat(step, f"evaluating {round_}"))
        self.beat.beat(step, "training")
        self._evaluated_step = step
        if self.dist.is_main:
            log.info("eval at step %d: loss %.4f, perplexity %.2f over %d tokens (%.1f s)", step, result["eval_loss"],
                     result["eval_perplexity"], result["eval_tokens"], time.perf_counter() - started)
        return result

    # -------------------------------------------------------------- outputs
    def _save_checkpoint(self, step: int, order: BatchOrder, wait: bool = True) -> None:
        """Collective. With training.async_save, training resumes after the snapshot unless `wait`."""
        state = self._checkpoint_state(step, order)
        started = time.perf_counter()
        self.beat.beat(step, "saving")
        try:
            self._save(step, state, wait, started)
        finally:
            self.beat.beat(step, "training", writing=self.saves is not None and self.saves.busy)

    def _checkpoint_state(self, step: int, order: BatchOrder) -> dict:
        """What trainer_state.json keeps of `step`, in a checkpoint and in a peer snapshot alike."""
        epoch, consumed = divmod(step, order.steps_per_epoch)
        state = {
            "epoch": epoch,
            "steps_in_epoch": consumed,
            # What a resume on any world size keeps; the split is only this run's.
            "global_batch": order.global_batch,
            "split": {"micro_batch": self.micro, "accumulation": self.accumulation},
            "config_digest": self.p.config_digest,
            "training": self.p.resume_fields,
            "lr_scheduler": self.scheduler.state_dict(),
            "chat_template": template_digest(self.chat.chat_template),
        }
        if self.best is not None:  # keep_best: what a resume compares the next eval loss with
            state.update(best=self.best.as_state(), evaluated_step=self._evaluated_step)
        return state

    def _save(self, step: int, state: dict, wait: bool, started: float) -> None:
        if self.saves:
            waited = self.saves.start(self.engine, step, state)
            if self.dist.is_main:
                log.info("checkpoint of step %d: training paused %.2f s (%.2f s of it waiting for the previous save); "
                         "writing in the background", step, time.perf_counter() - started, waited)
            if wait:
                self.saves.wait()
            return
        self.report.checkpoint = self.store.save(self.engine, step, state)
        seconds = time.perf_counter() - started
        if self.dist.is_main:
            log.info("checkpoint %s (%.1f s)", self.report.checkpoint, seconds)
            self._warn_if_stop_is_too_slow(seconds)

    def _committed_in_background(self, path: str, seconds: float) -> None:
        """Runs in the save thread of every rank: the newest complete checkpoint is `path`."""
        self.report.checkpoint = path
        if self.dist.is_main:
            log.info("checkpoint %s (written in the background in %.1f s)", path, seconds)
            # A stop may find a save in flight: it waits for it, then saves its own step.
            self._warn_if_stop_is_too_slow(2 * seconds)

    def _warn_if_stop_is_too_slow(self, save_seconds: float) -> None:
        """Once: a stop must finish a step and a checkpoint inside the requeue warning."""
        requeue = self.p.job.requeue
        if self._warned_slow_stop or not requeue.enabled:
            return
        needed = self._slowest_step + save_seconds
        if needed > requeue.warning_seconds * 0.8:
            self._warned_slow_stop = True
            log.warning(
                "a graceful stop needs about %.0f s (one step %.0f s + checkpoint %.0f s), close to or over "
                "requeue.warning_seconds (%d): raise it, or the scheduler may kill the job before the checkpoint",
                needed, self._slowest_step, save_seconds, requeue.warning_seconds,
            )

    def _save_best(self, last_step: int) -> str:
        """Collective, after the final save: the best checkpoint's weights in OUTPUT_DIR/best
        (keep_best); the end of the report's line, saying where and from which step."""
        best = self.best
        if best is None or best.step is None:
            return ""
        if best.step != last_step:  # the engine holds the last step's weights: load the best's
            found = self.store.find_step(best.step)
            if found is None:
                return f"; the best checkpoint (step {best.step}) could not be read, so no best model was saved"
            self.store.load(self.engine, found, self.scheduler, self.t.seed)
        path = self._save_final(BEST_MODEL)
        if self.dist.is_main:
            log.info("best eval loss %.4f at step %d: saved to %s", best.loss, best.step, path)
        return f"; best (eval loss {best.loss:.4f} at step {best.step}) in {path}"

    def _save_final(self, name: str = FINAL_MODEL) -> str:
        """Collective: adapters (lora/qlora) or the full model, plus tokenizer, in OUTPUT_DIR/`name`."""
        import shutil

        from jobgen.files import fsync_directory

        dist, engine = self.dist, self.engine
        final = os.path.join(self.p.output_dir, name)
        temp = os.path.join(self.p.output_dir, f".tmp-{name}")
        state_dict = None
        if self.t.zero_stage == 3:
            state_dict = _zero3_weights_to_save(engine, adapters_only=self.t.method != "full")
        if dist.is_main:
            shutil.rmtree(temp, ignore_errors=True)
            engine.module.save_pretrained(temp, state_dict=state_dict)
            # The layout it was trained in, so that inference writes conversations the same way.
            self.tokenizer.chat_template = CHATML_JINJA if self.chat.chat_template == CHATML else self.chat.chat_template
            self.tokenizer.save_pretrained(temp)
            if os.path.exists(final):
                old = os.path.join(self.p.output_dir, f".tmp-old-{name}")
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
                shutil.rmtree(old, ignore_errors=True)
            os.rename(temp, final)
            fsync_directory(self.p.output_dir)
        dist.barrier()
        return final


def _zero3_weights_to_save(engine: Any, adapters_only: bool) -> Optional[dict]:
    """Collective: the 16-bit weights rank 0 saves (None on the others). An adapter gathers only its
    own parameters; consolidating the whole model would bring every frozen base weight to rank 0
    (16 GB for an 8B model) to keep a few MB of them."""
    if not adapters_only:
        return engine._zero3_consolidated_16bit_state_dict()
    import deepspeed

    named = [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        if engine.global_rank == 0:
            return {name: p.detach().to("cpu", copy=True) for name, p in named}
    return None


# Cross-entropy is taken over chunks of about this many logits, each recomputed in the backward
# pass: an fp32 copy of whole [batch, length, vocabulary] logits is gigabytes with a 128k-152k
# vocabulary (1 GB per 2048-token sequence, twice over with log-softmax), a chunk is 256 MB.
LOSS_CHUNK_ELEMENTS = 2**26


def _token_loss_sum(engine: Any, batch: dict) -> Any:
    """Sum of the token cross-entropies over labelled tokens (labels are -100 elsewhere)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    # Packed batches carry position_ids and no attention_mask (see jobgen.train.data).
    logits = engine(**{k: v for k, v in batch.items() if k != "labels"}).logits
    # Position t predicts label t+1: shift the labels, not the logits, so the logits stay a view.
    labels = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100).reshape(-1)
    logits = logits.reshape(-1, logits.size(-1))
    rows = max(1, LOSS_CHUNK_ELEMENTS // logits.size(-1))
    if rows >= logits.size(0):
        return _cross_entropy_sum(logits, labels)
    total = logits.new_zeros((), dtype=torch.float32)
    for start in range(0, logits.size(0), rows):
        total = total + checkpoint(_cross_entropy_sum, logits[start:start + rows], labels[start:start + rows], use_reentrant=False)
    return total


def _cross_entropy_sum(logits: Any, labels: Any) -> Any:
    import torch

    return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")


def check_finite(step: int, losses: list[float], checkpoint: Optional[str]) -> None:
    """Before anything is saved: a non-finite loss (computed in fp32) on any rank ends the run, so
    no checkpoint of diverged weights replaces the last good one. A non-finite gradient is
    DeepSpeed's to skip (its overflow check, on for bf16 and fp16)."""
    if not all(math.isfinite(v) for v in losses):
        raise NotFinite(
            f"training diverged at step {step}: the loss is not finite (lower "
            f"training.learning_rate, or use bf16 instead of fp16); the last checkpoint, {checkpoint or 'none'}, is kept"
        )


def _count(parameters: list) -> int:
    """Elements of the whole parameters: under ZeRO-3 a rank's tensor is empty and ds_numel counts them."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in parameters)


def _dtype_names(module: Any) -> str:
    """The dtypes the trainable parameters are held in, as the engine holds them ("bfloat16")."""
    return "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters() if p.requires_grad}))


def _seed_all(seed: int) -> None:
    ckpt.seed_everything(seed)


def _sample_log(output_dir: str, rank: int):
    """Testing aid (JOBGEN_DEBUG_SAMPLE_LOG=1): each rank appends the ids of every micro-batch it trains on."""
    if os.environ.get("JOBGEN_DEBUG_SAMPLE_LOG", "") not in ("", "0"):
        return open(os.path.join(output_dir, f"samples-rank{rank}.jsonl"), "a", buffering=1, encoding="utf-8")
    return None
