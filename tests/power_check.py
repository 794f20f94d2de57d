"""The power of tests/test_distribution.py against the textbook bug, measured (not collected by the
suite; run it by name):

    python -m pytest tests/power_check.py -s -k eagle3          # one method
    POWER_M=1500 python -m pytest tests/power_check.py -s       # every method, more completions

For a method, the bug is planted in edgespec.verify (a drafted token kept with its own target
probability instead of min(1, p/q), the rejected case drawn from p instead of the residual; in a
tree without draft probabilities, a child kept with its token's own probability, else a draw from
p), POWER_M buggy completions are sampled as the test samples them, and the chi-square test's
power at the test's own size n is computed: the noncentrality over the test's pooled cells,
lambda = n * sum((b - e)^2 / e) with b the buggy law estimated from the completions, less its
sampling bias n * sum(b(1 - b) / (M e)); power = P(ncx2(df, lambda) > chi2's 1 - ALPHA point).
Each line printed is `method n M lambda power`."""

from __future__ import annotations

import os
from collections import Counter

import pytest
from scipy.stats import chi2, ncx2

import test_distribution as td
from verifier_law import kept_by_own_probability
from test_distribution import expected_of, gpu_like, tiny, twin  # noqa: F401  (fixtures)
from edgespec import verify
from edgespec.schedulers import pearl as pearl_scheduler

M = int(os.environ.get("POWER_M", "400"))


def power(samples: list[tuple], expected: dict[tuple, float], n: int) -> tuple[float, float, int]:
    """(lambda, power, df) of the test's chi-square at size n against the law of `samples`."""
    m = len(samples)
    counts = Counter(samples)
    cells, pool_b, pool_e = [], 0.0, 0.0
    for k, p in sorted(expected.items(), key=lambda kv: -kv[1]):
        b = counts.get(k, 0) / m
        if n * p >= 5:
            cells.append((b, p))
        else:
            pool_b += b
            pool_e += p
    if pool_e > 0:
        cells.append((pool_b, pool_e))
    lam = n * sum((b - e) ** 2 / e - b * (1 - b) / (m * e) for b, e in cells)
    lam = max(0.0, lam)
    df = len(cells) - 1
    return lam, float(ncx2.sf(chi2.isf(td.ALPHA, df), df, lam)), df


@pytest.mark.parametrize("method", [m for m in td.METHODS if m != "none"])
def test_power_against_the_textbook_bug(request, monkeypatch, expected_of, method):  # noqa: F811
    where, make = td.METHODS[method]
    eng = request.getfixturevalue(where)
    expected = expected_of(request.getfixturevalue("tiny") if where == "twin" else eng)
    monkeypatch.setattr(verify, "verify_sampled_tree", kept_by_own_probability)
    monkeypatch.setattr(verify, "verify_rejection_chain", kept_by_own_probability)
    monkeypatch.setattr(pearl_scheduler, "verify_rejection_chain", kept_by_own_probability)
    n = td.N_OF.get(method, td.N)
    samples = td.completions(make(eng), seeded=False, n=M)
    lam, pw, df = power(samples, expected, n)
    print(f"\n{method} n={n} M={M} df={df} lambda={lam:.1f} power={pw:.3f}")
