"""#39: lookahead over plain on the shared copy-heavy prompts, each prompt a separate `edgespec run`,
with a poisoned cost curve (every k >= 2 2.5x too dear, attention 10x, as a busy machine left it) and
a clean one. usage: python scripts/heal_bench.py MODEL THREADS REPEATS [PROMPTS.jsonl]"""
import json, math, os, shutil, subprocess, sys, tempfile
model, threads, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
from edgespec.models import cache_root
real = str(cache_root())
prompts = [json.loads(l) for l in open(sys.argv[4] if len(sys.argv) > 4 else "../shared/bench/prompts.jsonl")]
prompts = [p for p in prompts if p["category"] in ("code-edit", "quote-summarize", "rag", "extraction")]
def cache(name):
    d = tempfile.mkdtemp(prefix=f"heal-{name}-")
    os.symlink(os.path.join(real, "models"), os.path.join(d, "models"))
    return d
def run(c, spec, p):
    cmd = [sys.executable, "-m", "edgespec", "run", "-m", model, "-t", threads, "--json", "--spec", spec,
           "-n", str(p["max_tokens"]), "-p", p["messages"][-1]["content"]]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "EDGESPEC_CACHE": c})
    assert r.returncode == 0, r.stderr
    o = json.loads(r.stdout)
    return o["stats"]["tokens_per_s"], o["token_ids"], o["stats"].get("mean_accepted_length")
clean = cache("clean")
subprocess.run([sys.executable, "-m", "edgespec", "doctor", "-m", model, "-t", threads, "--remeasure"],
               env={**os.environ, "EDGESPEC_CACHE": clean}, check=True, capture_output=True)
rec = json.load(open(os.path.join(clean, "costs.json")))
print("clean curve:", {k: (v["ms"][:8], v["attn_us_per_row_per_token"], v.get("cpu_share")) for k, v in rec.items()})
res = {"clean": [], "poisoned": []}
for rep in range(repeats):
    poisoned = cache("poisoned")
    pr = {}
    for key, v in rec.items():
        pr[key] = dict(v, ms=[ms * (2.5 if k >= 2 else 1) for k, ms in zip(v["k"], v["ms"])],
                       attn_us_per_row_per_token=v["attn_us_per_row_per_token"] * 10,
                       attn0_us_per_token=v["attn0_us_per_token"] * 10, online={}, measured_at=0, cpu_share=1.0)
    json.dump(pr, open(os.path.join(poisoned, "costs.json"), "w"))
    for p in prompts:
        for arm, c in (("clean", clean), ("poisoned", poisoned)):
            none, t0, _ = run(c, "none", p)
            la, t1, mal = run(c, "lookahead", p)
            assert t0 == t1, p["id"]
            res[arm].append(la / none)
            print(rep, p["id"], arm, f"none {none:.1f} lookahead {la:.1f} tok/s = {la / none:.2f}x (mal {mal})", flush=True)
    shutil.rmtree(poisoned)
g = {a: math.exp(sum(map(math.log, r)) / len(r)) for a, r in res.items()}
print(f"geomean lookahead/none: clean {g['clean']:.3f}x, poisoned {g['poisoned']:.3f}x, poisoned/clean {g['poisoned'] / g['clean']:.3f}")
