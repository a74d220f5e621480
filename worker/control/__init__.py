"""The worker's control API: sleep/wake, weight updates, checksums and group membership.

`schema` holds the request/response models shared with the operator's client; it imports pydantic only, so the
operator (which never installs torch) can import it.
"""
