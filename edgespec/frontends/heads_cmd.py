"""`edgespec convert` and `edgespec train`: the heads commands, with rich progress bars."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import EdgespecError


def run_convert(a) -> int:
    from ..heads.store import convert_any
    from ..llama import Model
    from ..models import resolve

    src = Path(a.src)
    if not src.exists():
        raise EdgespecError(f"checkpoint not found: {src}")
    target = Model(resolve(a.model))
    try:
        out = convert_any(a.kind, src, target, Path(a.output))
    finally:
        target.close()
    print(out)
    return 0


def _load_exclude(path: str | None) -> set[str]:
    if not path:
        return set()
    from ..train.data import _text

    out = set()
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise EdgespecError(f"cannot read --exclude {path}: {e.strerror}") from None
    for line in lines:
        if line.strip():
            out.add(_text(json.loads(line)))
    return out


def run_train(a) -> int:
    from ..engine import Engine, EngineConfig
    from ..heads.store import heads_dir
    from ..models import cache_root
    from ..train.data import training_prompts
    from ..train.run import check_extra, train_heads
    from ..train.trainer import TrainConfig

    check_extra()
    for name, v, lo in (("--tokens", a.tokens, 64), ("--batch", a.batch, 8), ("--draft-vocab", a.draft_vocab, 16),
                        ("--max-new", a.max_new, 8), ("--heads-n", a.medusa_heads, 1), ("--ttt-steps", a.ttt_steps, 1)):
        if v < lo:
            raise EdgespecError(f"{name} must be at least {lo}")
    if not a.epochs > 0 or not a.lr > 0:
        raise EdgespecError("--epochs and --lr must be positive")
    prompts = training_prompts(a.data, exclude=_load_exclude(a.exclude))
    if not prompts:
        raise EdgespecError("no training prompts left (check --data and --exclude)")
    engine = Engine(EngineConfig(model=a.model, n_ctx=a.n_ctx, threads=a.threads, max_branches=1), quiet=a.quiet)
    target = Path(engine.target.path).stem
    work = Path(a.work) if a.work else cache_root() / "train" / target
    out = Path(a.output) if a.output else heads_dir() / f"{target}.{a.kind}.gguf"
    cfg = TrainConfig(a.kind, epochs=a.epochs, batch=a.batch, lr=a.lr, draft_vocab=a.draft_vocab,
                      medusa_heads=a.medusa_heads, ttt_steps=a.ttt_steps)
    bars = _Bars(a.quiet)
    try:
        with bars:
            res = train_heads(engine, a.kind, prompts, out, work, a.tokens, cfg, bars.update, a.max_new)
    except KeyboardInterrupt:
        print(f"edgespec: interrupted; data and checkpoint kept in {work} (run the same command to resume)",
              file=sys.stderr)
        return 130
    r = res.report
    heads = "head" if a.kind == "medusa" else "step"
    print(f"trained {a.kind} on {res.tokens} tokens: data {res.t_data:.0f} s, training {res.t_train:.0f} s")
    for i, (t1, t5) in enumerate(zip(r.top1, r.top5)):
        base = f" (untrained {res.untrained.top1[i]:.1%})" if i < len(res.untrained.top1) else ""
        print(f"  {heads} {i + 1}: top-1 {t1:.1%}, top-5 {t5:.1%}{base}")
    print(f"  expected mean accepted length of a chain: {r.mean_accepted:.2f} tokens per step")
    print(f"  report and curves: {work}")
    print(out)
    return 0


class _Bars:
    """Two rich progress bars: data collection (tokens) and training (steps, loss, tokens/s)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet or not sys.stderr.isatty()
        self.progress = None
        self.tasks: dict[str, int] = {}

    def __enter__(self):
        if self.quiet:
            return self
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                 console=Console(stderr=True), transient=False)
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.__exit__(*exc)
        return False

    def update(self, stage: str, info: dict) -> None:
        if self.progress is None:
            if stage == "train" and info["step"] % 50 == 0 and not self.quiet:
                print(f"step {info['step']}/{info['total']} loss {info['loss']:.3f}", file=sys.stderr)
            return
        p = self.progress
        if stage == "data":
            if "data" not in self.tasks:
                self.tasks["data"] = p.add_task("data (tokens)", total=info["total"], info="")
            p.update(self.tasks["data"], completed=min(info["rows"], info["total"]))
        else:
            if "train" not in self.tasks:
                self.tasks["train"] = p.add_task("training (steps)", total=info["total"], info="")
            p.update(self.tasks["train"], completed=info["step"],
                     info=f"loss {info['loss']:.3f}  {info['tokens_per_s']:.0f} tok/s")
