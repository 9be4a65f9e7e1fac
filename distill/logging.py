"""What a training run reports while it runs: metrics (``metrics.jsonl``, W&B), progress bars, and a stop flag.

Kept apart from ``distill/recipe.py`` so the recipe reads as the recipe (setup, micro-batch, loss, evaluate, train).
"""
from __future__ import annotations

import contextlib
import json
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from omegaconf import DictConfig, OmegaConf


def wandb_mode(mode: str, env: Any) -> str:
    """The ``mode`` given to ``wandb.init`` for ``logger.mode``: ``auto`` is ``$WANDB_MODE`` when set (``init``'s own
    argument would override it), else ``online`` for a user with W&B credentials (``$WANDB_API_KEY``, or the
    ``~/.netrc`` entry that ``wandb login`` writes for the API host) and ``offline`` without; ``dryrun`` (W&B's
    old name) is ``offline``. Any other value is passed through."""
    if mode != "auto":
        return mode
    mode = env.get("WANDB_MODE") or ("online" if env.get("WANDB_API_KEY") or _netrc_login(env) else "offline")
    return "offline" if mode == "dryrun" else mode


def _netrc_login(env: Any) -> bool:
    """True when the netrc file (``$NETRC``, else ``~/.netrc``) holds a password for the W&B API host
    (``$WANDB_BASE_URL``, default https://api.wandb.ai), as ``wandb login`` writes it."""
    import netrc
    import os
    from urllib.parse import urlparse

    host = urlparse(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    path = env.get("NETRC") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".netrc")
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


class MetricsLogger:
    """metrics.jsonl always; W&B too with ``logger=wandb`` (offline without W&B credentials: :func:`wandb_mode`).
    Main process only."""

    def __init__(self, cfg: DictConfig, output_dir: Path, enabled: bool, resumed: bool, resume_step: int = 0,
                 logged_through: int = -1, log: Callable[[str], None] = print):
        """``resume_step``: the step of the checkpoint a resumed run starts from; ``logged_through``: the last step
        it logged before it stopped. Its rows after the checkpoint are in the W&B run already and W&B takes a step
        once (it drops a step lower than its last), so the resumed run sends W&B only the later steps;
        metrics.jsonl gets them all."""
        self.enabled = enabled
        self.run = None
        self.wandb_from = 0  # the first step sent to W&B
        if not enabled:
            return
        self.file = open(output_dir / "metrics.jsonl", "a")
        if cfg.logger.name == "wandb":
            import os

            import wandb

            mode = wandb_mode(cfg.logger.get("mode") or "auto", os.environ)
            id_file = output_dir / "wandb_run_id"  # a resumed run continues the same W&B run
            run_id = id_file.read_text().strip() if resumed and id_file.exists() else None
            self.run = wandb.init(project=cfg.logger.get("project") or "draftkit",
                                  name=cfg.logger.get("run_name") or output_dir.name, dir=str(output_dir),
                                  mode=mode, tags=list(cfg.logger.get("tags") or []), id=run_id,
                                  config=OmegaConf.to_container(cfg, resolve=True),
                                  resume="allow" if run_id else None)
            id_file.write_text(self.run.id)
            if run_id:  # online, W&B knows its last step; offline, the interrupted run's metrics.jsonl tells
                self.wandb_from = max(logged_through + 1, int(getattr(self.run, "starting_step", 0) or 0))
                if self.wandb_from > resume_step + 1:
                    log(f"W&B: the stopped run logged steps up to {self.wandb_from - 1}, after its checkpoint (step "
                        f"{resume_step}); W&B takes a step once, so this run sends it steps from {self.wandb_from} "
                        "(steps before keep what W&B received before the stop: a killed process may not have sent "
                        "its last rows); metrics.jsonl gets all of this run's")

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        if self.file is not None:
            try:
                self.file.write(json.dumps({"step": step, **metrics}) + "\n")
                self.file.flush()
            except OSError as err:  # a full disk: the metrics are not worth stopping the training for
                print(f"warning: could not write {self.file.name} ({err}); training goes on without it (W&B, if "
                      "on, still logs). The next checkpoint needs disk space too: free some", file=sys.stderr)
                with contextlib.suppress(OSError):
                    self.file.close()
                self.file = None
        if self.run is not None and step >= self.wandb_from:
            self.run.log({k: v for k, v in metrics.items() if not isinstance(v, (list, dict))}, step=step)

    def log_eval(self, ev: dict, step: int) -> None:
        flat = {"eval/acceptance_rate": ev["acceptance_rate"], "eval/mean_accepted_length": ev["mean_accepted_length"],
                "eval/predicted_speedup": ev["predicted_speedup"], "eval/cost_ratio": ev["cost_ratio"],
                "eval/eval_s": ev.get("eval_s")}
        for t, m in ev["per_temperature"].items():
            for k in ("acceptance_rate", "alpha", "mean_accepted_length", "predicted_speedup", "best_gamma"):
                flat[f"eval/T{t}/{k}"] = m[k]
        self.log({**flat, "eval": ev}, step)
        if self.enabled and self.run is not None and step >= self.wandb_from:
            import numpy as np
            import wandb

            for t, m in ev["per_temperature"].items():
                counts = np.asarray(m["accepted_length_histogram"], dtype=float)
                edges = np.arange(len(counts) + 1, dtype=float) - 0.5
                self.run.log({f"eval/T{t}/accepted_length_hist": wandb.Histogram(np_histogram=(counts, edges))},
                             step=step)

    def finish(self, exit_code: int | None = None) -> None:
        """Close metrics.jsonl and finish the W&B run (``exit_code`` 1: W&B marks it failed); a second call does
        nothing."""
        if not self.enabled:
            return
        if self.file is not None:
            with contextlib.suppress(OSError):  # (a full disk: the warning was given in log)
                self.file.close()
            self.file = None
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=exit_code)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.finish(exit_code=None if exc_type is None else 1)


