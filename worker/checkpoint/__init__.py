"""Safetensors checkpoints, read one way at start-up and for weight updates.

`directory` finds a checkpoint's files and the tensors their headers declare (`header` parses one file's header),
`judge` checks those tensors against what a model expects, and `reader` copies the chosen ones into buffers the
caller gives. Every malformed input is a `CheckpointError` listing its problems; callers turn it into their own
error. Selection is by tensor name, so a caller may read part of a checkpoint. This package imports nothing of the
lifecycle, the engine or the server.
"""
