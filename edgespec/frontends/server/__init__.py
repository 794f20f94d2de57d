"""`edgespec serve`: an OpenAI-compatible HTTP server over the engine.

`worker`: the engine's one thread, serving queued requests through the same loop as `edgespec
batch` (continuous batching with drafts); `metrics`: Prometheus counters and gauges; `app`: the
Starlette application (routes, key check, body limit, server-sent events); `command`: the CLI
(uvicorn); `load`: a load generator for the loopback address. The core never imports any of it.
"""
