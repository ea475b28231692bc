"""A real S3-compatible HTTP server for the tests (moto's server mode), seen
through a counting proxy that can also hold requests or go away."""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import boto3
from aiohttp import ClientSession, web
from moto.server import ThreadedMotoServer

REGION = "us-east-1"
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


class CountingProxy:
    """An HTTP proxy on 127.0.0.1 in its own thread.

    It counts requests by (method, path), can hold requests of one method
    until released, and can stop listening (as if S3 went away) and start
    again on the same port.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.counts: Counter[tuple[str, str]] = Counter()
        self.completed: Counter[tuple[str, str]] = Counter()
        self._held_method: str | None = None
        #: how many more requests of that method to hold (None: all)
        self._hold_left: int | None = None
        self._release: asyncio.Event | None = None
        self.held = threading.Event()  # set when a request is being held
        self._conditions: list[tuple[str, str, int, threading.Event]] = []
        #: answers given in the store's place: method -> (status, error code, how many)
        self._answers: dict[str, tuple[int, str, int]] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._session: ClientSession | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    def start(self) -> CountingProxy:
        self._thread.start()
        self._run(self._start())
        return self

    async def _start(self) -> None:
        self._session = ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await self._listen()

    async def _listen(self) -> None:
        assert self._runner is not None
        self._site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await self._site.start()
        if self.port == 0:
            self.port = self._runner.addresses[0][1]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        key = (request.method, request.path)
        self.counts[key] += 1
        if (
            self._held_method == request.method
            and self._release is not None
            and self._hold_left != 0
        ):
            if self._hold_left is not None:
                self._hold_left -= 1
            self.held.set()
            await self._release.wait()
        answer = self._answers.get(request.method)
        if answer is not None:
            status, code, left = answer
            if left <= 1:
                del self._answers[request.method]
            else:
                self._answers[request.method] = (status, code, left - 1)
            await request.read()
            error = f"<Error><Code>{code}</Code><Message>{code}</Message></Error>"
            return web.Response(status=status, body=error.encode(), content_type="application/xml")
        assert self._session is not None
        body = await request.read()
        # The Host as the client signed it (a store that checks signatures,
        # as Ceph's RGW does, refuses any other); the body was read whole.
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in ("transfer-encoding",)
        }
        async with self._session.request(
            request.method,
            self.upstream + str(request.rel_url),
            data=body,
            headers=headers,
            allow_redirects=False,
        ) as up:
            payload = await up.read()
            response = web.Response(
                status=up.status,
                body=payload,
                headers={
                    k: v
                    for k, v in up.headers.items()
                    if k.lower() not in ("transfer-encoding", "content-length", "connection")
                },
            )
        self.completed[key] += 1
        for method, path, n, event in self._conditions:
            if self.completed[(method, path)] >= n:
                event.set()
        return response

    def when_completed(self, method: str, path: str, n: int = 1) -> threading.Event:
        """An event set once ``n`` requests of ``method`` on ``path`` have been answered."""
        event = threading.Event()

        def add() -> None:
            self._conditions.append((method, path, n, event))
            if self.completed[(method, path)] >= n:
                event.set()

        self._loop.call_soon_threadsafe(add)
        return event

    def hold(self, method: str, count: int | None = None) -> None:
        """Hold requests of ``method`` (only the next ``count`` when given)
        until :meth:`release`."""

        async def arm() -> None:
            self._held_method = method
            self._hold_left = count
            self._release = asyncio.Event()

        self._run(arm())

    def answer(self, method: str, status: int, code: str, count: int = 1) -> None:
        """Answer the next ``count`` requests of ``method`` with an S3 error
        (``status``, ``code``) in the store's place: for answers a store
        gives that it cannot be made to give on demand."""

        async def arm() -> None:
            self._answers[method] = (status, code, count)

        self._run(arm())

    def release(self) -> None:
        async def fire() -> None:
            self._held_method = None
            if self._release is not None:
                self._release.set()

        self._run(fire())

    def go_away(self) -> None:
        """Stop listening: connections are refused, as if S3 were down."""

        async def stop() -> None:
            assert self._runner is not None
            await self._runner.cleanup()  # stops listening and drops kept-alive connections

        self._run(stop())

    def come_back(self) -> None:
        async def start() -> None:
            assert self._runner is not None
            await self._runner.setup()
            await self._listen()

        self._run(start())

    def close(self) -> None:
        async def shutdown() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
            if self._session is not None:
                await self._session.close()

        self._run(shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class ProxiedS3:
    """An S3 endpoint as the tests use it, through a :class:`CountingProxy`:
    a client of its own, new buckets, and a tier's configuration (which
    goes through the proxy). :class:`S3Server` (moto) and
    :class:`tests.ceph.CephS3` (Ceph's RGW) are the two."""

    def __init__(self, endpoint: str, access_key: str, secret_key: str) -> None:
        #: the store itself (the proxy forwards to it)
        self.endpoint = endpoint
        self.access_key, self.secret_key = access_key, secret_key
        self.proxy = CountingProxy(endpoint).start()
        self._buckets = 0
        # (moto's buckets are the process's: another module's server sees them)
        self._token = secrets.token_hex(4)

    def close(self) -> None:
        self.proxy.close()

    def boto(self) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
        )

    def new_bucket(self) -> str:
        self._buckets += 1
        name = f"kvtier-test-{self._token}-{self._buckets}"
        self.boto().create_bucket(Bucket=name)
        return name

    def tier_config(self, bucket: str, **overrides: Any) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "kind": "s3",
            "name": "s3",
            "bucket": bucket,
            "prefix": "fleet-a/",
            "region": REGION,
            "endpoint_url": self.proxy.url,
            "addressing_style": "path",
            "access_key_id": self.access_key,
            "secret_access_key": self.secret_key,
        }
        cfg.update(overrides)
        return cfg


class S3Server(ProxiedS3):
    """moto's S3 server: for faults a real store cannot be made to show,
    and for processes without Ceph."""

    def __init__(self) -> None:
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.moto.start()
        host, port = self.moto.get_host_and_port()
        self.moto_url = f"http://{host}:{port}"
        super().__init__(
            self.moto_url, CREDENTIALS["aws_access_key_id"], CREDENTIALS["aws_secret_access_key"]
        )

    def close(self) -> None:
        self.proxy.close()
        self.moto.stop()


def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    try:
        yield server
    finally:
        server.close()


if __name__ == "__main__":
    # For processes without moto (the engine benchmarks' venvs): an S3 server
    # and a bucket, its tier config printed as one line of JSON; it stops
    # when its standard input closes.
    import json
    import sys

    s3 = S3Server()
    try:
        print(json.dumps(s3.tier_config(s3.new_bucket())), flush=True)
        sys.stdin.read()
    finally:
        s3.close()
