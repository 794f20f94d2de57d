"""The measured cost of verifying k tokens on this machine, and the draft size it pays for.

Verifying k rows costs t(k); on a 2-core CPU t(8) is several times t(1), on a GPU nearly t(1).
A step that drafts nodes with acceptance probabilities P_1 >= P_2 >= ... (each the chance that
the path to that node is accepted) yields 1 + sum(P_i) tokens for t(rows) seconds; plain
decoding yields 1 token for t(1). Drafters size each step to maximize that ratio.

Pure: this module reads no model and no file. Measuring a curve is `costmeasure`; the cache's
life cycle (load or measure, heal, persist, what is kept beside a curve) is `costcache`, above both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
FAR = 1.3  # an online correction outside [1/FAR, FAR] after MIN_EVIDENCE decodes: the curve is measured again
MIN_EVIDENCE = 24
QUIET_SHARE = 0.8  # a measurement that had less of its threads' CPU time than this was disturbed
# Until MIN_EVIDENCE many-row decodes are seen, their prediction is uncertain: at most one
# exploratory draft of EXPLORE_NODES node per EXPLORE_EVERY plain steps where nothing is predicted
# to pay, so that evidence arrives (see CostModel.best_size).
EXPLORE_EVERY = 16
EXPLORE_NODES = 1
_TABLE = 66  # row counts with a precomputed prediction (a verification is at most 32 + pending)
# The floor a reply keeps against plain decoding, as the share of its tokens it may lose on drafts
# that were not kept (see CostModel.best_size's `slack`): a draft whose every token could be
# rejected risks the rows it adds; while the reply is ahead, or behind by less than this share,
# any draft that pays on average goes; past it, a draft must expect to gain more than it risks.
LOSS_SHARE = 0.02


@dataclass
class CostModel:
    """t(k, n): seconds to decode k rows (all with logits) after n cached tokens.

    The weights part is measured per k on a short context; attention adds a cost per cached
    token, `attn0 + attn * k` (on a CPU it dominates long contexts: every row attends to all of
    them; one row alone pays more per token than each row of a batch, hence the intercept).
    """

    ks: tuple[int, ...]
    ts: tuple[float, ...]  # seconds per decode of k rows on a context of `n0` tokens
    attn: float = 0.0  # extra seconds per row per cached token beyond n0
    n0: int = 32
    # Largest batch whose logits are bit-identical to one-row decodes on this build and model
    # (see probe_exactness); verification never uses more rows, so greedy stays exact.
    max_exact_rows: int = 1 << 30
    online: bool = True  # corrected by measured decodes; off for a curve that stands for another machine
    # Largest |logit difference| between batched rows and one-row decodes over the probe's batch
    # sizes (0.0: exact at every size; None: not measured): the near-tie margin within which
    # greedy output may differ under the `batched` exactness policy.
    batch_logit_diff: float | None = None
    attn0: float = 0.0  # extra seconds per cached token beyond n0 whatever the rows (see measure)

    def __post_init__(self) -> None:
        # Online correction, measured/predicted, for one-row and many-row decodes: a curve
        # measured once under other load drifts from what decodes cost now.
        self.ratio = [1.0, 1.0]
        self._plain_run = 0  # one-row decodes since the last many-row one (exploration's clock)
        # The curve's shape, learned too: per row count, measured/predicted relative to the
        # many-row correction (1.0 until that count is seen). One correction for every
        # many-row decode follows the common sizes (4 rows, here): on the chat prompts 2-row
        # decodes ran 7-12% over their prediction, so one-token drafts were priced at 1.57-1.64
        # plain steps where they cost 1.69 (against the neighbouring one-row decodes); learned
        # per count, 1.71.
        self.shape = [1.0] * _TABLE
        self._seen = [0] * _TABLE
        self.n_obs = [0, 0]  # decodes folded in, one-row and many-row
        # The attention term, checked: per one-row / many-row decodes, the mean log of
        # measured/predicted where attention is a small part of the prediction and where it is a
        # large one. A right term leaves both near each other whatever the level; a wrong one
        # (measured on a busy machine: 10x here) pulls them apart.
        self._attn_obs = [[0.0, 0, 0.0, 0], [0.0, 0, 0.0, 0]]  # [near sum, near n, far sum, far n]
        self.share: float | None = None  # the CPU share the measurement had (see measure); None: unknown
        self.origin: tuple[str, str] | None = None  # (cache file, key) it was read from or written to
        self.measured_at = 0.0  # when it was measured (time.time(); 0.0: not recorded)
        self._written_obs = [0, 0]  # n_obs as last read from or written to the cache (see persist)
        # predict(k, 0) per row count, so that sizing a draft (every step) interpolates nothing
        self._base = [self.predict(k) for k in range(_TABLE)]

    def t(self, k: int, n_past: int = 0) -> float:
        if k <= 1:
            return self.predict(k, n_past) * self.ratio[0]
        return self.predict(k, n_past) * self.many * (self.shape[k] if k < _TABLE else 1.0)

    def predict(self, k: int, n_past: int = 0) -> float:
        ks, ts = self.ks, self.ts
        extra = (self.attn0 + self.attn * k) * max(0, n_past - self.n0)
        if k <= ks[0]:
            return ts[0] + extra
        for i in range(1, len(ks)):
            if k <= ks[i]:
                f = (k - ks[i - 1]) / (ks[i] - ks[i - 1])
                return ts[i - 1] + f * (ts[i] - ts[i - 1]) + extra
        slope = (ts[-1] - ts[-2]) / (ks[-1] - ks[-2])
        return ts[-1] + slope * (k - ks[-1]) + extra

    def t_multi(self, rows: int, row_tokens: int) -> float:
        """One decode of `rows` rows from several sequences, `row_tokens` being the sum over rows
        of the tokens each row attends to (its own sequence's cache): batch mode."""
        return self.predict_multi(rows, row_tokens) * (self.ratio[0] if rows <= 1 else self.many)

    def predict_multi(self, rows: int, row_tokens: int) -> float:
        extra = max(0, row_tokens - rows * self.n0)
        return self.predict(rows, 0) + (self.attn + self.attn0 / max(1, rows)) * extra

    def observe(self, k: int, n_past: int, seconds: float, predicted: float | None = None) -> None:
        """Fold a measured decode of k rows into the correction (robust to outliers)."""
        if not self.online:
            return
        pred = self.predict(k, n_past) if predicted is None else predicted
        r = min(3.0, max(0.33, seconds / pred))
        b = 0 if k <= 1 else 1
        self.ratio[b] = 0.95 * self.ratio[b] + 0.05 * r
        self.n_obs[b] += 1
        self._plain_run = self._plain_run + 1 if b == 0 else 0
        if predicted is None and n_past > self.n0:
            frac = (self.attn0 + self.attn * k) * (n_past - self.n0) / pred  # attention's part of it
            if frac < 0.15 or frac > 0.35:
                a = self._attn_obs[b]
                i = 0 if frac < 0.15 else 2
                a[i] += math.log(r)
                a[i + 1] += 1
        if predicted is None and 1 < k < _TABLE:  # one sequence's rows: the shape at k
            n = self._seen[k]
            w = max(0.1, 1.0 / (n + 3))  # the curve's own value weighs as two measurements
            self.shape[k] = (1 - w) * self.shape[k] + w * min(3.0, max(0.33, r / self.many))
            self._seen[k] = n + 1

    @property
    def many(self) -> float:
        """The many-row correction in use: the EMA of many-row decodes (ratio[1], which starts
        from 1.0 and gives that start a weight of 0.95**n after n of them) with its start
        replaced by the one-row correction, the prior (a curve 3x too dear for one row is almost
        surely too dear for four). Before any many-row decode it is the one-row correction;
        evidence takes over as it comes."""
        return self.ratio[1] + 0.95 ** self.n_obs[1] * (self.ratio[0] - 1.0)

    # -- healing: what the online correction learned, kept across processes ---------------

    def online_state(self) -> dict:
        """What the online correction learned (level, shape per row count, the attention check):
        written back beside the curve, so the next process starts from it."""
        seen = {k: n for k, n in enumerate(self._seen) if n}
        return {"ratio": list(self.ratio), "n_obs": list(self.n_obs),
                "shape": {str(k): self.shape[k] for k in seen}, "seen": {str(k): n for k, n in seen.items()},
                "attn_obs": [list(a) for a in self._attn_obs]}

    def restore_online(self, d: dict) -> None:
        try:
            ratio = [float(x) for x in d["ratio"]][:2]
            shape = {int(k): float(v) for k, v in d.get("shape", {}).items() if 1 < int(k) < _TABLE}
            seen = {int(k): int(v) for k, v in d.get("seen", {}).items() if 1 < int(k) < _TABLE}
            n_obs = [int(x) for x in d.get("n_obs", [0, 0])][:2]
            attn = [[float(a[0]), int(a[1]), float(a[2]), int(a[3])] for a in d.get("attn_obs", [])][:2]
        except (KeyError, TypeError, ValueError):
            return  # a record this version cannot read: start from the curve alone
        if len(ratio) == 2 and all(0.3 <= r <= 3.5 for r in ratio):
            self.ratio = ratio
            self.n_obs = n_obs if len(n_obs) == 2 else [0, 0]
            for k, v in shape.items():
                self.shape[k] = min(3.0, max(0.33, v))
                self._seen[k] = seen.get(k, 1)
            if len(attn) == 2:
                self._attn_obs = attn
            self._written_obs = list(self.n_obs)

    def far_off(self) -> str:
        """Why this curve should be measured again ('' when it holds): its online corrections
        stayed far from 1 over many decodes, or its attention term disagrees with them, or it
        was measured while other work took the CPU."""
        lo, hi = 1 / FAR, FAR
        names = ("one-row", "many-row")
        for b, r in enumerate((self.ratio[0], self.many)):
            if self.n_obs[b] >= MIN_EVIDENCE and not lo <= r <= hi:
                return f"{names[b]} decodes ran {r:.2f}x the curve over {self.n_obs[b]} decodes"
        for k in range(2, _TABLE):
            if self._seen[k] >= MIN_EVIDENCE and not lo <= self.shape[k] <= hi:
                return f"{k}-row decodes ran {self.shape[k]:.2f}x the curve's shape over {self._seen[k]} decodes"
        for b in (0, 1):
            near, n_near, far, n_far = self._attn_obs[b]
            if n_near >= MIN_EVIDENCE // 2 and n_far >= MIN_EVIDENCE // 2:
                gap = math.exp(far / n_far - near / n_near)
                if not lo <= gap <= hi:
                    return f"the attention term is off: long-context {names[b]} decodes ran {gap:.2f}x short ones"
        if self.share is not None and self.share < QUIET_SHARE:
            return f"measured while other work took the CPU (it had {self.share:.0%} of its threads' time)"
        return ""

    def best_size(self, probs: list[float], fixed_rows: int = 1, per_node: float = 0.0, margin: float = 0.02,
                  n_past: int = 0, fixed: float = 0.0, slack: float = math.inf) -> int:
        """How many of the candidate nodes (in the given order) to verify.

        `probs[i]` is the chance that node i's path is accepted; `per_node` the drafting time per
        node; `fixed` seconds the step spends on drafting whatever its size (a draft model reading
        the tokens committed since it last ran). Returns 0 when no size beats plain decoding by
        `margin`, but for an exploratory draft: until MIN_EVIDENCE many-row decodes are seen, the
        many-row prediction is a prior (`many`), and where it says nothing pays, one node is
        verified all the same once per EXPLORE_EVERY plain steps, so that evidence arrives. It
        changes only how much is drafted (every draft is verified), and costs at most
        MIN_EVIDENCE extra rows in all; never where drafting has a `fixed` cost (a draft model's
        catch-up is not a probe's price: the cheap drafters' exploration brings the evidence).

        `slack`: how many plain steps the generation may still lose (its scheduler's ledger, see
        `loss_slack`). A size whose worst case (every node rejected: the step yields one token for
        its rows and drafting) loses more than that goes only if its expected gain over a plain
        step also covers the excess, weighed by the chance of that worst case (at most 1 - P_1):
        sum(P) - loss >= (1 - P_1) * (loss - slack). A reply already behind must expect to make
        that up too; a draft that risks nothing always goes. Bets that pay on average by a hair (a
        one-token match kept 15-20% of the time where a second row costs 1.12 steps) then wait
        until the reply is ahead or long enough to carry them: on a short reply a few such losses
        put it below plain (a 13-token chat answer lost 8% on four of them). Likely copies go as
        before, a little shorter at a reply's start, and a flat curve (a GPU) risks nothing.
        """
        t_plain = self.t(fixed_rows, n_past)
        plain = 1.0 / t_plain
        best_n, best_rate = 0, plain * (1.0 + margin)
        gain = 1.0
        miss = 1.0 - probs[0] if probs else 1.0  # the chance that nothing is kept, at most
        # t(k, n_past) inlined: the table's predict(k, 0) plus the attention term, times the
        # corrections for many rows and for k (the same arithmetic, so the same sizes)
        base, e, a0, a1, r = self._base, max(0, n_past - self.n0), self.attn0, self.attn, self.many
        shape = self.shape
        for n, p in enumerate(probs, start=1):
            gain += p
            k = fixed_rows + n
            t = (base[k] + (a0 + a1 * k) * e) * r * shape[k] if 1 < k < _TABLE else self.t(k, n_past)
            spent = t + per_node * n + fixed
            rate = gain / spent
            if rate > best_rate:
                loss = spent / t_plain - 1.0  # plain steps lost if nothing is kept
                if loss <= max(slack, 0.0) or gain - 1.0 - loss >= miss * (loss - slack):
                    best_n, best_rate = n, rate
        if (not best_n and probs and not fixed and self.online and self.n_obs[1] < MIN_EVIDENCE
                and self._plain_run >= EXPLORE_EVERY
                and self.step_loss(fixed_rows + 1, fixed_rows, n_past) <= max(slack, 0.0)):
            return min(EXPLORE_NODES, len(probs))
        return best_n

    def step_loss(self, rows: int, fixed_rows: int = 1, n_past: int = 0) -> float:
        """Plain steps that decoding `rows` rows costs beyond a plain step of `fixed_rows`."""
        return self.t(rows, n_past) / self.t(fixed_rows, n_past) - 1.0

    def to_dict(self) -> dict:
        return {"k": list(self.ks), "ms": [round(t * 1e3, 3) for t in self.ts],
                "attn_us_per_row_per_token": round(self.attn * 1e6, 5),
                "attn0_us_per_token": round(self.attn0 * 1e6, 5), "n0": self.n0,
                "max_exact_rows": self.max_exact_rows, "batch_logit_diff": self.batch_logit_diff,
                "cpu_share": self.share}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        cm = cls(tuple(d["k"]), tuple(t / 1e3 for t in d["ms"]), d["attn_us_per_row_per_token"] / 1e6, d["n0"],
                 d["max_exact_rows"], batch_logit_diff=d.get("batch_logit_diff"),
                 attn0=d.get("attn0_us_per_token", 0.0) / 1e6)
        cm.share = d.get("cpu_share")
        return cm


def loss_slack(ledger: float, tokens: int) -> float:
    """What a generation may still lose, in plain steps, on drafts not kept: `ledger` is what it
    gained so far against plain decoding (tokens committed less the steps they cost, negative when
    behind), `tokens` how many it committed; it may fall behind by LOSS_SHARE of them."""
    return ledger + LOSS_SHARE * tokens


def flat(seconds: float = 0.01, max_exact_rows: int = 1 << 30, batch_logit_diff: float | None = None) -> CostModel:
    """A machine where verifying k tokens costs as much as one (a fast GPU), for tests."""
    return CostModel(KS, tuple(seconds for _ in KS), 0.0, 32, max_exact_rows, online=False,
                     batch_logit_diff=batch_logit_diff)


# -- the exactness policy -----------------------------------------------------------------

POLICIES = ("auto", "strict", "batched")
BATCHED_ROWS = 64  # rows per verification under `batched` (the cost curve decides how many pay)
MIN_STRICT_ROWS = 4  # on a GPU, `auto` keeps `strict` only when the probe leaves this many rows


def resolve_policy(requested: str, max_exact_rows: int, gpu: bool) -> str:
    """`strict`: never verify more rows than the probe found bit-exact, so greedy output is
    identical to plain decoding. `batched`: verify as many rows as pay, taking the backend's
    batched numerics as the model's. `auto`: strict on a CPU (its kernels agree up to 32 rows for
    Q4_0/Q8_0); on a GPU strict only where the probe leaves at least MIN_STRICT_ROWS rows."""
    if requested in ("strict", "batched"):
        return requested
    return "batched" if gpu and max_exact_rows < MIN_STRICT_ROWS else "strict"


def verify_rows(cost: CostModel, policy: str) -> int:
    """The most rows one verification may decode under `policy`."""
    return cost.max_exact_rows if policy == "strict" else max(cost.max_exact_rows, BATCHED_ROWS)


def guarantee(policy: str, cost: CostModel) -> str:
    """What the policy in force promises, in words (stats, bench report, doctor, UI)."""
    if policy == "strict":
        if cost.max_exact_rows <= 1:
            return ("greedy output identical to plain decoding; no batch is bit-exact on this backend, so nothing "
                    "is verified beyond one row: speculation is off (--exactness batched turns it on)")
        return (f"greedy output identical to plain decoding token for token, sampled output the target's "
                f"distribution exactly (at most {cost.max_exact_rows} rows per verification, the largest batch "
                "bit-identical to one-row decodes here)")
    diff = cost.batch_logit_diff
    margin = f"{diff:.3g}" if diff is not None else "not measured"
    return ("sampled output follows the target's distribution as this backend computes it in batches "
            "(rejection rule); greedy output equals plain decoding except at near-ties, where the top two "
            f"logits are closer than the measured batch difference (max |delta logit| {margin})")
