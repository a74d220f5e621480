"""The worker's lifecycle: sleep and wake, in-place weight updates (disk, streamed, collective), checksums and the
group membership.

`manager.LifecycleManager` is the one entry point; the control API (tidal.worker.control) calls it.
"""
