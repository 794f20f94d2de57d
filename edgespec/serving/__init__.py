"""Serving requests, shared by `edgespec batch` and `edgespec serve` (which add a file and HTTP):

`schema`: the request bodies both accept (pydantic), `RequestError`; `requests`: a `Request`,
filled from a validated body, and its prompt tokens; `loop`: `run_requests`, the one serving loop
(one request at a time or several sequences per decode); `records`: the result and error records
it hands on, and OpenAI's logprobs objects. Nothing here prints or knows HTTP or the command line.
"""

from .loop import Totals, run_requests
from .records import error_record, failure, ok_record
from .requests import Defaults, Request, fill_from_body, prompt_of
from .schema import CHAT_URL, TEXT_URL, RequestError, parse_body

__all__ = [
    "CHAT_URL", "TEXT_URL", "Defaults", "Request", "RequestError", "Totals", "error_record", "failure",
    "fill_from_body", "ok_record", "parse_body", "prompt_of", "run_requests",
]
