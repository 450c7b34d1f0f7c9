"""MXCL framing cost on loopback: unprotected (baseline) vs AES-256-GCM vs ChaCha20-Poly1305.

One run, two processes (this one sends, a child echoes or sinks), real TCP on
127.0.0.1. For each suite and payload size: one-way latency p50/p95/p99 (half
the round trip of a message sent on one connection and echoed back on a
second), one-way bandwidth, and the ratios to the unprotected framing (the same
codec with a null AEAD; benchmark only, never negotiable). Also the handshake
(TCP connect to verdict) p50 with the real handshake.

    .venv/bin/python bench/wire.py [--quick]

Every frame is a fresh buffer each way, so on a VM where page faults are dear the
unprotected figures follow glibc's malloc heuristics more than our code, and some
buffer alignments hit a slow ``rep movsb`` memcpy. To see the code alone, run with
GLIBC_TUNABLES=glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=\
1073741824:glibc.cpu.x86_rep_movsb_threshold=16777216 (and compare runs made alike).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

from mlxceld.net.stream import read_chunk, write_buffers
from mlxceld.wire import Keyring
from mlxceld.wire.connection import Connection
from mlxceld.wire.crypto import Suite
from mlxceld.wire.events import HandshakeComplete
from mlxceld.wire.frames import FrameLimits, FrameReceiver, FrameSender, Kind
from mlxceld.wire.handshake import ConnectionRole
from mlxceld.wire.schedule import Channel

SIZES = [8 << 10, 64 << 10, 1 << 20, 16 << 20]
SUITES = [Suite.UNPROTECTED, Suite.AES_256_GCM, Suite.CHACHA20_POLY1305]
LIMITS = FrameLimits(max_frame_len=64 << 20)
SECRET = b"bench-cluster-secret-0123456789!"
C2S, S2C = b"\x01" * 32, b"\x02" * 32  # fixed traffic secrets: the data path only


class Framed:
    """One direction pair over a TCP stream: the core's frame codec, read and written
    as ``MxclStream`` does (``read_chunk``, ``write_buffers``)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 suite: Suite, send_secret: bytes, recv_secret: bytes) -> None:
        self.reader, self.writer = reader, writer
        self.tx = FrameSender(suite, send_secret, LIMITS)
        self.rx = FrameReceiver(suite, recv_secret, LIMITS)

    async def send(self, payload: bytes | memoryview) -> None:
        write_buffers(self.writer, [self.tx.seal(Kind.MESSAGE, payload)])
        await self.writer.drain()

    async def recv(self) -> bytes:
        while True:
            frame = self.rx.next_frame()
            if frame is not None:
                return frame.payload
            data = await read_chunk(self.reader)
            if not data:
                raise ConnectionError("peer closed")
            self.rx.feed(data)


async def serve(port_file: Path) -> None:
    """The child: connection 1 carries (suite byte, mode) then messages; 2 carries echoes."""
    back: dict[int, Framed] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        suite, role, token = struct.unpack("!BBI", await reader.readexactly(6))
        if role == 2:  # the echo path back to the client
            back[token] = Framed(reader, writer, Suite(suite), S2C, C2S)
            return
        conn = Framed(reader, writer, Suite(suite), S2C, C2S)
        total = 0
        try:
            while True:
                msg = await conn.recv()
                if msg[:4] == b"ECHO":
                    await back[token].send(msg)
                elif msg[:4] == b"DONE":
                    await conn.send(struct.pack("!Q", total))
                    total = 0
                else:
                    total += len(msg)
        except (ConnectionError, asyncio.IncompleteReadError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=1 << 20)
    port_file.write_text(str(server.sockets[0].getsockname()[1]))
    async with server:
        await server.serve_forever()


async def open_pair(port: int, suite: Suite, token: int) -> tuple[Framed, Framed]:
    out: list[Framed] = []
    for role in (1, 2):
        r, w = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
        w.write(struct.pack("!BBI", suite, role, token))
        await w.drain()
        out.append(Framed(r, w, suite, C2S, S2C))
    await asyncio.sleep(0.05)  # let the echo path register
    return out[0], out[1]


async def latency(fwd: Framed, back: Framed, size: int, n: int) -> list[float]:
    payload = b"ECHO" + os.urandom(size - 4)
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fwd.send(payload)
        await back.recv()
        samples.append((time.perf_counter() - t0) / 2)
    return samples


