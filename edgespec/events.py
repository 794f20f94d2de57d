"""Step events and the stats they add up to. Data only: printing is the reader's job.

Names follow llama.cpp (`n_drafted`, `n_accept`) and vLLM (`mean_accepted_length`) where they
differ.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass(frozen=True)
class StepEvent:
    """One target verification step."""

    step: int
    n_drafted: int  # draft nodes scored in this step (all branches)
    n_accept: int  # draft tokens accepted
    n_branches: int
    tokens: tuple[int, ...]  # tokens committed by this step (accepted drafts, then the target's own)
    from_draft: tuple[bool, ...]  # per committed token: did it come from an accepted draft?
    t_draft: float  # seconds
    t_verify: float
    drafter: str = ""
    accepted_depth: tuple[int, ...] = ()  # depth of each accepted node (1-based)
    drafted_depth: tuple[int, ...] = ()  # number of draft nodes at each depth 1..
    mode: str = ""  # PEARL: "pre" (first token verified while drafting) or "post" (draft on while verifying)
    # The step's own token was the end of generation: the target yielded it (one token of the
    # step's worth, as any token it picks), but it ends the text, so it is not in `tokens`.
    ended: bool = False

    @property
    def n_yielded(self) -> int:
        """Tokens this step yielded: those committed, and the end of generation where it came."""
        return len(self.tokens) + self.ended


@dataclass
class Stats:
    n_prompt: int = 0  # prompt tokens, read or found in the cache
    n_prompt_cached: int = 0  # of them, kept in the KV cache from before (conversation reuse): not read
    t_prompt: float = 0.0
    n_generated: int = 0
    n_steps: int = 0  # target verification steps (one llama_decode each)
    n_drafted: int = 0
    n_accept: int = 0
    n_draft_steps: int = 0  # steps that carried a non-empty draft
    n_ended: int = 0  # steps whose own token ended the generation (yielded, not in n_generated)
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_gen: float = 0.0  # wall time of generation (after the prompt)
    n_branches: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position (depth)
    accepted_at: list[int] = field(default_factory=list)
    accepted_len_hist: list[int] = field(default_factory=list)  # steps by tokens yielded (StepEvent.n_yielded)
    # per source that drafted (StepEvent.drafter: lookahead, history, draft, mtp, ...): [steps it
    # drafted, tokens drafted, tokens accepted]; each accepted token is a plain step saved
    by_source: dict[str, list[int]] = field(default_factory=dict)
    finish_reason: str = ""
    # PEARL only: rounds per mode, pre-verify rounds that ended early, and where time went.
    # For PEARL, t_draft is the time the target sat idle waiting for draft tokens.
    n_pre: int = 0
    n_post: int = 0
    n_early_exit: int = 0
    t_draft_busy: float = 0.0  # the draft model's time drafting
    t_draft_hidden: float = 0.0  # drafting that ran behind verification (the target did not wait)
    t_idle_draft: float = 0.0  # the draft model waiting for work

    def add(self, ev: StepEvent) -> None:
        self.n_steps += 1
        self.n_generated += len(ev.tokens)
        self.n_drafted += ev.n_drafted
        self.n_accept += ev.n_accept
        self.t_draft += ev.t_draft
        self.t_verify += ev.t_verify
        self.n_ended += ev.ended
        if ev.n_drafted:
            self.n_draft_steps += 1
            self.n_branches += ev.n_branches
            src = self.by_source.setdefault(ev.drafter or "?", [0, 0, 0])
            src[0] += 1
            src[1] += ev.n_drafted
            src[2] += ev.n_accept
        for d, cnt in enumerate(ev.drafted_depth):
            _bump(self.drafted_at, d, cnt)
        for d in ev.accepted_depth:
            _bump(self.accepted_at, d - 1, 1)
        _bump(self.accepted_len_hist, ev.n_yielded, 1)

    def merge(self, other: "Stats") -> None:
        """Add another generation's counts, times and histograms (a conversation's, a batch's or a
        bench cell's total); `finish_reason` stays this one's."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, list):
                for i, x in enumerate(theirs):
                    _bump(mine, i, x)
            elif isinstance(mine, dict):
                for k, xs in theirs.items():
                    row = mine.setdefault(k, [0] * len(xs))
                    for i, x in enumerate(xs):
                        _bump(row, i, x)
            elif isinstance(mine, (int, float)) and not isinstance(mine, bool):
                setattr(self, f.name, mine + theirs)

    @property
    def n_prompt_eval(self) -> int:
        """Prompt tokens read (evaluated) by this generation."""
        return self.n_prompt - self.n_prompt_cached

    @property
    def acceptance_rate(self) -> float:
        return self.n_accept / self.n_drafted if self.n_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens each target step yielded, on average: accepted draft tokens plus the target's
        own, the end of generation included (the step that yields it did the work of a plain
        step: plain decoding is 1.0, not 11 tokens over 12 steps)."""
        return (self.n_generated + self.n_ended) / self.n_steps if self.n_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode rate: tokens after the first (which comes with the prompt) per second of
        generation, as llama.cpp reports its eval rate."""
        return (self.n_generated - 1) / self.t_gen if self.t_gen > 0 and self.n_generated > 1 else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at + [0] * len(self.drafted_at), self.drafted_at)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            acceptance_rate=round(self.acceptance_rate, 4),
            mean_accepted_length=round(self.mean_accepted_length, 4),
            tokens_per_s=round(self.tokens_per_s, 2),
            n_prompt_eval=self.n_prompt_eval,
            prompt_tokens_per_s=round(self.n_prompt_eval / self.t_prompt, 2) if self.t_prompt > 0 else 0.0,
            acceptance_by_position=[round(x, 4) for x in self.acceptance_by_position],
            mean_branches=round(self.n_branches / self.n_draft_steps, 3) if self.n_draft_steps else 0.0,
        )
        return d

    def summary(self) -> str:
        s = (
            f"{self.n_generated} tokens in {self.t_gen:.2f}s ({self.tokens_per_s:.1f} tok/s), "
            f"prompt {self.n_prompt} tokens"
            + (f" ({self.n_prompt_cached} cached, {self.n_prompt_eval} read)" if self.n_prompt_cached else "")
            + f" in {self.t_prompt:.2f}s"
        )
        if self.n_drafted:
            s += (
                f"; drafted {self.n_drafted}, accepted {self.n_accept} "
                f"({100 * self.acceptance_rate:.1f}%), mean accepted length {self.mean_accepted_length:.2f}, "
                f"{self.n_steps} steps"
            )
        return s


def _bump(xs: list[int], i: int, by: int) -> None:
    while len(xs) <= i:
        xs.append(0)
    xs[i] += by