class Bar:
    """One bar of a :class:`Progress` (a rich task or a tqdm bar; nothing when hidden)."""

    def __init__(self, owner: "Progress", handle: Any):
        self.owner, self.handle = owner, handle

    def update(self, completed: int | None = None, advance: int = 0, info: str | None = None) -> None:
        """Set the count to ``completed`` or move it by ``advance``; ``info`` replaces the text after the count."""
        h = self.handle
        if h is None:
            return
        if self.owner.kind == "rich":
            fields = {} if info is None else {"info": info}
            self.owner.rich.update(h, completed=completed, advance=advance or None, **fields)
        else:
            if info is not None:
                h.set_postfix_str(info, refresh=False)
            h.update(completed - h.n if completed is not None else advance)


class Progress:
    """The progress bars of a run: the training steps (loss, tokens/s), and inside a run the cost-ratio measurement
    ("measuring cost ratio c: 3/9") and each α/τ evaluation ("eval α/τ T=0: 5/16 prompts").

    ``kind`` is ``train.progress``: rich | tqdm | none. ``enabled=False`` (a process other than the main one) shows
    nothing. Bars opened with ``transient=True`` (the measurements) vanish when done and are drawn only on a
    terminal (``file.isatty()``), so logs and CI output stay free of them; the training bar follows ``kind`` alone.
    With rich, every bar is a task of one live display (rich allows only one at a time).
    """

    def __init__(self, kind: str = "rich", enabled: bool = True, file: Any = None):
        self.kind = kind if enabled else "none"
        self.file = file if file is not None else sys.stderr
        self.rich = None
        self.open_bars = 0

    def _is_terminal(self) -> bool:
        isatty = getattr(self.file, "isatty", None)
        return bool(isatty and isatty())

    def _open(self, desc: str, total: int, completed: int, unit: str, transient: bool) -> Any:
        if self.kind == "none" or (transient and not self._is_terminal()):
            return None
        if self.kind == "tqdm":
            from tqdm.auto import tqdm

            # A measurement has few, slow updates (a batch of prompts, a round of forwards): draw each one.
            return tqdm(total=total, initial=completed, desc=desc, unit=unit or "it", leave=not transient,
                        file=self.file, dynamic_ncols=True, mininterval=0 if transient else 0.1)
        if self.rich is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn
            from rich.progress import TimeRemainingColumn

            self.rich = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[unit]} {task.fields[info]}"), TimeRemainingColumn(),
                                     console=Console(file=self.file))
            self.rich.start()
        return self.rich.add_task(desc, total=total, completed=completed, unit=unit, info="")

    def _close(self, handle: Any, transient: bool) -> None:
        if handle is None:
            return
        if self.kind == "tqdm":
            handle.close()
            return
        if transient:
            self.rich.remove_task(handle)
        self.open_bars -= 1
        if self.open_bars == 0:
            self.rich.stop()
            self.rich = None

    @contextlib.contextmanager
    def bar(self, desc: str, total: int, completed: int = 0, unit: str = "",
            transient: bool = False) -> Iterator[Bar]:
        """A bar counting to ``total`` while the ``with`` block runs; closed at its end, also on an error."""
        handle = self._open(desc, total, completed, unit, transient)
        if handle is not None and self.kind == "rich":
            self.open_bars += 1
        try:
            yield Bar(self, handle)
        finally:
            self._close(handle, transient)

    @contextlib.contextmanager
    def reporting(self) -> Iterator[Callable[[str, int, int, str], None]]:
        """A ``progress(what, done, total, unit)`` callback for library functions (``distill.evaluate``): the first
        call for ``what`` opens a transient bar, ``done == total`` closes it; any left open close with the block."""
        bars: dict[str, tuple[Any, Bar]] = {}

        def report(what: str, done: int, total: int, unit: str = "") -> None:
            if what not in bars:
                cm = self.bar(what, total, unit=unit, transient=True)
                bars[what] = (cm, cm.__enter__())
            bars[what][1].update(completed=done)
            if done >= total:
                bars.pop(what)[0].__exit__(None, None, None)

        try:
            yield report
        finally:
            for cm, _ in bars.values():
                cm.__exit__(None, None, None)


@contextlib.contextmanager
def sigterm_raises(exc_type: type[BaseException] = KeyboardInterrupt) -> Iterator[None]:
    """Inside the block, SIGTERM (``kill PID``, ``timeout``, schedulers, ``docker stop``) raises ``exc_type`` where
    the program is, as Ctrl-C raises KeyboardInterrupt, so the same cleanup runs for both; the earlier handler is
    put back after. Off the main thread (where no handler can be set) it changes nothing."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise exc_type()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class StopFlag:
    """SIGTERM / SIGINT set a flag; the loop checkpoints at the end of the step and exits cleanly."""

    def __init__(self):
        self.stop = False
        self.previous = {}

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.stop:  # a second signal: stop now
            raise KeyboardInterrupt
        self.stop = True

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
