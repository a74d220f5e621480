"""The worker's HTTP layer: OpenAI-compatible API, health/readiness probes and Prometheus metrics.

Modules: `protocol` (request and response models), `errors` (OpenAI error JSON), `prompts` (prompt building, on its
own threads), `admission` (requests held at once), `generation` (one request through the engine, with metrics),
`streaming` (server-sent events), `routes_openai` and `routes_probes` (the routes), `runtime` (the engine's lifecycle
behind the routes), `connections` (each listener's header deadline and connection cap), `request_body` (body size and
deadline), `app` (app factories and the multi-port server).
"""
