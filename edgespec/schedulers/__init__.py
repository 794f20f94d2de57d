"""Schedulers: how drafting and verification are ordered. `sequential`: one sequence, one step at
a time (every drafter); `pearl`: the draft model in its own thread; `multi`: many sequences per
decode (`edgespec batch -np N`). Each is a `lifecycle.Lifecycle`."""