async def bandwidth(fwd: Framed, size: int, total: int) -> float:
    payload = os.urandom(size)
    count = max(1, total // size)
    t0 = time.perf_counter()
    for _ in range(count):
        await fwd.send(payload)
    await fwd.send(b"DONE")
    received = struct.unpack("!Q", await fwd.recv())[0]
    assert received == count * size, (received, count * size)
    return received / (time.perf_counter() - t0)


async def handshake_p50(n: int) -> float:
    keyring = Keyring()
    keyring.add(SECRET)
    loop = asyncio.get_running_loop()

    async def server_side(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer_ip = writer.get_extra_info("peername")[0]
        conn = Connection(ConnectionRole.SERVER, keyring=keyring, random=os.urandom,
                          now=loop.time(),
                          peer_ip=peer_ip)
        while not conn.established:
            conn.receive_data(await reader.read(4096), loop.time())
            writer.write(conn.data_to_send())
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(server_side, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        r, w = await asyncio.open_connection("127.0.0.1", port)
        conn = Connection(ConnectionRole.CLIENT, keyring=keyring, random=os.urandom,
                          now=loop.time(),
                          channel=Channel.TRANSPORT, identity="127.0.0.1:19100")
        w.write(conn.data_to_send())
        done = False
        while not done:
            conn.receive_data(await r.read(4096), loop.time())
            w.write(conn.data_to_send())
            while (ev := conn.next_event()) is not None:
                done = done or isinstance(ev, HandshakeComplete)
        times.append(time.perf_counter() - t0)
        w.close()
        await w.wait_closed()
    server.close()
    await server.wait_closed()
    return statistics.median(times)


def pct(xs: list[float], p: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]


async def run(port: int, quick: bool) -> None:
    """Suites are interleaved round by round, so machine noise falls on all of them alike."""
    pairs = {suite: await open_pair(port, suite, token) for token, suite in enumerate(SUITES)}
    results: dict[tuple[Suite, int], dict[str, float]] = {}
    rounds = 3 if quick else 6
    for size in SIZES:
        n = {8 << 10: 400, 64 << 10: 200, 1 << 20: 40, 16 << 20: 6}[size] // (4 if quick
                                                                             else 1)
        per_round = max(n // rounds, 2)
        total = max((64 << 20) // (4 if quick else 1) // rounds, 2 * size)
        lat: dict[Suite, list[float]] = {s: [] for s in SUITES}
        bws: dict[Suite, list[float]] = {s: [] for s in SUITES}
        for suite in SUITES:
            await latency(*pairs[suite], size, 2)  # warm up
        for _ in range(rounds):
            for suite in SUITES:
                fwd, back = pairs[suite]
                lat[suite] += await latency(fwd, back, size, per_round)
                bws[suite].append(await bandwidth(fwd, size, total))
        for suite in SUITES:
            results[(suite, size)] = {"p50": pct(lat[suite], 0.5), "p95": pct(lat[suite], 0.95),
                                      "p99": pct(lat[suite], 0.99),
                                      "bw": statistics.median(bws[suite])}
    for fwd, back in pairs.values():
        fwd.writer.close()
        back.writer.close()
    print(f"{'suite':18}{'size':>7}{'p50 us':>10}{'p95 us':>10}{'p99 us':>10}"
          f"{'MiB/s':>9}{'p50 x':>8}{'bw x':>7}")
    for suite in SUITES:
        for size in SIZES:
            r, base = results[(suite, size)], results[(Suite.UNPROTECTED, size)]
            label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
            print(f"{suite.name:18}{label:>7}{r['p50'] * 1e6:10.0f}{r['p95'] * 1e6:10.0f}"
                  f"{r['p99'] * 1e6:10.0f}{r['bw'] / 2**20:9.0f}"
                  f"{r['p50'] / base['p50']:8.2f}{r['bw'] / base['bw']:7.2f}")
    print("(p50 x: latency relative to unprotected, lower is better; "
          "bw x: bandwidth relative to unprotected, higher is better)")
    print(f"handshake (connect to verdict, AES-256-GCM) p50: "
          f"{await handshake_p50(20 if quick else 100) * 1000:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return
    port_file = Path(f"/tmp/mxwire-{os.getpid()}.port")
    child = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file)])
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline or child.poll() is not None:
                raise SystemExit("the echo process did not start")
            time.sleep(0.05)
        asyncio.run(run(int(port_file.read_text()), args.quick))
    finally:
        child.terminate()
        child.wait(timeout=10)
        port_file.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
