"""Train Medusa heads or an EAGLE head on self-distilled data, resumably, with a held-out report.

The loop is plain: minibatches drawn from the training documents, AdamW with warm-up and cosine
decay (optax), gradient clipping; a checkpoint (`ckpt.npz`: parameters, optimizer state, step,
loss history) every `save_every` steps and when interrupted, so Ctrl+C or a kill resumes. The
report gives, per head (Medusa) or for EAGLE's first step, top-1 and top-5 agreement with the
target on held-out documents and the mean accepted length expected of chain drafts.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import EdgespecError
from .data import Dataset


@dataclass
class TrainConfig:
    kind: str  # "medusa" | "eagle" | "eagle3" | "mtp"
    epochs: float = 4.0
    batch: int = 256  # positions per step (EAGLE: rows of `seq` positions make up about this many)
    lr: float = 1e-3
    seq: int = 384  # EAGLE: positions per row
    draft_vocab: int = 8192
    medusa_heads: int = 3
    medusa_layers: int = 1
    save_every: int = 50
    seed: int = 0
    noise: float = 0.2  # EAGLE: uniform feature noise of this width during training (as the paper)
    ttt_steps: int = 4  # EAGLE-3: draft steps unrolled in training (training-time test)


@dataclass
class Report:
    kind: str
    top1: list[float]  # per head (Medusa) or per depth
    top5: list[float]
    mean_accepted: float  # expected tokens per step of a top-1 chain (1 + accepted drafts)
    n_positions: int
    untrained_top1: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("kind", "top1", "top5", "mean_accepted", "n_positions", "untrained_top1")}


def pick_vocab(ds: Dataset, docs: list[int], k: int) -> np.ndarray:
    """The draft vocabulary: the k tokens the target says most often in the answers."""
    counts = np.zeros(int(ds.tokens.max()) + 1, np.int64)
    for j in docs:
        s, e = ds.doc(j)
        np.add.at(counts, ds.tokens[s + ds.n_prompt[j] : e], 1)
    order = np.argsort(-counts, kind="stable")
    ids = order[: min(k, int((counts > 0).sum()))]
    return np.sort(ids).astype(np.int64)


class Trainer:
    def __init__(self, cfg: TrainConfig, ds: Dataset, target_weights, work: Path, eagle_shape: dict | None = None,
                 progress: Callable[[dict], None] | None = None, train_docs: list[int] | None = None):
        """`train_docs`: train on these documents only (a learning curve); the held-out ones stay
        the dataset's own split."""
        import jax
        import optax

        self.cfg, self.ds, self.work = cfg, ds, Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.progress = progress or (lambda info: None)
        self.train_docs, self.test_docs = ds.split()
        if train_docs is not None:
            self.train_docs = list(train_docs)
        if not self.train_docs:
            raise EdgespecError("too little data: no training documents")
        self.vocab = pick_vocab(ds, self.train_docs, cfg.draft_vocab)
        self.index = np.full(max(int(ds.tokens.max()) + 1, int(self.vocab.max()) + 1), -1, np.int64)
        self.index[self.vocab] = np.arange(len(self.vocab))
        self.lm_t = jax.numpy.asarray(target_weights.lm_head(self.vocab).T)
        self.d = ds.n_embd
        self.rng = np.random.default_rng(cfg.seed)
        if cfg.kind == "medusa":
            from .models import medusa_init

            self.params = medusa_init(self.d, cfg.medusa_heads, cfg.medusa_layers)
            self.positions = self._medusa_positions(self.train_docs)
            n_units = len(self.positions)
            self.steps_per_epoch = max(1, n_units // cfg.batch)
        elif cfg.kind in ("eagle", "mtp", "eagle3"):
            from .models import eagle3_init, eagle_init, mtp_init

            self.shape = eagle_shape or {}
            s = self.shape
            if cfg.kind == "eagle3":  # the features are three taps of the target's width
                self.d = ds.n_embd // 3
                self._lm_rows = np.asarray(target_weights.lm_head(self.vocab), np.float32)
                self.params = eagle3_init(self.d, self.d, s["n_head"], s["n_head_kv"], s["head_dim"], s["n_ff"],
                                          self._lm_rows, cfg.seed)
            else:
                init = eagle_init if cfg.kind == "eagle" else mtp_init
                self.params = init(self.d, s["n_head"], s["n_head_kv"], s["head_dim"], s["n_ff"], cfg.seed)
            uniq = np.unique(ds.tokens)
            self.emb_index = np.full(int(ds.tokens.max()) + 1, -1, np.int64)
            self.emb_index[uniq] = np.arange(len(uniq))
            self.emb = jax.numpy.asarray(target_weights.embed(uniq))
            self.rows = self._eagle_rows(self.train_docs)
            self.rows_per_step = max(1, cfg.batch // cfg.seq)
            self.steps_per_epoch = max(1, math.ceil(len(self.rows) / self.rows_per_step))
        else:
            raise EdgespecError(f"cannot train {cfg.kind!r} heads (medusa, eagle, eagle3, mtp)")
        self.params = {k: jax.numpy.asarray(v) for k, v in self.params.items()}
        self.total_steps = max(1, int(self.steps_per_epoch * cfg.epochs))
        sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, min(50, self.total_steps // 10 + 1), self.total_steps,
                                                   cfg.lr * 0.05)
        self.opt = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(sched, weight_decay=0.0))
        self.opt_state = self.opt.init(self.params)
        self.step = 0
        self.history: list[tuple[int, float]] = []
        self._step_fn = jax.jit(self._make_step())
        self._resume()

    # -- data -----------------------------------------------------------------------------

    def _medusa_positions(self, docs: list[int]) -> np.ndarray:
        """Rows i whose feature predicts an answer token (i+1 in the answer) with a label for head 0."""
        out = []
        for j in docs:
            s, e = self.ds.doc(j)
            out.append(np.arange(s + self.ds.n_prompt[j] - 1, e - 2))
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def _medusa_batch(self, idx: np.ndarray):
        """Features and labels [B, heads]: the draft-vocabulary index of the token k+2 places
        ahead, -1 when it is outside the draft vocabulary (a miss), -2 past the document's end."""
        H = self.cfg.medusa_heads
        feats = np.asarray(self.ds.feats[idx], np.float32)
        labels = np.full((len(idx), H), -2, np.int64)
        doc_end = self._doc_end()
        for k in range(H):
            tgt = idx + 2 + k
            ok = tgt < doc_end[idx]
            labels[ok, k] = self.index[self.ds.tokens[tgt[ok]]]
        return feats, labels

    def _doc_end(self) -> np.ndarray:
        if not hasattr(self, "_ends"):
            ends = np.zeros(len(self.ds.tokens), np.int64)
            for j in range(len(self.ds.starts)):
                s, e = self.ds.doc(j)
                ends[s:e] = e
            self._ends = ends
        return self._ends

    def _eagle_rows(self, docs: list[int]) -> list[tuple[int, int, int]]:
        """(start, end, first answer row) windows of at most `seq` pairs; pair i = (token i+1, feature i)."""
        T = self.cfg.seq
        rows = []
        for j in docs:
            s, e = self.ds.doc(j)
            a = s + self.ds.n_prompt[j]
            for w in range(s, e - 2, T):
                rows.append((w, min(w + T, e - 2), a))
        return rows

    def _eagle3_batch(self, rows: list[tuple[int, int, int]]):
        """Taps at i, the tokens at i+1+k (embedding-table indices) and the labels at i+2+k for
        every unrolled step k: -2 past the document's end or before its answer."""
        T, K = self.cfg.seq, self.cfg.ttt_steps
        B = len(rows)
        taps = np.zeros((B, T, self.ds.n_embd), np.float32)
        toks_in = np.zeros((K, B, T), np.int64)
        labels = np.full((K, B, T), -2, np.int64)
        pos = np.zeros((B, T), np.int64)
        valid = np.zeros((B, T), bool)
        toks, ends = self.ds.tokens, self._doc_end()
        for b, (w, e, a) in enumerate(rows):
            n = e - w
            i = np.arange(w, e)
            taps[b, :n] = self.ds.feats[w:e]
            end = ends[w]
            for k in range(K):
                t_in = np.minimum(i + 1 + k, end - 1)
                toks_in[k, b, :n] = self.emb_index[toks[t_in]]
                t_out = i + 2 + k
                ok = (t_out < end) & (t_out >= a)
                labels[k, b, :n][ok] = self.index[toks[t_out[ok]]]
            pos[b, :n] = i - self._doc_start(w)
            valid[b, :n] = True
        return taps, toks_in, pos, valid, labels

    def _eagle_batch(self, rows: list[tuple[int, int, int]], noise: bool):
        T, d = self.cfg.seq, self.d
        B = len(rows)
        tok_next = np.zeros((B, T), np.int64)
        feats = np.zeros((B, T, d), np.float32)
        nxt = np.zeros((B, T, d), np.float32)
        labels = np.full((B, T), -2, np.int64)
        pos = np.zeros((B, T), np.int64)
        valid = np.zeros((B, T), bool)
        toks = self.ds.tokens
        for b, (w, e, a) in enumerate(rows):
            n = e - w
            i = np.arange(w, e)
            tok_next[b, :n] = self.emb_index[toks[i + 1]]
            feats[b, :n] = self.ds.feats[w:e]
            nxt[b, :n] = self.ds.feats[w + 1 : e + 1]
            lab = self.index[toks[i + 2]]
            labels[b, :n] = np.where(i + 2 >= a, lab, -2)
            pos[b, :n] = i - self._doc_start(w)
            valid[b, :n] = True
        if noise and self.cfg.noise > 0:
            feats += (self.rng.random(feats.shape, np.float32) - 0.5) * self.cfg.noise
        return tok_next, feats, pos, valid, nxt, labels

    def _layer_args(self) -> tuple:
        """(heads, kv heads, head size, rope theta, rms eps) of the EAGLE/EAGLE-3/MTP layer."""
        s = self.shape
        return s["n_head"], s["n_head_kv"], s["head_dim"], s["rope_theta"], s["rms_eps"]

    def _doc_start(self, row: int) -> int:
        j = int(np.searchsorted(self.ds.starts, row, side="right")) - 1
        return self.ds.starts[j]

    # -- steps ----------------------------------------------------------------------------

    def _make_step(self):
        import jax
        import optax

        cfg, lm_t = self.cfg, self.lm_t
        if cfg.kind == "medusa":
            from .models import medusa_loss

            def loss_fn(p, feats, labels):
                return medusa_loss(p, feats, labels, lm_t, cfg.medusa_heads, cfg.medusa_layers)[0]
        elif cfg.kind == "eagle3":
            from .models import eagle3_loss

            shape = self._layer_args()
            emb_table = self.emb

            def loss_fn(p, taps, toks_in, pos, valid, labels):
                return eagle3_loss(p, taps, emb_table[toks_in], pos, valid, labels, shape, cfg.ttt_steps)[0]
        else:
            from .models import eagle_loss

            shape = self._layer_args()
            emb_table = self.emb

            def loss_fn(p, tok_next, feats, pos, valid, nxt, labels):
                return eagle_loss(p, emb_table[tok_next], feats, pos, valid, nxt, labels, lm_t, shape)[0]

        opt = self.opt

        def step(params, opt_state, *batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return step

    def _next_batch(self):
        cfg = self.cfg
        if cfg.kind == "medusa":
            idx = self.rng.choice(self.positions, size=min(cfg.batch, len(self.positions)), replace=False)
            return self._medusa_batch(np.sort(idx)), cfg.batch
        pick = self.rng.choice(len(self.rows), size=min(self.rows_per_step, len(self.rows)), replace=False)
        rows = [self.rows[i] for i in pick]
        batch = self._eagle3_batch(rows) if cfg.kind == "eagle3" else self._eagle_batch(rows, noise=True)
        return batch, sum(e - w for w, e, _ in rows)

    def train(self) -> None:
        """Run to `total_steps` (from where a checkpoint left off); KeyboardInterrupt saves first."""
        t0, done_tokens = time.perf_counter(), 0
        start_step = self.step
        try:
            while self.step < self.total_steps:
                batch, n_tok = self._next_batch()
                self.params, self.opt_state, loss = self._step_fn(self.params, self.opt_state, *batch)
                self.step += 1
                done_tokens += n_tok
                loss = float(loss)
                if not math.isfinite(loss):
                    raise EdgespecError(f"training diverged at step {self.step} (loss {loss}); lower --lr")
                self.history.append((self.step, loss))
                dt = time.perf_counter() - t0
                rate = (self.step - start_step) / dt if dt > 0 else 0.0
                self.progress({"step": self.step, "total": self.total_steps, "loss": loss,
                               "tokens_per_s": done_tokens / dt if dt > 0 else 0.0,
                               "eta_s": (self.total_steps - self.step) / rate if rate > 0 else 0.0})
                if self.step % self.cfg.save_every == 0:
                    self.save()
        except KeyboardInterrupt:
            self.save()
            raise
        self.save()

    # -- checkpoints ----------------------------------------------------------------------

    def _ckpt(self) -> Path:
        return self.work / f"ckpt-{self.cfg.kind}.npz"

    def save(self) -> None:
        import jax

        leaves = jax.tree_util.tree_leaves((self.params, self.opt_state))
        arrays = {f"a{i}": np.asarray(x) for i, x in enumerate(leaves)}
        tmp = self._ckpt().with_suffix(".tmp.npz")
        np.savez(tmp, step=self.step, history=np.asarray(self.history, np.float64).reshape(-1, 2),
                 config=json.dumps(self.cfg.__dict__), rng=json.dumps(self.rng.bit_generator.state), **arrays)
        tmp.replace(self._ckpt())

    def _resume(self) -> None:
        import jax

        f = self._ckpt()
        if not f.exists():
            return
        z = np.load(f, allow_pickle=False)
        if json.loads(str(z["config"])) != json.loads(json.dumps(self.cfg.__dict__)):
            raise EdgespecError(f"{f} was trained with other settings; remove it or use another --work folder")
        treedef = jax.tree_util.tree_structure((self.params, self.opt_state))
        leaves = [jax.numpy.asarray(z[f"a{i}"]) for i in range(treedef.num_leaves)]
        self.params, self.opt_state = jax.tree_util.tree_unflatten(treedef, leaves)
        self.step = int(z["step"])
        self.history = [(int(a), float(b)) for a, b in z["history"]]
        self.rng.bit_generator.state = json.loads(str(z["rng"]))

    # -- report ---------------------------------------------------------------------------

    def evaluate(self, params: dict | None = None) -> Report:
        """Held-out agreement with the target (the training documents when there is no held-out one)."""
        import jax

        params = self.params if params is None else params
        docs = self.test_docs or self.train_docs
        cfg = self.cfg
        if cfg.kind == "medusa":
            from .models import medusa_logits

            pos = self._medusa_positions(docs)
            feats, labels = self._medusa_batch(pos)
            logits = np.asarray(jax.jit(lambda p, f: medusa_logits(p, f, self.lm_t, cfg.medusa_heads,
                                                                  cfg.medusa_layers))(params, feats))
            return _report("medusa", logits, labels)
        if cfg.kind == "eagle3":
            return self._evaluate_eagle3(params, docs)
        from .models import eagle_forward, readout

        shape = self._layer_args()
        rows = self._eagle_rows(docs)
        fwd = jax.jit(lambda p, e, f, q, v: readout(p, eagle_forward(p, e, f, q, v, *shape), shape[-1]) @ self.lm_t)
        all_logits, all_labels = [], []
        for i in range(0, len(rows), 8):
            tok_next, feats, pos, valid, _, labels = self._eagle_batch(rows[i : i + 8], noise=False)
            lg = np.asarray(fwd(params, self.emb[tok_next], feats, pos, valid))
            keep = labels > -2
            all_logits.append(lg[keep])
            all_labels.append(labels[keep])
        return _report(cfg.kind, np.concatenate(all_logits)[:, None], np.concatenate(all_labels)[:, None])

    def _evaluate_eagle3(self, params: dict, docs: list[int]) -> Report:
        """Top-1/top-5 per unrolled step (the draft's own states as g, the target's tokens as
        input: what depth k+1 of a chain sees when the k tokens before it were accepted)."""
        import jax

        from .models import eagle3_forward

        shape = self._layer_args()
        K = self.cfg.ttt_steps
        fwd = jax.jit(lambda p, t, e, q, v: eagle3_forward(p, t, e, q, v, K, *shape))
        rows = self._eagle_rows(docs)
        all_logits, all_labels = [], []
        for i in range(0, len(rows), 8):
            taps, toks_in, pos, valid, labels = self._eagle3_batch(rows[i : i + 8])
            lg = np.asarray(fwd(params, taps, self.emb[toks_in], pos, valid))  # [K, B, T, Vd]
            keep = labels[0] > -2
            all_logits.append(lg[:, keep].transpose(1, 0, 2))
            all_labels.append(labels[:, keep].T)
        return _report("eagle3", np.concatenate(all_logits), np.concatenate(all_labels))

    def untrained(self) -> dict:
        from .models import eagle3_init, eagle_init, medusa_init, mtp_init

        import jax

        cfg = self.cfg
        if cfg.kind == "medusa":
            p = medusa_init(self.d, cfg.medusa_heads, cfg.medusa_layers)
        elif cfg.kind == "eagle3":
            s = self.shape
            p = eagle3_init(self.d, self.d, s["n_head"], s["n_head_kv"], s["head_dim"], s["n_ff"], self._lm_rows, cfg.seed)
        else:
            s = self.shape
            p = (eagle_init if cfg.kind == "eagle" else mtp_init)(self.d, s["n_head"], s["n_head_kv"], s["head_dim"],
                                                                   s["n_ff"], cfg.seed)
        return {k: jax.numpy.asarray(v) for k, v in p.items()}

    def export_params(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(v, np.float32) for k, v in self.params.items()}


def _report(kind: str, logits: np.ndarray, labels: np.ndarray) -> Report:
    """logits [N, H, K], labels [N, H] (-1: outside the draft vocabulary, a miss; -2: no label)."""
    n, H = labels.shape
    top5 = np.argpartition(-logits, 4, axis=-1)[..., :5]
    hit1 = logits.argmax(-1) == labels
    hit5 = (top5 == labels[..., None]).any(-1)
    has = labels > -2
    top1 = [float(hit1[:, h][has[:, h]].mean()) if has[:, h].any() else 0.0 for h in range(H)]
    t5 = [float(hit5[:, h][has[:, h]].mean()) if has[:, h].any() else 0.0 for h in range(H)]
    if kind in ("medusa", "eagle3"):  # a chain: the leading heads (EAGLE-3: unrolled steps) all right
        run = np.cumprod(hit1, axis=1)
        mal = 1.0 + float(run.sum(1).mean())
    elif kind == "mtp":  # next-2 only: one draft token a step
        mal = 1.0 + top1[0]
    else:  # one step measured; deeper steps assumed as good as the first (an upper bound)
        a = top1[0]
        mal = 1.0 + sum(a ** k for k in range(1, 6))
    return Report(kind, top1, t5, mal, n)
