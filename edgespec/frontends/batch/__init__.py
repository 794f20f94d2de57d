"""`edgespec batch`: a JSONL file of requests (OpenAI batch format) through the local model.

Every input line gets exactly one output line, written and flushed (and fsynced) the moment its
request is complete, in completion order; match lines by `custom_id`. A line that cannot be
served (bad JSON, an unknown field, a prompt too long) gets an output line with `error` filled
and the batch goes on. Started again on the same output file, a batch skips what is already
there, so an interrupted run (Ctrl+C, kill, power loss) resumes without duplicates.

`requests`: a line -> a Request (edgespec.serving checks its body); `output`: the locked writer,
resume; `command`: the CLI. The requests are served by edgespec.serving's loop, as `serve`'s are.
"""

from .command import run_batch
from .output import Done, Writer, pending_requests, scan_output
from .requests import DUPLICATE, EXIT_SOME_FAILED, parse_line, read_requests

__all__ = [
    "DUPLICATE", "EXIT_SOME_FAILED", "Done", "Writer", "parse_line", "pending_requests", "read_requests",
    "run_batch", "scan_output",
]
