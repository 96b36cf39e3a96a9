"""A run's own text log, ``{log_dir}/run.log`` (``log_dir`` defaults to ``{run}/logs``): how the run
started, one summary line per step as XTuner prints them, and what an operator must know (dataset
rows skipped, failed samples, skipped groups, worker errors, restarts and retries).

Every line is ``TIME LEVEL message``. ``STEP`` lines are the per-step summaries (the console's
progress bar shows the same); ``INFO``, ``WARNING`` and ``ERROR`` lines are also what the console
prints beside the bar. A failure is one ``ERROR`` line (what failed, why, what happens next) followed
by its full traceback, a worker's included, as ``TRACE`` lines that the console does not show. The
file is read back through fsspec, so it works on object storage too, where it is rewritten whole (a
few hundred bytes a step) because objects cannot be appended to.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Callable, Mapping

import fsspec

from trellis.engine.errors import describe_failure
from trellis.engine.secrets import redact
from trellis.engine.storage.checkpoints import SaveStore, is_local
from trellis.engine.storage.store import Store

FILE_NAME = "run.log"
CONSOLE_LEVELS = ("INFO", "WARNING", "ERROR")
TRACE = "TRACE"


def run_log_uri(log_dir: str) -> str:
    return f"{log_dir.rstrip('/')}/{FILE_NAME}"


class RunLog:
    """Appends lines to one run's log. One instance per process; lines from several threads are
    serialised."""

    def __init__(self, log_dir: Store) -> None:
        self.uri = run_log_uri(log_dir.uri)
        self._fs, self._path = Store(self.uri, log_dir.options).fs()
        self._local = is_local(self._fs)
        self._lock = threading.Lock()
        self._text: str | None = None  # object storage: what the file holds, to rewrite it whole
        self.total_steps: int | None = None  # for "step N/TOTAL", once the run plan is known
        # Also told each line but TRACE ones, secrets masked, as (level, text): the flow's Prefect logger.
        self.listeners: list[Callable[[str, str], None]] = []

    def write(self, level: str, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        masked = [redact(line) for line in message.splitlines() or [""]]
        lines = "".join(f"{stamp} {level} {line}\n" for line in masked)
        if level != TRACE:
            for listener in list(self.listeners):
                listener(level, "\n".join(masked))
        with self._lock:
            self._fs.makedirs(self._path.rsplit("/", 1)[0], exist_ok=True)
            if self._local:
                with self._fs.open(self._path, "a") as handle:
                    handle.write(lines)
                return
            if self._text is None:
                self._text = _read_text(self._fs, self._path) or ""
            self._text += lines
            with self._fs.open(self._path, "w") as handle:
                handle.write(self._text)

    def info(self, message: str) -> None:
        self.write("INFO", message)

    def warning(self, message: str) -> None:
        self.write("WARNING", message)

    def error(self, message: str) -> None:
        self.write("ERROR", message)

    def step(self, message: str) -> None:
        self.write("STEP", message)


def read_run_log(source: Store) -> str | None:
    return _read_text(*source.fs())


def _read_text(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    try:
        with fs.open(path, "r") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def _entries(text: str, levels: tuple[str, ...]) -> list[tuple[str, str]]:
    entries = []
    for line in text.splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4 and parts[2] in levels:
            entries.append((parts[2], parts[3]))
    return entries


def console_lines(text: str) -> list[str]:
    """The lines of a run log the console shows beside its progress bar (not the step summaries)."""
    return [message if level == "INFO" else f"{level.lower()}: {message}" for level, message in _entries(text, CONSOLE_LEVELS)]


def error_lines(text: str) -> list[str]:
    return [message for _, message in _entries(text, ("ERROR",))]


def step_summary(step: int, total: int, metrics: Mapping[str, float]) -> str:
    """XTuner's one line per step: reward, response length, eval, throughput and where time went."""
    parts = [f"step {step}/{total}" if total else f"step {step}"]

    def add(label: str, key: str, spec: str = ".3f") -> None:
        if key in metrics:
            parts.append(f"{label} {metrics[key]:{spec}}")

    add("reward", "response/rewards/mean")
    add("response_len", "response/response_len/mean", ".1f")
    add("eval", "eval/accuracy")
    add("tokens/s", "throughput/effective_tgs", ".0f")
    add("step_s", "time/step", ".2f")
    if "goodput/percent" in metrics:
        parts.append(f"goodput {metrics['goodput/percent']:.0f}%")
    timed = ("produce_batch", "get_batch", "fit", "sync_weights", "evaluate")
    phases = [f"{name} {metrics[f'time/{name}']:.2f}" for name in timed if f"time/{name}" in metrics]
    if phases:
        parts.append(f"({', '.join(phases)})")
    return "  ".join(parts)


