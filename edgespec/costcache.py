"""The cost curves' cache and its life cycle: a curve loaded or measured once per model and
setup, measured again where it proved far off (healing), what its online correction learned
written back, and what other parts keep beside it (`load_extra`, `store_extra`).

The layers: `costmodel` is the pure model (CostModel, the exactness policy's rules);
`costmeasure` measures a curve on a context; this module sits above both and is the only one
that reads or writes the cache file.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from typing import Callable

from .costmeasure import cpu_share, measure, measure_curve, measure_one_row
from .costmodel import QUIET_SHARE, CostModel
from .llama import Context
from .models import cache_root

log = logging.getLogger(__name__)


def _key(ctx: Context, n_gpu_layers: int, tag: str = "") -> str:
    from .llama import kernel_tag

    p = ctx.model.path
    st = p.stat()
    return (f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}|t{ctx.n_threads}|ngl{n_gpu_layers}|kv{ctx.cfg.kv_type}"
            f"|{platform.node()}" + (f"|rpc{tag}" if tag else "") + kernel_tag(ctx.model))


PROBE_VERSION = 2  # records of an older version (measure and probe) are measured again


CURVE_VERSION = 3  # records of an older curve version keep their probe; their curve is measured again
HEAL_RETRY_S = 600.0  # on a machine that stays busy, a curve due is measured again after this long all the same


def due(cm: "CostModel", quiet_now: Callable[[], bool] | None = None) -> str:
    """Why `cm` should be measured again now ('' if not): it proved far off or was measured on
    a busy machine (CostModel.far_off), and the machine is quiet now (`quiet_now()`, a cheap
    check of the CPU share a decode gets: `quiet_check`; None: taken as quiet), so that the new
    measurement is a quiet one. On a machine that stays busy, HEAL_RETRY_S after the last
    measurement all the same (`heal` then keeps the faster of the two, size by size)."""
    why = cm.far_off()
    if not why or time.time() - cm.measured_at >= HEAL_RETRY_S or quiet_now is None or quiet_now():
        return why
    return ""


def quiet_check(ctx: Context, kv) -> Callable[[], bool]:
    """Whether the machine is quiet for `ctx` now: a few one-row decodes after what `kv` holds
    (dropped after) get at least QUIET_SHARE of their threads' CPU time (costmeasure.cpu_share)."""
    def quiet() -> bool:
        share = cpu_share(ctx, kv)
        log.debug("%s: a decode gets %.0f%% of its threads' CPU time now", ctx.model.path.name, 100 * share)
        return share >= QUIET_SHARE

    return quiet


def _read(cache_file: str | os.PathLike) -> dict:
    try:
        with open(cache_file) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(cache_file: str | os.PathLike, data: dict) -> None:
    try:
        os.makedirs(os.path.dirname(cache_file), exist_ok=True)
        tmp = f"{cache_file}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, cache_file)
    except OSError:
        pass


def load_or_measure(ctx: Context, kv, cache_file: str | os.PathLike, n_gpu_layers: int = 0,
                    quiet: bool = True, tag: str = "", force: bool = False, one_row: bool = False) -> CostModel:
    """The cost curve for this model and setup (`tag`: what else sets it apart, e.g. the RPC
    servers), measured once and cached in `cache_file` with what the online correction learned
    since (see `persist`); a cached curve that should be measured again (`CostModel.far_off`)
    is, here, before any generation (see `heal`). `force`: the curve and the exactness probe
    measured again, replacing the cached ones (`edgespec doctor --remeasure`). `one_row`: for a
    draft model, read for its time per token only: a cached curve as it is, else that time
    measured now (costmeasure.measure_one_row: a fraction of a second, not cached)."""
    key = _key(ctx, n_gpu_layers, tag)
    rec = _read(cache_file).get(key)
    if isinstance(rec, dict) and rec.get("probe") == PROBE_VERSION and not force:
        try:
            cm = CostModel.from_dict(rec)
        except (KeyError, TypeError, ValueError, IndexError):
            cm = None
        if cm is not None:
            cm.restore_online(rec.get("online") or {})
            cm.origin = (str(cache_file), key)
            cm.measured_at = float(rec.get("measured_at", 0.0))
            if one_row:
                return cm
            why = ("measured by an older version" if rec.get("curve") != CURVE_VERSION
                   else due(cm, quiet_check(ctx, kv)))
            return heal(ctx, kv, cm, why, quiet) if why else cm
    if one_row:
        return measure_one_row(ctx, kv)
    # none yet, or one from an older probe version (no attention intercept, no long-context probe)
    if not quiet:
        log.info("measuring what verifying k tokens costs on this machine (%s, %d threads; once, then cached)",
                 ctx.model.path.name, ctx.n_threads, extra={"progress": True})
    cm = measure(ctx, kv, report=not quiet)
    cm.origin, cm.measured_at = (str(cache_file), key), time.time()
    _store(cm)
    return cm


