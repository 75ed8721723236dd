"""The ceiling for the parameter-server benchmark: plain Python gRPC moving opaque bytes.

`python grpc_echo.py` serves two methods on loopback and prints its port: Get returns N
bytes, Put swallows them; no protobuf, no numpy, no work. `EchoClient.mb_per_s` moves the
same bytes as a pull or push would, in the same chunk sizes and channels, all in flight at
once, so `ps_throughput` can report how close the parameter server gets to gRPC itself.
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time
from concurrent import futures

import grpc

SERVICE = "parallax.bench.Echo"
_LIMIT = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]


def serve() -> None:
    from parallax.runtime.malloc_tuning import reuse_freed_memory
    reuse_freed_memory()  # the same allocator settings as `parallax server`
    cache: dict[int, bytes] = {}

    def get(request: bytes, context) -> bytes:
        size = int(request)
        return cache.setdefault(size, bytes(size))

    handlers = {
        "Get": grpc.unary_unary_rpc_method_handler(get, request_deserializer=bytes,
                                                   response_serializer=bytes),
        "Put": grpc.unary_unary_rpc_method_handler(lambda request, context: b"",
                                                   request_deserializer=bytes,
                                                   response_serializer=bytes),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=_LIMIT)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


class EchoClient:
    """Starts the echo server as a separate process (like a parameter server)."""

    def __init__(self, channels: int) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__], stdout=subprocess.PIPE, text=True)
        port = int(self.proc.stdout.readline())
        self.channels = [grpc.insecure_channel(f"127.0.0.1:{port}",
                                               options=_LIMIT + [("grpc.channel_id", i)])
                         for i in range(channels)]
        self.get = [c.unary_unary(f"/{SERVICE}/Get", request_serializer=bytes,
                                  response_deserializer=bytes) for c in self.channels]
        self.put = [c.unary_unary(f"/{SERVICE}/Put", request_serializer=bytes,
                                  response_deserializer=bytes) for c in self.channels]

    def _move(self, direction: str, nbytes: int, chunk: int) -> None:
        sizes = [min(chunk, nbytes - start) for start in range(0, nbytes, chunk)]
        calls = self.get if direction == "get" else self.put
        payloads = {s: (str(s).encode() if direction == "get" else bytes(s)) for s in set(sizes)}
        pending = [calls[i % len(calls)].future(payloads[s]) for i, s in enumerate(sizes)]
        for call in pending:
            call.result()

    def mb_per_s(self, direction: str, nbytes: int, chunk: int, reps: int = 5) -> float:
        """Median MB/s moving `nbytes` in `chunk`-sized calls ("get": server to client)."""
        self._move(direction, nbytes, chunk)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            self._move(direction, nbytes, chunk)
            times.append(time.perf_counter() - start)
        return nbytes / statistics.median(times) / 1e6

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        self.proc.terminate()
        self.proc.wait(10)


if __name__ == "__main__":
    serve()
