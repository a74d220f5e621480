"""The pieces of benchmarks/gpu_perf.py: model presets and workloads, a random model in memory, the engine's and
transformers' measurements, the device's ceilings, and the report (JSON + markdown)."""
