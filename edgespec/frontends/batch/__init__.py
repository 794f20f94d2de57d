"""`edgespec batch`: a JSONL file of requests (OpenAI batch format) through the local model.

Every input line gets exactly one output line, written and flushed (and fsynced) the moment its
request is complete, in completion order; match lines by `custom_id`. A line that cannot be
served (bad JSON, an unknown field, a prompt too long) gets an output line with `error` filled
and the batch goes on. Started again on the same output file, a batch skips what is already
there, so an interrupted run (Ctrl+C, kill, power loss) resumes without duplicates.

`requests`: the schema and validation of a line; `output`: records, the locked writer, resume;
`serve`: requests through the engine, one at a time or several per decode; `command`: the CLI.
"""

from .command import run_batch
from .output import Done, Writer, error_record, failure, ok_record, pending_requests, scan_output
from .requests import (
    CHAT_URL, DUPLICATE, EXIT_SOME_FAILED, TEXT_URL, Defaults, Request, RequestError, parse_line, read_requests,
)
from .serve import Totals, run_requests

__all__ = [
    "CHAT_URL", "DUPLICATE", "EXIT_SOME_FAILED", "TEXT_URL", "Defaults", "Done", "Request", "RequestError", "Totals",
    "Writer", "error_record", "failure", "ok_record", "parse_line", "pending_requests", "read_requests",
    "run_batch", "run_requests", "scan_output",
]
