"""The OpenAI-compatible HTTP server behind `sglx serve`: routes, request schemas, auth, metrics, lifecycle.

Nothing is imported here eagerly: the CLI imports `sglx.server.config` at start-up, and FastAPI should
load only when a server actually starts.
"""
