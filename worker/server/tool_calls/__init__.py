"""Tool calling: each model family's way of writing calls (one module each), reading them out of the output, whole or
as it streams, and the structural tag that forces them when the request requires a call."""
