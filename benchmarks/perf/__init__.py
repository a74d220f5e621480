"""The pieces of benchmarks/gpu_perf.py and sampling_perf.py: model presets and workloads, a random model in memory,
the engine's and transformers' measurements, the device's ceilings, the sampling benchmark's request mixes and grammar
vocabulary, and the reports (JSON + markdown)."""
