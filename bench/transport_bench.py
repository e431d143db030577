"""Transport figures: per-hop overhead on loopback for a one-token message, and bytes per token
per hop for float16 vs 8-bit activations with their quantization error.

    .venv/bin/python bench/transport_bench.py [--laps 2000] [--model PATH]

Per-hop overhead is measured side by side with bare TCP sockets doing the same ring on the same
machine: ``overhead = edgespec hop - bare socket hop``. Two edgespec hop kinds are timed:
"forward" (receive, verify MAC, re-MAC, send the same buffer; what a relay does) and
"decode+encode" (full payload decode to float32 and re-encode; what a compute stage does,
minus the compute). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec import wire  # noqa: E402
from edgespec.transport import Connection, FrameServer, connect  # noqa: E402
from edgespec.wire import HEADER_SIZE, MAC_SIZE, FieldTag, Kind, hidden_message, seq_matrix  # noqa: E402

KEY = os.urandom(32)
HOPS = 4  # head -> s0 -> s1 -> s2 -> head


def one_token(n_embd: int = 896, encoding: str = "f16") -> wire.Message:
    h = np.random.default_rng(0).standard_normal((1, n_embd)).astype(np.float32)
    return hidden_message(h, [17], seq_matrix([[0]]), encoding=encoding)


def frame_size(msg: wire.Message) -> int:
    return HEADER_SIZE + len(wire.payload_bytes(msg)) + MAC_SIZE


# ----------------------------------------------------------------------------- bare sockets


def bare_ring(frame_len: int, laps: int) -> list[float]:
    """The same 4-hop ring with plain TCP_NODELAY sockets and fixed-size messages."""
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(HOPS)]
    outs = [socket.create_connection(srv.getsockname()[:2]) for srv in listeners]
    ins = [srv.accept()[0] for srv in listeners]
    for s in outs + ins:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def relay(src: socket.socket, dst: socket.socket) -> None:
        buf = bytearray(frame_len)
        view = memoryview(buf)
        while True:
            got = 0
            while got < frame_len:
                k = src.recv_into(view[got:])
                if k == 0:
                    return
                got += k
            dst.sendall(buf)

    # head sends on outs[0]; stage i reads ins[i], writes outs[i+1]; head reads ins[HOPS-1].
    threads = [threading.Thread(target=relay, args=(ins[i], outs[i + 1]), daemon=True) for i in range(HOPS - 1)]
    for t in threads:
        t.start()
    msg = os.urandom(frame_len)
    buf = bytearray(frame_len)
    view = memoryview(buf)
    times = []
    for _ in range(laps):
        t0 = time.perf_counter()
        outs[0].sendall(msg)
        got = 0
        while got < frame_len:
            got += ins[HOPS - 1].recv_into(view[got:])
        times.append(time.perf_counter() - t0)
    for s in outs + ins + listeners:
        s.close()
    return times


# ----------------------------------------------------------------------------- edgespec ring


def edgespec_ring(msg: wire.Message, laps: int, decode: bool) -> list[float]:
    """head -> 3 stages -> head with authenticated frames; the head times each lap."""
    head = FrameServer(KEY, node_id="head")
    arrived = threading.Event()
    head.register(Kind.HIDDEN, lambda conn, frame: (frame.decode(), arrived.set())[1] if decode else arrived.set())
    stages = [FrameServer(KEY, node_id=f"s{i}") for i in range(HOPS - 1)]
    links: list[Connection] = []
    head.start()
    for s in stages:
        s.start()
    nexts = [*stages[1:], head]
    for s, nxt in zip(stages, nexts, strict=True):
        link = connect(*nxt.address, KEY, node_id=s.node_id)
        links.append(link)
        if decode:
            # A compute stage: decode the hidden states to float32, build and encode a new frame.
            def handler(conn, frame, link=link):
                m = frame.decode()
                link.send(hidden_message(m[FieldTag.HIDDEN], m[FieldTag.POSITIONS], m[FieldTag.SEQ_IDS], encoding=m.hidden_encoding, lap_id=m.lap_id))
        else:

            def handler(conn, frame, link=link):
                link.forward(frame)

        s.register(Kind.HIDDEN, handler)
    entry = connect(*stages[0].address, KEY, node_id="head")
    times = []
    try:
        for lap in range(laps):
            arrived.clear()
            t0 = time.perf_counter()
            msg.lap_id = lap
            entry.send(msg)
            if not arrived.wait(10):
                raise RuntimeError("lap lost")
            times.append(time.perf_counter() - t0)
    finally:
        entry.close()
        for link in links:
            link.close()
        for s in stages:
            s.close()
        head.close()
    return times


def per_hop_us(times: list[float]) -> dict:
    xs = sorted(times[len(times) // 10 :])  # drop warm-up
    return {
        "median": round(statistics.median(xs) / HOPS * 1e6, 1),
        "p90": round(xs[int(0.9 * len(xs))] / HOPS * 1e6, 1),
    }


# ----------------------------------------------------------------------------- sizes & error


def quant_error(h: np.ndarray, encoding: str) -> dict:
    back = wire.decode_payload(*_header_payload(hidden_message(h, np.arange(len(h)), seq_matrix([[0]] * len(h)), encoding=encoding)))[FieldTag.HIDDEN]
    err = back - h
    return {
        "rel_rms": float(np.sqrt((err**2).mean() / (h**2).mean())),
        "max_abs": float(np.abs(err).max()),
        "cosine_min": float(np.min((back * h).sum(1) / (np.linalg.norm(back, axis=1) * np.linalg.norm(h, axis=1)))),
    }


def _header_payload(msg: wire.Message):
    header, chunks = wire.encode_frame(msg)
    return header, b"".join(bytes(c) for c in chunks)


def sample_states(n_embd: int, model: Path | None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    g = rng.standard_normal((64, n_embd)).astype(np.float32)
    outl = g.copy()
    outl[:, rng.choice(n_embd, 3, replace=False)] *= 300  # "massive activation" channels
    out = {"gaussian": g, "gaussian+outlier_channels": outl}
    if model is not None and model.exists():
        from gguf import GGUFReader
        from gguf.quants import dequantize

        reader = GGUFReader(str(model))
        t = next(t for t in reader.tensors if t.name == "token_embd.weight")
        if int(t.shape[0]) == n_embd:
            rows = dequantize(t.data[1000:1064], t.tensor_type).astype(np.float32)
            out["real_token_embeddings"] = rows.reshape(64, n_embd)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--laps", type=int, default=2000)
    ap.add_argument("--model", type=Path, default=Path.home() / ".cache/edgespec/models/qwen2.5-coder-0.5b-instruct.gguf")
    args = ap.parse_args()

    report: dict = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(), "processor": platform.processor()},
        "ring_hops": HOPS,
        "laps": args.laps,
    }
    msg = one_token(896, "f16")
    size = frame_size(msg)
    bare = per_hop_us(bare_ring(size, args.laps))
    fwd = per_hop_us(edgespec_ring(msg, args.laps, decode=False))
    full = per_hop_us(edgespec_ring(one_token(896, "f16"), args.laps, decode=True))
    report["one_token_hop"] = {
        "message": "HIDDEN, 1 token, n_embd 896, f16",
        "frame_bytes": size,
        "bare_tcp_us": bare,
        "edgespec_forward_us": fwd,
        "edgespec_decode_encode_us": full,
        "overhead_forward_us": round(fwd["median"] - bare["median"], 1),
        "overhead_decode_encode_us": round(full["median"] - bare["median"], 1),
        "target_us": 300,
    }

    sizes = {}
    for n_embd in (896, 1536):
        for n_tok in (1, 16, 64):
            h = np.zeros((n_tok, n_embd), np.float32)
            row = {}
            for enc in ("f32", "f16", "q8"):
                m = hidden_message(h, np.arange(n_tok), seq_matrix([[0]] * n_tok), encoding=enc)
                row[enc] = round(frame_size(m) / n_tok, 1)
            row["f16_over_q8"] = round(row["f16"] / row["q8"], 3)
            row["f32_over_q8"] = round(row["f32"] / row["q8"], 3)
            sizes[f"n_embd={n_embd},tokens={n_tok}"] = row
    report["bytes_per_token_per_hop"] = sizes

    errors = {}
    for n_embd in (896, 1536):
        for name, h in sample_states(n_embd, args.model).items():
            errors[f"n_embd={n_embd},{name}"] = {enc: quant_error(h, enc) for enc in ("f16", "q8")}
    report["quantization_error"] = errors
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
