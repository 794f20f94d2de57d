"""Property: whatever the input lines (malformed, hostile, duplicated) and wherever a batch is
killed, the batch never crashes, and after a resume every input line has exactly one output
line, with finished results kept as they were."""

import json
import os
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgespec.frontends.batch import Writer, pending_requests, read_requests, scan_output
from edgespec.serving import Defaults, run_requests
from edgespec.sampling import SamplingConfig

D = Defaults(2, SamplingConfig())

words = st.sampled_from(["Hi", "Count: 1, 2,", "red green", "\ud800", "", "é", "x" * 30])
ids = st.sampled_from(["a", "b", "c", "d", 7, "", None, "\udc00"])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 5), st.floats(-1, 3), st.just(float("nan")), words)
body = st.fixed_dictionaries(
    {"prompt": words},
    optional={"max_tokens": st.integers(-1, 3), "temperature": scalars, "top_k": scalars, "top_p": scalars,
              "min_p": scalars, "seed": scalars, "stop": st.one_of(words, st.lists(words, max_size=5)),
              "n": scalars, "stream": scalars, "bogus": scalars},
)
request = st.builds(lambda cid, b: {"custom_id": cid, "body": b} if cid is not None else b, ids, body)
raw = st.one_of(
    request.map(json.dumps),
    request.map(lambda r: json.dumps(r, ensure_ascii=False)),
    st.sampled_from(["{not json", "[1, 2]", "null", "", "   ", '{"custom_id": "a"}', '"just a string"']),
    st.builds(lambda m: json.dumps({"custom_id": "m", "body": {"messages": m, "max_tokens": 2}}),
              st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "tool", 3]), "content": words}),
                       max_size=2)),
)


class Killed(BaseException):
    pass


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(lines=st.lists(raw, min_size=1, max_size=6), kill_after=st.integers(0, 6), n_par=st.sampled_from([1, 2]))
def test_batch_survives_any_input_and_any_kill(smol, lines, kill_after, n_par):
    reqs = read_requests(lines, D)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "out.jsonl")

        def run(todo, limit=None):
            w = Writer(path)
            written = [0]

            def emit(req, rec):
                if limit is not None and written[0] >= limit:
                    raise Killed  # as SIGKILL between two results: nothing more is written
                w.write(rec)
                written[0] += 1

            try:
                run_requests(smol, todo, "lookahead", n_par, emit, quiet=True)
            except Killed:
                pass
            finally:
                w.close()

        run(reqs, kill_after)
        with open(path, encoding="utf-8") as f:
            before = f.read().splitlines()
        todo = pending_requests(reqs, scan_output(path))
        run(todo)
        with open(path, encoding="utf-8") as f:
            after = f.read().splitlines()
        assert after[: len(before)] == before  # finished results survive the kill as they were
        got = [json.loads(x)["custom_id"] for x in after]
        assert sorted(got) == sorted(r.custom_id for r in reqs), "every input line gets exactly one output line"