COSTS_FILE = "costs.json"  # the cost cache, in the model cache's folder (edgespec.models.cache_root)


def curve(ctx: Context, kv, n_gpu_layers: int = 0, rpc: tuple[str, ...] = (), quiet: bool = True,
          force: bool = False, one_row: bool = False) -> CostModel:
    """`load_or_measure` for a model loaded here with `n_gpu_layers` offloaded (to the `rpc`
    servers, if any), cached beside the models."""
    return load_or_measure(ctx, kv, cache_root() / COSTS_FILE, n_gpu_layers, quiet, tag=",".join(rpc), force=force,
                           one_row=one_row)


def _store(cm: CostModel) -> None:
    """Write `cm` (curve, probe, online state) as the record it came from."""
    if cm.origin is None:
        return
    file, key = cm.origin
    data = _read(file)
    data[key] = {**cm.to_dict(), "probe": PROBE_VERSION, "curve": CURVE_VERSION, "online": cm.online_state(),
                 "measured_at": cm.measured_at}
    _write(file, data)


def persist(cm: CostModel | None) -> None:
    """Write back what the online correction learned (level, shape, attention check), so that
    the next process (each `edgespec run` is one) starts from it rather than from the curve."""
    if cm is None or cm.origin is None or not cm.online or cm.n_obs == cm._written_obs:
        return  # nothing learned since it was read or written
    file, key = cm.origin
    data = _read(file)
    rec = data.get(key)
    if isinstance(rec, dict):
        rec["online"] = cm.online_state()
        _write(file, data)
        cm._written_obs = list(cm.n_obs)


def load_extra(cm: CostModel | None, name: str):
    """What another part stored beside this curve (`store_extra`), or None."""
    if cm is None or cm.origin is None:
        return None
    file, key = cm.origin
    rec = _read(file).get(key)
    return rec.get(name) if isinstance(rec, dict) else None


def store_extra(cm: CostModel | None, name: str, value) -> None:
    """Keep `value` (JSON) beside this curve, e.g. what auto's chain learned of its members."""
    if cm is None or cm.origin is None:
        return
    file, key = cm.origin
    data = _read(file)
    rec = data.get(key)
    if isinstance(rec, dict) and rec.get(name) != value:
        rec[name] = value
        _write(file, data)


def heal(ctx: Context, kv, cm: CostModel, why: str, quiet: bool = True) -> CostModel:
    """Measure the curve of `cm` again (never during a generation: this resets `kv`'s cache) and
    return the one to use from now on, written back. A measurement that had the CPU to itself
    replaces the old curve; one disturbed too keeps, per size, the faster of the two (load only
    ever slows a decode down) and is measured again when the machine is quiet (`due`). The
    probe is kept."""
    if not quiet:
        log.info("%s: the cost curve is measured again (%s)", ctx.model.path.name, why, extra={"progress": True})
    new = measure_curve(ctx, kv, report=not quiet)
    new.max_exact_rows, new.batch_logit_diff = cm.max_exact_rows, cm.batch_logit_diff
    new.origin = cm.origin
    new.online = cm.online
    if (new.share or 0.0) < QUIET_SHARE and cm.ks == new.ks:
        faster = tuple(min(a, b) for a, b in zip(cm.ts, new.ts))
        keep_new = new.attn0 + 8 * new.attn <= cm.attn0 + 8 * cm.attn
        merged = CostModel(new.ks, faster, new.attn if keep_new else cm.attn, new.n0, new.max_exact_rows,
                           new.online, new.batch_logit_diff, new.attn0 if keep_new else cm.attn0)
        merged.share, merged.origin = new.share, new.origin
        new = merged
    new.measured_at = time.time()
    _store(new)
    return new


def keep_up(ctx: Context, kv, cm: CostModel, quiet: bool = True) -> tuple[CostModel, str]:
    """Between generations (never during one): `cm` measured again where its online corrections
    stayed far from 1 or it was measured on a busy machine, once the machine is quiet (`due`,
    `heal`), with what `kv` held (a conversation's cache) put back after (copied, else read
    again); else what the corrections learned written back (`persist`). Returns the curve to use
    from now on and why it was measured again ('' if it was not)."""
    why = due(cm, quiet_check(ctx, kv))
    if not why:
        persist(cm)
        return cm, ""
    held = list(kv.tokens)
    state = kv.save_state() if held else None
    cm = heal(ctx, kv, cm, why, quiet)
    if held and not (state and kv.restore_state(held, state)):
        kv.extend(held, want_logits=False)
    return cm, why
