"""`edgespec convert` and `edgespec train`: the heads commands, with rich progress bars."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import EdgespecError
from .options import ConvertOptions, TrainOptions


def run_convert(a: ConvertOptions) -> int:
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


def run_train(a: TrainOptions) -> int:
    from ..engine import Engine, EngineConfig
    from ..heads.store import heads_dir
    from ..models import cache_root
    from ..train.data import training_prompts
    from ..train.run import check_extra, learning_curve, train_heads
    from ..train.trainer import TrainConfig

    check_extra()
    for name, v, lo in (("--tokens", a.tokens, 64), ("--batch", a.batch, 8), ("--draft-vocab", a.draft_vocab, 16),
                        ("--max-new", a.max_new, 8), ("--heads-n", a.medusa_heads, 1), ("--ttt-steps", a.ttt_steps, 1)):
        if v < lo:
            raise EdgespecError(f"{name} must be at least {lo}")
    if not a.epochs > 0 or not a.lr > 0:
        raise EdgespecError("--epochs and --lr must be positive")
    fractions = _fractions(a.curve) if a.curve is not None else None
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
    if fractions is not None:
        try:
            with bars:
                rows = learning_curve(engine, a.kind, prompts, work, a.tokens, cfg, fractions, bars.update, a.max_new)
        except KeyboardInterrupt:
            print(f"edgespec: interrupted; the collected data is kept in {work}", file=sys.stderr)
            return 130
        what = "head" if a.kind == "medusa" else "step"
        print(f"learning curve of {a.kind}: held-out agreement by training tokens ({a.epochs:g} epochs each)")
        print(f"  {'tokens':>8} {'docs':>5}  top-1 by {what}{'':<14} expected chain  training")
        for r in rows:
            top = " / ".join(f"{x:.0%}" for x in r["top1"])
            print(f"  {r['tokens']:>8} {r['documents']:>5}  {top:<24} {r['mean_accepted']:>14.2f}  {r['t_train_s']:>6.0f} s")
        print(f"  {work / f'learning-{a.kind}.json'}")
        return 0
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


def _fractions(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or not all(0 < f <= 1 for f in out):
        raise EdgespecError(f"--curve takes fractions in (0, 1], comma-separated (e.g. 0.25,0.5,1), not {text!r}")
    return out


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
        if stage == "curve":  # one point of a learning curve done: the next trains from step 0
            if "train" in self.tasks:
                p.reset(self.tasks["train"])
            return
        if stage == "data":
            if "data" not in self.tasks:
                self.tasks["data"] = p.add_task("data (tokens)", total=info["total"], info="")
            p.update(self.tasks["data"], completed=min(info["rows"], info["total"]))
        else:
            if "train" not in self.tasks:
                self.tasks["train"] = p.add_task("training (steps)", total=info["total"], info="")
            p.update(self.tasks["train"], completed=info["step"], total=info["total"],
                     info=f"loss {info['loss']:.3f}  {info['tokens_per_s']:.0f} tok/s")
