"""An engine's device memory, allocated once: the weights in one region, the KV cache in another.

Whoever builds the engine picks a `provider.MemoryProvider`: `TorchMemory` (plain torch storage; tests, benchmarks,
CPU) or `VmmMemory` (CUDA virtual memory, the lifecycle's choice when `stable_device_memory` is on). The loader
builds the model on the meta device and binds its parameters into the weights' region (`parameters.py`) before the
checkpoint is read; the runner takes the KV cache's region (`kv_region.py`, laid out by `kv_placement.py`) and then
captures CUDA graphs. The lifecycle only releases and restores these regions; it never replaces a tensor.

Addresses across a sleep. A `VmmRegion` comes back at the same addresses, so nothing that holds one (views, CUDA
graphs) needs to know. A `TorchRegion` (CPU, or CUDA without the driver API) keeps its storage *object* and resizes
it to nothing and back: every view — parameters, fused-weight views, K/V planes — follows that one owner with no
re-pointing, but the raw address may change. The only things that hold raw addresses are the CUDA graphs, so after a
wake the lifecycle asks the runner (`ModelRunner.recapture_graphs_if_moved`), which compares the regions' addresses
with those it captured at and recaptures only if they differ. Re-pointing views instead would mean every holder of
a tensor (layers, fused views, the attention batch) had to be found and updated: one owner of the storage is
simpler and cannot miss one. The check runs once per wake, never on the step path.
"""
