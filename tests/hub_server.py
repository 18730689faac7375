"""A loopback stand-in for the Hugging Face hub: just the part of its HTTP API that
`huggingface_hub` uses to fetch files, so `drvqwen pull NAME` is tested without the network.

- `GET /api/models/<owner>/<name>[/revision/<rev>]` — the model's info: `sha` (the commit) and
  `siblings` (file names and sizes); 404 with `X-Error-Code: RepoNotFound` for an unknown repo.
- `HEAD|GET /<owner>/<name>/resolve/<rev>/<file>` — the file, with the headers the client
  reads: `ETag` (the content's sha256, quoted, as for LFS files), `X-Repo-Commit`,
  `Content-Length`; `Range: bytes=N-` answered with 206 and `Content-Range`.
- `cut_once[file] = n`: the first GET of that file sends its headers, then only n bytes of
  the body and closes the connection (a dropped transfer, which the client resumes).

`requests` records (method, path, Range header) of every request.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class TinyHub:
    """Serves `repos` = {'owner/name': {'file': bytes}} at `self.url` until `close()`."""

    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos = repos
        self.commits = {r: hashlib.sha1(r.encode()).hexdigest() for r in repos}
        self.cut_once: dict[str, int] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):   # quiet
                pass

            def do_GET(self):
                hub._answer(self, body=True)

            def do_HEAD(self):
                hub._answer(self, body=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = h.path.split("?", 1)[0]
        self.requests.append((h.command, path, h.headers.get("Range")))
        m = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?$", path)
        if m:
            return self._info(h, m[1], body)
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m:
            return self._file(h, m[1], m[3], body)
        self._send(h, 404, b'{"error":"not found"}', body, {"X-Error-Code": "EntryNotFound"})

    def _send(self, h, status: int, data: bytes, body: bool, headers: dict | None = None) -> None:
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        # One request per connection: after close() no kept-alive connection still answers.
        h.send_header("Connection", "close")
        h.close_connection = True
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _info(self, h, repo: str, body: bool) -> None:
        files = self.repos.get(repo)
        if files is None:
            return self._send(h, 404, b'{"error":"Repository not found"}', body, {"X-Error-Code": "RepoNotFound"})
        info = {"id": repo, "modelId": repo, "sha": self.commits[repo], "private": False,
                "siblings": [{"rfilename": n, "size": len(b)} for n, b in files.items()]}
        self._send(h, 200, json.dumps(info).encode(), body, {"Content-Type": "application/json"})

    def _file(self, h, repo: str, name: str, body: bool) -> None:
        data = self.repos.get(repo, {}).get(name)
        if data is None:
            return self._send(h, 404, b'{"error":"Entry not found"}', body, {"X-Error-Code": "EntryNotFound"})
        headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": self.commits[repo],
                   "Accept-Ranges": "bytes"}
        rng = h.headers.get("Range")
        start = int(re.match(r"bytes=(\d+)-", rng)[1]) if rng else 0
        status = 206 if rng else 200
        if rng:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        part = data[start:]
        cut = self.cut_once.pop(name, None) if body else None
        if cut is None:
            return self._send(h, status, part, body, headers)
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(part)))
        h.end_headers()
        h.wfile.write(part[:cut])
        h.wfile.flush()
        h.close_connection = True