def step_warnings(step: int, metrics: Mapping[str, float]) -> list[str]:
    """What a step did that a user should hear of: failed samples, groups left out of training, replaced engines."""
    warnings = []
    failed = int(metrics.get("rollout/failed_samples", 0))
    if failed:
        warnings.append(f"step {step}: {failed} sample(s) failed (reward or rollout error; see status/error_msg in the lake)")
    skipped = int(metrics.get("response/skipped_groups", 0))
    if skipped:
        warnings.append(f"step {step}: {skipped} group(s) left out of training (a failed sample in the group)")
    replaced = int(metrics.get("health/replaced_engines", 0))
    if replaced:
        warnings.append(f"step {step}: the health check replaced {replaced} rollout engine(s) "
                        f"({int(metrics.get('health/hung_engines', 0))} hung, the others dead) before the weight sync")
    return warnings


class RunLogHandler(logging.Handler):
    """Sends the engine's own warnings (worker replaced, group skipped...) to the run log."""

    def __init__(self, run_log: RunLog, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.run_log = run_log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.run_log.write(record.levelname, record.getMessage())
        except Exception:  # a log that cannot be written must never fail the run
            self.handleError(record)


_logs: dict[str, RunLog] = {}
_logs_lock = threading.Lock()


def run_log_for(config) -> RunLog:
    """This process's log of ``config``'s run (one instance per file, shared by threads)."""
    with _logs_lock:
        uri = run_log_uri(config.log_uri)
        if uri not in _logs:
            _logs[uri] = RunLog(Store(config.log_uri, config.storage_options))
        return _logs[uri]


def record_start(config, plan, attempt: int = 1) -> None:
    """How the run starts, and the dataset rows it could not use."""
    log = run_log_for(config)
    log.total_steps = plan.total_steps
    start = plan.start
    if start.action == "fresh":
        where = f"a fresh start, {plan.total_steps} steps"
    elif start.action == "restore":
        where = f"from checkpoint {start.checkpoint} (step {start.step}), to step {plan.total_steps}"
    else:  # the live workers are used as they are (reattach, continue) or dropped (restart)
        where = f"{start.action} at step {start.step}, to step {plan.total_steps}"
    if attempt > 1:
        log.warning(f"attempt {attempt} of the run (a Prefect retry): {where}")
    else:
        log.info(f"run {config.experiment_name}: {where}")
    if plan.train_report:
        skipped = "skipped" in plan.train_report
        (log.warning if skipped else log.info)(f"train prompts: {plan.train_report}")
    if plan.first_step > plan.total_steps:
        log.info(f"already at step {start.step} of {plan.total_steps}: nothing to train")


def record_step(config, step: int, metrics: Mapping[str, float]) -> None:
    log = run_log_for(config)
    log.step(step_summary(step, log.total_steps or config.total_train_steps or 0, metrics))
    for warning in step_warnings(step, metrics):
        log.warning(warning)


def record_failure(config, error: BaseException, *, during: str, next_move: str) -> None:
    """``during`` (``step 12``) failed: one ``ERROR`` line with the cause and ``next_move``, then the
    traceback as ``TRACE`` lines (secrets masked, as on every line)."""
    log, cause = run_log_for(config), describe_failure(error)
    then = f" {next_move[:1].upper()}{next_move[1:]}" if cause.endswith(".") else f"; {next_move}"
    log.error(f"{during} failed: {cause}{then}")
    log.write(TRACE, "".join(traceback.format_exception(error)).rstrip("\n"))


def after_failure(config, *, started: bool, attempt: int, retries: int, setting: bool) -> str:
    """What follows a failed attempt of the run: a retry (the retry of an attempt that got past its
    start resumes from the latest complete checkpoint, ``engine.run.resume``) or the end of the run."""
    latest = SaveStore(Store(config.checkpoint_uri, config.storage_options)).latest()
    checkpoint = f"the step-{latest[0]} checkpoint" if latest else None
    if setting:
        return "the run ends: change that setting (a setting error is not retried)"
    if attempt > retries:
        spent = f"its {retries} {'retry is' if retries == 1 else 'retries are'} spent" if retries else "cluster.flow_retries is 0"
        resumable = f"; resume from {checkpoint} with --resume" if checkpoint else ""
        return f"the run ends: {spent}{resumable}"
    where = "" if not started else f" from {checkpoint}" if checkpoint else " from where it started (no checkpoint yet)"
    return f"retrying{where} (attempt {attempt + 1} of {retries + 1})"
