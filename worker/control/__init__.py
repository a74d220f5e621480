"""The worker's control API: sleep/wake, weight updates, checksums and group membership, over HTTP.

The request/response models and error codes it serves are the contract shared with the operator's client
(`tidal.contract`); what each call does is the lifecycle's (`tidal.worker.lifecycle`). This package holds only
the HTTP side: routes, the bearer token, error codes to statuses, and the listener's assembly.
"""
