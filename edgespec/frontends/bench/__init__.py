"""`edgespec bench`: methods side by side on a prompt suite (see `run`)."""

from .llamacpp import parse_eval_count, parse_eval_tps
from .report import render_markdown, write_charts
from .run import run_bench, run_method
from .stats import ceiling, geomean, summarize, text_ceiling

__all__ = ["ceiling", "geomean", "parse_eval_count", "parse_eval_tps", "render_markdown", "run_bench", "run_method",
           "summarize", "text_ceiling", "write_charts"]
