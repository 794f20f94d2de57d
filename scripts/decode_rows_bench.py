"""The whole model's decode of N rows after 64 tokens, logits on every row (what a verification
step runs), 2 threads: the median ms of R decodes per row count, as one JSON line.

    EDGESPEC_KERNELS=stock|DIR python scripts/decode_rows_bench.py MODEL.gguf 9 1 2 3 4 8

EDGESPEC_KERNELS picks the ggml-cpu build (a folder with its build.json); run builds alternately,
each under `flock /tmp/edgespec-cpu.lock` on a shared machine."""
import json, sys, time
import numpy as np
from edgespec import kernels
from edgespec.kv import KVSeq
from edgespec.llama import Context, ContextConfig, Model

m = Model(sys.argv[1])
ctx = Context(m, ContextConfig(512, 512, 2, 1, "q8_0/f16"))
kv = KVSeq(ctx)
rng = np.random.default_rng(3)
prefix = [int(x) for x in rng.integers(100, 20000, 64)]
toks = [int(x) for x in rng.integers(100, 20000, 8)]
kv.extend(prefix, want_logits=False)
R = int(sys.argv[2])
out = {"kernels": kernels.info()["kernels"], "why": kernels.info().get("why", "")[:60]}
for n in map(int, sys.argv[3:]):
    ts = []
    for _ in range(R):
        kv.truncate(len(prefix))
        t0 = time.perf_counter()
        kv.extend(toks[:n], all_rows=n > 1)
        ts.append((time.perf_counter() - t0) * 1e3)
    out[n] = float(np.median(ts))
print(json.dumps(out))
