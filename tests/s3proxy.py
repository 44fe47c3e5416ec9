"""A TCP proxy on loopback between boto3 and the embedded S3 server, for fault tests: it cuts
connections, throttles, flips bits, and records the requests and bytes it carried."""

from __future__ import annotations

import re
import socket
import threading
import time

_RANGE = re.compile(rb"\r\nrange: *bytes=(\d+)-(\d*)", re.I)


class Proxy:
    """Offsets count from the start of each response (headers included), so a fault hits every
    response that gets that far, on fresh and reused (keep-alive) connections alike.

    cut_after: a response that has carried this many bytes is cut (its connection closed), for
    the first `cuts` responses that get that far; rate: response bytes per second (throttle);
    flip_at: the response byte at this offset has one bit flipped (corruption in transit that TCP
    let through), for the first `flips` responses that get that far. `requests` lists each
    request's first line and Range ((start, end) or None); `served` counts response bytes.
    """

    def __init__(self, upstream_port: int, cut_after: int | None = None, cuts: int = 0,
                 rate: float | None = None, flip_at: int | None = None, flips: int = 0) -> None:
        self.upstream, self.cut_after = upstream_port, cut_after
        self.cuts_left, self.rate = cuts, rate
        self.flip_at, self.flips_left = flip_at, flips
        self.cut = self.flipped = self.served = 0
        self.requests: list[tuple[str, tuple[int, int | None] | None]] = []
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return  # listener closed
            up = socket.create_connection(("127.0.0.1", self.upstream))
            self.open += [down, up]
            state = {"sent": 0}  # bytes of the current response on this connection
            threading.Thread(target=self._pump, args=(down, up, False, state), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, True, state), daemon=True).start()

    def _request(self, data: bytes, state: dict[str, int]) -> None:
        if data[:4] in (b"GET ", b"HEAD", b"PUT ", b"POST"):
            # the client sends a request only after reading the last response whole
            state["sent"] = 0
            match = _RANGE.search(data)
            span = (int(match[1]), int(match[2]) if match[2] else None) if match else None
            with self.lock:
                self.requests.append((data.split(b"\r\n", 1)[0].decode("latin-1"), span))

    def _pump(self, src: socket.socket, dst: socket.socket, response: bool,
              state: dict[str, int]) -> None:
        total, start = 0, time.perf_counter()
        try:
            while data := src.recv(65536):
                if not response:
                    self._request(data, state)
                    dst.sendall(data)
                    continue
                sent = state["sent"]
                if self.cut_after is not None and sent + len(data) > self.cut_after:
                    with self.lock:
                        cut = self.cuts_left > 0
                        self.cuts_left -= cut
                        self.cut += cut
                    if cut:
                        dst.sendall(data[: max(0, self.cut_after - sent)])
                        break
                if self.flip_at is not None and sent <= self.flip_at < sent + len(data):
                    with self.lock:
                        flip = self.flips_left > 0
                        self.flips_left -= flip
                        self.flipped += flip
                    if flip:
                        i = self.flip_at - sent
                        data = data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1:]
                state["sent"] = sent + len(data)  # before sending: the next request resets it
                with self.lock:
                    self.served += len(data)
                dst.sendall(data)
                total += len(data)
                if self.rate:
                    time.sleep(max(0.0, total / self.rate - (time.perf_counter() - start)))
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.listener.close()
        for s in self.open:
            s.close()
