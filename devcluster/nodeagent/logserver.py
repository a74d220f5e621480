"""The one kubelet endpoint `kubectl logs` needs: GET /containerLogs/<namespace>/<pod>/<container>.

The API server proxies `kubectl logs` to the node's InternalIP and kubeletEndpoint port over TLS, presenting its
kubelet-client certificate; only that identity (signed by the cluster CA) is served. Supported query parameters:
previous, follow, tailLines, limitBytes.
"""

import logging
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import cast
from urllib.parse import parse_qs, urlparse

from tidal.devcluster.nodeagent.layout import PodDirs

log = logging.getLogger(__name__)
APISERVER_CLIENT = "kube-apiserver-kubelet-client"
FOLLOW_POLL_S = 0.2


def tail_lines(data: bytes, count: int) -> bytes:
    lines = data.splitlines(keepends=True)
    return b"".join(lines[-count:]) if count >= 0 else data


class _Handler(BaseHTTPRequestHandler):
    pods_dir: Path  # set on the subclass made by serve()

    def log_message(self, format: str, *args: object) -> None:
        log.debug(format, *args)

    def _client_cn(self) -> str:
        cert = self.connection.getpeercert() if isinstance(self.connection, ssl.SSLSocket) else None
        # The subject is a tuple of RDNs, each a tuple of (key, value) pairs; the annotation also allows a str.
        subject = cast("tuple[tuple[tuple[str, str], ...], ...]", (cert or {}).get("subject", ()))
        for rdn in subject:
            for key, value in rdn:
                if key == "commonName":
                    return value
        return ""

    def _reply(self, code: int, text: str) -> None:
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        url = urlparse(self.path)
        if url.path == "/healthz":
            self._reply(200, "ok")
            return
        if self._client_cn() != APISERVER_CLIENT:
            self._reply(403, f"only {APISERVER_CLIENT} may read logs from this node")
            return
        parts = url.path.strip("/").split("/")
        if len(parts) != 4 or parts[0] != "containerLogs":
            self._reply(404, "the tidal node agent serves only /containerLogs/<namespace>/<pod>/<container>")
            return
        _, namespace, pod, container = parts
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            dirs = PodDirs.newest(self.pods_dir, namespace, pod)
        except LookupError as exc:
            self._reply(404, str(exc))
            return
        previous = query.get("previous") == "true"
        path = dirs.previous_log(container) if previous else dirs.log(container)
        if not path.exists():
            what = "previous terminated container" if previous else "container"
            self._reply(400, f'{what} "{container}" in pod "{pod}" not found')
            return
        data = path.read_bytes()
        if "tailLines" in query:
            data = tail_lines(data, int(query["tailLines"]))
        if "limitBytes" in query:
            data = data[: int(query["limitBytes"])]
        follow = query.get("follow") == "true" and not previous
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        if not follow:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        if follow:
            self._follow(path, dirs.pidfile(container), path.stat().st_size)

    def _follow(self, path: Path, pidfile: Path, offset: int) -> None:
        """Stream what the container appends until it stops running (or the client goes away)."""
        with open(path, "rb") as handle:
            handle.seek(offset)
            while True:
                chunk = handle.read(65536)
                if chunk:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    continue
                if not pidfile.exists():
                    return
                time.sleep(FOLLOW_POLL_S)


def serve(pods_dir: Path, cert: Path, key: Path, client_ca: Path) -> tuple[ThreadingHTTPServer, int]:
    """Start the endpoint on a free loopback port in a daemon thread; returns the server and its port."""
    handler = type("LogHandler", (_Handler,), {"pods_dir": pods_dir})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cert), str(key))
    ctx.load_verify_locations(str(client_ca))
    ctx.verify_mode = ssl.CERT_OPTIONAL  # /healthz without a cert; logs check the identity
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, name="log-server", daemon=True).start()
    return server, server.server_address[1]
