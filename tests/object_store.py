"""A real S3-compatible server on loopback, private to one test session: moto's server mode, a process of its
own speaking S3's HTTP protocol, which boto3 reaches over the network as it reaches AWS (only the endpoint
differs: ``AWS_ENDPOINT_URL``). Nothing in the client is replaced.

``pause()`` closes the server's port (clients get "connection refused", as from a store that is down) and
``resume()`` opens it again with the objects it held: moto keeps them in its process's memory, which is
what lets the store come back with its data, as a store restarted over its disk does.

Run it by hand: ``python tests/object_store.py`` prints the variables to export; Ctrl-C stops it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server:
    """``checks_credentials``: the server knows no access key (moto's IAM checks on), so every request is
    denied, as a store is to wrong credentials."""

    def __init__(self, checks_credentials: bool = False):
        self.checks_credentials = checks_credentials
        from convbert_ds.engine.distributed import free_port  # not in the server process: it imports torch

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    @property
    def env(self) -> dict:
        """What a process needs to reach this store (and nothing else: no profile, no metadata service)."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.url, "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def start(self) -> S3Server:
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"} if self.checks_credentials else None
        self.process = subprocess.Popen([sys.executable, __file__, "--serve", self.port], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait(answering=True)
        return self

    def _wait(self, answering: bool) -> None:
        deadline = time.monotonic() + 60
        while True:
            try:
                try:
                    urllib.request.urlopen(self.url, timeout=2).close()
                except urllib.error.HTTPError:  # an answer all the same (a denial, when credentials are checked)
                    pass
                if answering:
                    return
            except OSError:
                if not answering:
                    return
                if self.process.poll() is not None:
                    raise RuntimeError(f"the S3 server on port {self.port} exited") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"the S3 server on port {self.port} did not {'start' if answering else 'stop'}")
            time.sleep(0.1)

    def pause(self) -> None:
        """The store goes away: its port refuses connections."""
        self.process.send_signal(signal.SIGUSR1)
        self._wait(answering=False)

    def resume(self) -> None:
        """The store comes back, with its objects."""
        self.process.send_signal(signal.SIGUSR2)
        self._wait(answering=True)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def client(self):
        import boto3
        return boto3.session.Session(**{k.lower(): v for k, v in CREDENTIALS.items()
                                        if k != "AWS_DEFAULT_REGION"},
                                     region_name=CREDENTIALS["AWS_DEFAULT_REGION"]).client("s3", endpoint_url=self.url)

    def snapshot(self, bucket: str) -> dict[str, bytes]:
        c = self.client()
        keys = [o["Key"] for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket)
                for o in page.get("Contents", ())]
        return {key: c.get_object(Bucket=bucket, Key=key)["Body"].read() for key in keys}

    def restore(self, bucket: str, objects: dict[str, bytes]) -> None:
        c = self.client()
        c.create_bucket(Bucket=bucket)
        for key, data in objects.items():
            c.put_object(Bucket=bucket, Key=key, Body=data)


class CuttingProxy:
    """A TCP proxy in front of a server that cuts the body of the next ``cuts`` GET answers after ``keep``
    bytes and closes the connection, as a network that drops mid-download does: the client has the headers
    (with the whole length) and part of the body. Everything else passes through unchanged."""

    def __init__(self, upstream_port: int, cuts: int, keep: int = 1000):
        self.upstream_port, self.cuts, self.keep, self.cut = upstream_port, cuts, keep, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._requests, args=(downstream, upstream), daemon=True).start()

    def _take_a_cut(self) -> bool:
        with self._lock:
            if self.cut < self.cuts:
                self.cut += 1
                return True
            return False

    def _requests(self, downstream, upstream) -> None:
        first = downstream.recv(65536)
        cutting = first.startswith(b"GET ") and self._take_a_cut()
        threading.Thread(target=self._pipe, args=(upstream, downstream, self.keep if cutting else None),
                         daemon=True).start()
        data = first
        while data:
            try:
                upstream.sendall(data)
                data = downstream.recv(65536)
            except OSError:
                break

    def _pipe(self, upstream, downstream, keep: int | None) -> None:
        """Upstream's answer to the client; with ``keep``, its headers and ``keep`` bytes of body, then both
        connections closed."""
        seen = b""
        try:
            while True:
                data = upstream.recv(65536)
                if not data:
                    break
                if keep is not None:
                    seen += data
                    end = seen.find(b"\r\n\r\n")
                    if end >= 0 and len(seen) >= end + 4 + keep:
                        downstream.sendall(seen[:end + 4 + keep])
                        break
                    continue
                downstream.sendall(data)
        except OSError:
            pass
        for connection in (upstream, downstream):  # shutdown first: it wakes the other thread's recv and sends FIN
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            connection.close()

    def close(self) -> None:
        self.listener.close()


def serve(port: int) -> None:
    """The server process: moto's S3 on ``port``; SIGUSR1 closes the port, SIGUSR2 opens it again."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)  # the objects live here, across listeners
    listener = {}

    def open_port(*_) -> None:
        if "server" not in listener:
            server = make_server("127.0.0.1", port, app, threaded=True, request_handler=MotoRequestHandler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            listener["server"] = server

    def close_port(*_) -> None:
        server = listener.pop("server", None)
        if server:
            server.shutdown()
            server.server_close()

    signal.signal(signal.SIGUSR1, close_port)
    signal.signal(signal.SIGUSR2, open_port)
    open_port()
    while True:  # not signal.pause(): a signal the kernel gives a request thread would not wake it
        time.sleep(0.1)


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    serve(int(sys.argv[2]))
elif __name__ == "__main__":
    with S3Server() as server:
        print(" ".join(f"{k}={v}" for k, v in server.env.items()))
        try:
            server.process.wait()
        except KeyboardInterrupt:
            pass
