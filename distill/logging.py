"""What a training run reports while it runs: metrics (``metrics.jsonl``, W&B), a progress bar, and a stop flag.

Kept apart from ``distill/recipe.py`` so the recipe reads as the recipe (setup, micro-batch, loss, evaluate, train).
"""
from __future__ import annotations

import json
import signal
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


class MetricsLogger:
    """metrics.jsonl always; W&B too with ``logger=wandb`` (offline without an API key). Main process only."""

    def __init__(self, cfg: DictConfig, output_dir: Path, enabled: bool, resumed: bool):
        self.enabled = enabled
        self.run = None
        if not enabled:
            return
        self.file = open(output_dir / "metrics.jsonl", "a")
        if cfg.logger.name == "wandb":
            import os

            import wandb

            mode = cfg.logger.get("mode") or "auto"
            if mode == "auto":
                mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            id_file = output_dir / "wandb_run_id"  # a resumed run continues the same W&B run
            run_id = id_file.read_text().strip() if resumed and id_file.exists() else None
            self.run = wandb.init(project=cfg.logger.get("project") or "draftkit",
                                  name=cfg.logger.get("run_name") or output_dir.name, dir=str(output_dir),
                                  mode=mode, tags=list(cfg.logger.get("tags") or []), id=run_id,
                                  config=OmegaConf.to_container(cfg, resolve=True),
                                  resume="allow" if run_id else None)
            id_file.write_text(self.run.id)

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.run is not None:
            self.run.log({k: v for k, v in metrics.items() if not isinstance(v, (list, dict))}, step=step)

    def log_eval(self, ev: dict, step: int) -> None:
        flat = {"eval/acceptance_rate": ev["acceptance_rate"], "eval/mean_accepted_length": ev["mean_accepted_length"],
                "eval/predicted_speedup": ev["predicted_speedup"], "eval/cost_ratio": ev["cost_ratio"]}
        for t, m in ev["per_temperature"].items():
            for k in ("acceptance_rate", "mean_accepted_length", "predicted_speedup", "best_gamma"):
                flat[f"eval/T{t}/{k}"] = m[k]
        self.log({**flat, "eval": ev}, step)
        if self.enabled and self.run is not None:
            import numpy as np
            import wandb

            for t, m in ev["per_temperature"].items():
                counts = np.asarray(m["accepted_length_histogram"], dtype=float)
                edges = np.arange(len(counts) + 1, dtype=float) - 0.5
                self.run.log({f"eval/T{t}/accepted_length_hist": wandb.Histogram(np_histogram=(counts, edges))},
                             step=step)

    def finish(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.run is not None:
            self.run.finish()


class Progress:
    """A rich (or tqdm) progress bar showing loss and tokens/s; ``train.progress=none`` disables it."""

    def __init__(self, kind: str, total: int, start: int, enabled: bool):
        self.kind = kind if enabled else "none"
        if self.kind == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn
            from rich.progress import TimeRemainingColumn

            self.bar = RichProgress(TextColumn("[bold]distill"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self.bar.start()
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
        elif self.kind == "tqdm":
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start, desc="distill")

    def update(self, loss: float, tokens_per_s: float) -> None:
        info = f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s"
        if self.kind == "rich":
            self.bar.update(self.task, advance=1, info=info)
        elif self.kind == "tqdm":
            self.bar.set_postfix_str(info)
            self.bar.update(1)

    def close(self) -> None:
        if self.kind == "rich":
            self.bar.stop()
        elif self.kind == "tqdm":
            self.bar.close()



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
