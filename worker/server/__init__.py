"""The worker's HTTP layer: OpenAI-compatible API, health/readiness probes and Prometheus metrics.

Modules: `protocol` (request and response models), `errors` (OpenAI error JSON), `prompts` (prompt building),
`generation` (one request through the engine, with metrics), `streaming` (server-sent events), `routes_openai` and
`routes_probes` (the routes), `runtime` (the engine's lifecycle behind the routes), `app` (app factories and the
multi-port server).
"""
