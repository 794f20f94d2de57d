"""(issue 38's closing note; run: python docs/grammar_bench.py [MODEL] [REPEATS] [json] [PROMPT_IDS])
Constrained JSON generation, plain (--spec none) vs lookahead, side by side: each prompt with
its schema, both methods alternated per repeat, outputs checked equal; tokens/s of generation."""
import json, sys, time
from edgespec.engine import Engine, EngineConfig
from edgespec.rows import json_schema_grammar
from edgespec.sampling import make_sampling

PEOPLE = {"type": "object", "required": ["people"], "properties": {"people": {"type": "array", "items": {
    "type": "object", "required": ["name", "role", "city"], "additionalProperties": False,
    "properties": {"name": {"type": "string"}, "role": {"type": "string"}, "city": {"type": "string"}}}}}}
RATINGS = {"type": "object", "required": ["ratings"], "properties": {"ratings": {"type": "array", "items": {
    "type": "object", "required": ["review", "score"], "additionalProperties": False,
    "properties": {"review": {"type": "integer"}, "score": {"type": "integer"}}}}}}
ORDERS = {"type": "object", "required": ["orders"], "properties": {"orders": {"type": "array", "items": {
    "type": "object", "required": ["id", "item", "quantity", "price"], "additionalProperties": False,
    "properties": {"id": {"type": "string"}, "item": {"type": "string"}, "quantity": {"type": "integer"},
                   "price": {"type": "number"}}}}}}
rows = {json.loads(l)["id"]: json.loads(l) for l in open("/work/shared/bench/prompts.jsonl")}
CASES = [
    ("extract-8", rows["extract-8"]["messages"], PEOPLE),
    ("mtbench-131", rows["mtbench-131"]["messages"], RATINGS),
    ("orders", [{"role": "user", "content": "Extract the orders as JSON {\"orders\": [{id, item, quantity, price}]}:\n"
                 "Order A-101: 3 blue mugs at 4.50 each. Order A-102: 1 red kettle at 19.99. Order A-103: 12 "
                 "paper napkins packs at 0.99. Order A-104: 2 blue mugs at 4.50 each. Order A-105: 1 toaster at 24.00."}],
     ORDERS),
]
CASES = [c for c in CASES if len(sys.argv) <= 4 or c[0] in sys.argv[4].split(",")]
model = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct:q4_0"
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
eng = Engine(EngineConfig(model=model, n_ctx=2048, max_branches=8))
tot = {}
for name, msgs, schema in CASES:
    toks = eng.prompt_tokens(messages=msgs)
    for constrained in ((True, False) if len(sys.argv) <= 3 else (True,)):
        cfg = make_sampling(0.0, grammar=json_schema_grammar(schema) if constrained else None)
        res = {"none": [0, 0.0, None, 0], "lookahead": [0, 0.0, None, 0]}
        for r in range(repeats):
            for m in (("none", "lookahead") if r % 2 == 0 else ("lookahead", "none")):
                g = eng.start(toks, 256, cfg, m).run()
                res[m][0] += len(g.tokens); res[m][1] += g.stats.t_gen; res[m][3] += g.stats.n_steps
                assert res[m][2] in (None, g.tokens); res[m][2] = g.tokens
        assert res["none"][2] == res["lookahead"][2], "lookahead differs from plain"
        ok = True
        if constrained:
            try: json.loads(eng.target.detokenize(res["none"][2]))
            except ValueError: ok = False
        tag = "json" if constrained else "free"
        a, b = res["none"][0] / res["none"][1], res["lookahead"][0] / res["lookahead"][1]
        for k, v in (("none", res["none"]), ("lookahead", res["lookahead"])):
            t = tot.setdefault((tag, k), [0, 0.0]); t[0] += v[0]; t[1] += v[1]
        print(f"{name:12s} {tag}: {len(res['none'][2]):4d} tokens{' (valid JSON)' if constrained and ok else ''}, steps "
              f"{res['none'][3] // repeats}/{res['lookahead'][3] // repeats}, none {a:6.1f} tok/s, lookahead {b:6.1f} tok/s, "
              f"x{b / a:.2f}", flush=True)
for tag in sorted({t for t, _ in tot}):
    a = tot[(tag, "none")][0] / tot[(tag, "none")][1]; b = tot[(tag, "lookahead")][0] / tot[(tag, "lookahead")][1]
    print(f"all {tag}: none {a:.1f} tok/s, lookahead {b:.1f} tok/s, x{b / a:.2f}")
