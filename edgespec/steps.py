"""What every scheduler does with a verified step: cut it at end-of-generation or the token
limit, and describe it as a StepEvent."""

from __future__ import annotations

from .draft import Draft
from .events import StepEvent


def clip(gen, committed: list[int]) -> tuple[list[int], bool]:
    """Cut a step's tokens at end-of-generation or the token limit (`gen`: any generation with
    engine, tokens, max_tokens and stats); True when the generation is over."""
    out: list[int] = []
    is_eog = gen.engine.target.is_eog
    for t in committed:
        if is_eog(t):
            gen.stats.finish_reason = "stop"
            return out, True
        out.append(t)
        if len(gen.tokens) + len(out) >= gen.max_tokens:
            gen.stats.finish_reason = "length"
            return out, True
    return out, False


def step_event(step: int, draft: Draft, accepted: list[int], out: list[int], t_draft: float, t_verify: float,
               drafter: str, mode: str = "") -> StepEvent:
    """The event of one verification step: `accepted` are draft nodes, `out` the tokens the
    step committed after `clip` (a step cut at end-of-generation keeps fewer)."""
    acc_depths = tuple(range(1, len(accepted) + 1)) if draft.is_chain else tuple(draft.depths()[a] for a in accepted)
    n_acc = min(len(accepted), len(out))
    return StepEvent(
        step=step, n_drafted=len(draft), n_accept=n_acc, n_branches=len(draft.leaves()) if draft.tokens else 0,
        tokens=tuple(out), from_draft=tuple(i < n_acc for i in range(len(out))),
        t_draft=t_draft, t_verify=t_verify, drafter=drafter,
        accepted_depth=acc_depths[:n_acc], drafted_depth=_depth_counts(draft), mode=mode,
    )


def _depth_counts(draft: Draft) -> tuple[int, ...]:
    if not draft.tokens:
        return ()
    ds = draft.depths()
    counts = [0] * max(ds)
    for d in ds:
        counts[d - 1] += 1
    return tuple(counts)
