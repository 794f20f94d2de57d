"""`edgespec doctor`: what llama.cpp runs on here and what that means for speculation."""

from __future__ import annotations

import json

from .. import __version__
from ..costmodel import QUIET_SHARE
from .kernels_cmd import describe
from .options import DoctorOptions


def report(engine) -> dict:
    import llama_cpp

    from .. import backend, kernels, methods

    m, cfg = engine.target, engine.cfg
    n_layer = m.n_layer
    ngl = cfg.n_gpu_layers
    offloaded = n_layer if ngl < 0 else min(ngl, n_layer)
    return {
        "edgespec": __version__, "llama_cpp_python": llama_cpp.__version__,
        "gpu_offload_supported": backend.gpu_offload(), "rpc_supported": backend.rpc(),
        "devices": backend.devices(), "system_info": backend.system_info(),
        "cpu_kernels": kernels.info(),
        "model": str(m.path), "layers": n_layer, "nextn_layers": m.n_layer_nextn,
        "offloaded_layers": offloaded if engine.on_gpu else 0, "threads": engine.ctx.n_threads,
        "kv_type": cfg.kv_type, "context": engine.n_ctx_seq,
        "cost": engine.cost.to_dict(), "exactness": engine.exactness_info(),
        "cost_online": {"ratio": [round(r, 3) for r in engine.cost.ratio], "decodes": list(engine.cost.n_obs),
                        "far_off": engine.cost.far_off()},
        "methods": methods.available(engine), "auto": methods.auto_members(engine),
        "draft_model": cfg.draft if engine.draft_model else None, "draft_model_why": cfg.draft_why or None,
        "reply_history": _history(),
    }


def _history() -> dict:
    """The local user's reply history (`chat`'s drafting source) and the API keys' (`serve`)."""
    from .. import history
    from ..models import cache_root

    root = cache_root()
    keys = sorted(history.folder(root).glob("key-*.npz")) if history.folder(root).exists() else []
    return {**history.describe(history.path_for(root)), "capacity": history.CAPACITY, "api_keys": len(keys),
            "api_keys_bytes": sum(p.stat().st_size for p in keys)}


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "?"


def run_doctor(a: DoctorOptions, cfg) -> int:
    from ..engine import Engine

    engine = Engine(cfg, quiet=a.json)
    try:
        if a.remeasure:
            engine.remeasure_cost(quiet=a.json)
        r = report(engine)
    finally:
        engine.close()
    if a.json:
        print(json.dumps(r))
        return 0
    ex, c = r["exactness"], r["cost"]
    print(f"edgespec {r['edgespec']}, llama-cpp-python {r['llama_cpp_python']}")
    print(f"GPU offload: {'supported' if r['gpu_offload_supported'] else 'not in this build'}; "
          f"RPC: {'supported' if r['rpc_supported'] else 'not in this build'}")
    print(f"llama.cpp: {r['system_info']}")
    print(f"CPU kernels: {describe(r['cpu_kernels'])}")
    print("devices:")
    for d in r["devices"]:
        print(f"  {d['name']:<10} {d['type']:<6} {d['description']}  (memory {_size(d['memory_free'])} free of "
              f"{_size(d['memory_total'])})")
    where = f"{r['offloaded_layers']} of {r['layers']} layers on the GPU" if r["offloaded_layers"] else "all on the CPU"
    print(f"model: {r['model']} ({r['layers']} layers{', ' + str(r['nextn_layers']) + ' nextn' if r['nextn_layers'] else ''}; "
          f"{where}); {r['threads']} threads, KV cache {r['kv_type']}, context {r['context']}")
    base = c["ms"][0]
    curve = "  ".join(f"{k}:{ms:.1f} ({ms / base:.1f}x)" for k, ms in zip(c["k"], c["ms"]) if k in (1, 2, 4, 8, 16, 32))
    print(f"cost of verifying k rows (ms, at {c['n0']} tokens of context): {curve}")
    print(f"  attention: {c.get('attn0_us_per_token', 0.0):.4f} us per cached token plus "
          f"{c['attn_us_per_row_per_token']:.4f} us per row per cached token")
    share, on = c.get("cpu_share"), r["cost_online"]
    quiet = "not recorded (an older version measured it)" if share is None else (
        f"{share:.0%} of its threads' CPU time" + (" (quiet)" if share >= QUIET_SHARE else
                                                   " (other work took the CPU: it will be measured again)"))
    print(f"  measured with {quiet}; since then decodes ran {on['ratio'][0]:.2f}x (one row) and "
          f"{on['ratio'][1]:.2f}x (many rows) the curve over {on['decodes'][0]} + {on['decodes'][1]} decodes"
          + (f"; to be measured again: {on['far_off']}" if on["far_off"] else ""))
    diff = ex["batch_logit_diff"]
    kern = {"per-row": " (K-quant kernels: per-row at every batch size, weights not repacked)",
            "batch-invariant": " (batch-invariant kernels)"}.get(ex.get("kernels"), " (stock kernels)")
    print(f"exactness probe{kern}: batches bit-identical to one-row decodes up to {ex['max_exact_rows']} rows; largest "
          f"|delta logit| at 2-32 rows: {'not measured' if diff is None else f'{diff:.3g}'}")
    print(f"policy: {ex['policy']} (--exactness {ex['requested']}), verifying up to {ex['max_verify_rows']} rows: "
          f"{ex['guarantee']}")
    if r["draft_model"]:
        why = {"same vocabulary": "the smallest model on disk with the target's vocabulary",
               "catalog pair": "the catalog's pair"}.get(r["draft_model_why"], "-md")
        print(f"draft model: {r['draft_model']} ({why}; -md none: without)")
    print(f"methods: {', '.join(r['methods'])}; auto drafts with {' then '.join(r['auto'])}")
    h = r["reply_history"]
    kept = (f"{h['bytes'] / 2**20:.1f} MiB, {h['nodes']} trie nodes of at most {h['capacity']}"
            if h["exists"] else "none kept yet")
    print(f"reply history (chat drafts from it; --no-history: off): {h['path']} ({kept})"
          + (f"; {h['api_keys']} API keys' (serve): {h['api_keys_bytes'] / 2**20:.1f} MiB" if h["api_keys"] else ""))
    return 0
