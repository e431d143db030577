"""Transport figures: per-hop cost of sealed vs plaintext links on loopback for a one-token
frame and a 64-row tree frame, and bytes per token per hop for float16 vs 8-bit activations
with their quantization error.

    .venv/bin/python bench/transport_bench.py [--laps 2000] [--rounds 4] [--model PATH]
    .venv/bin/python -m bench.transport_bench --smoke      # seconds: 20 laps in 2 rounds,
                                                           # no real model's embeddings

Per-hop time is measured on a 4-hop ring (head -> 3 stages -> head) side by side with bare TCP
sockets doing the same ring with the same frame sizes: ``overhead = edgespec hop - bare hop``.
Each edgespec ring runs twice, sealed (ChaCha20-Poly1305, the default) and plaintext
(``EDGESPEC_INSECURE_PLAINTEXT``, benchmarks only), in alternating rounds so that load from
other users of the host hits both alike; ``sealing_cost_us`` is sealed minus plaintext. Two hop
kinds are timed: "forward" (receive, open, re-seal, send; what a relay does) and
"decode+encode" (full payload decode to float32 and re-encode; what a compute stage does,
minus the compute). ``aead_us`` is the bare cryptography cost of sealing and opening one frame
of each size, without sockets, and ``open_copy_vs_in_place`` what decrypting in place would
save over decrypting into a fresh payload buffer (where the installed cryptography allows it
at all; it says why not otherwise). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
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

import cryptography  # noqa: E402

from edgespec import wire  # noqa: E402
from edgespec.wire import HEADER_SIZE, TAG_SIZE, FieldTag, Kind, hidden_message, seq_matrix  # noqa: E402
from edgespec.wire.auth import SessionKeys  # noqa: E402
from edgespec.wire.server import FrameServer  # noqa: E402
from edgespec.wire.transport import Connection, connect  # noqa: E402

KEY = os.urandom(32)
HOPS = 4  # head -> s0 -> s1 -> s2 -> head


def one_token(n_embd: int = 896, encoding: str = "f16") -> wire.Message:
    h = np.random.default_rng(0).standard_normal((1, n_embd)).astype(np.float32)
    return hidden_message(h, [17], seq_matrix([[0]]), encoding=encoding)


def tree_frame(rows: int = 64, n_embd: int = 896, encoding: str = "f16", leaves: int = 16) -> wire.Message:
    """A verification batch as a middle stage sees it: ``rows`` tree nodes (token ids,
    positions, one sequence per leaf) with their hidden states."""
    rng = np.random.default_rng(1)
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, rows)], np.int32)
    depth = np.zeros(rows, np.int32)
    for i in range(1, rows):
        depth[i] = depth[parents[i]] + 1
    seqs = [[i % leaves] for i in range(rows)]
    h = rng.standard_normal((rows, n_embd)).astype(np.float32)
    return hidden_message(h, 100 + depth, seq_matrix(seqs, leaves), encoding=encoding, tokens=rng.integers(0, 150000, rows))


def frame_size(msg: wire.Message, sealed: bool = True) -> int:
    return HEADER_SIZE + len(wire.payload_bytes(msg)) + (TAG_SIZE if sealed else 0)


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
        with contextlib.suppress(OSError):  # the sockets close under it at the end
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


def edgespec_ring(msg: wire.Message, laps: int, decode: bool, seal: bool) -> list[float]:
    """head -> 3 stages -> head with sealed (or plaintext) frames; the head times each lap."""
    head = FrameServer(KEY, node_id="head", seal=seal)
    arrived = threading.Event()
    head.register(Kind.HIDDEN, lambda conn, frame: (frame.decode(), arrived.set())[1] if decode else arrived.set())
    stages = [FrameServer(KEY, node_id=f"s{i}", seal=seal) for i in range(HOPS - 1)]
    links: list[Connection] = []
    head.start()
    for s in stages:
        s.start()
    nexts = [*stages[1:], head]
    for s, nxt in zip(stages, nexts, strict=True):
        link = connect(*nxt.address, KEY, node_id=s.node_id, seal=seal)
        links.append(link)
        if decode:
            # A compute stage: decode the hidden states to float32, build and encode a new frame.
            def handler(conn, frame, link=link):
                m = frame.decode()
                link.send(hidden_message(m[FieldTag.HIDDEN], m[FieldTag.POSITIONS], m[FieldTag.SEQ_IDS], encoding=m.hidden_encoding, tokens=m.fields.get(FieldTag.TOKENS), lap_id=m.lap_id))
        else:

            def handler(conn, frame, link=link):
                link.forward(frame)

        s.register(Kind.HIDDEN, handler)
    entry = connect(*stages[0].address, KEY, node_id="head", seal=seal)
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


def aead_us(msg: wire.Message, reps: int = 2000) -> float:
    """Microseconds to seal and open one frame of ``msg`` (no sockets)."""
    keys = SessionKeys.derive(KEY, b"c" * 32, b"s" * 32)
    send, _ = keys.for_role("client")
    _, recv = keys.for_role("server")
    header, chunks = wire.encode_frame(msg)
    chunks = [b"".join(bytes(c) for c in chunks)]
    t0 = time.perf_counter()
    for _ in range(reps):
        hb, body = send.seal(header, chunks)
        recv.open(wire.decode_header(hb), hb, bytearray(body))
    return round((time.perf_counter() - t0) / reps * 1e6, 2)


def open_copy_vs_in_place(msg: wire.Message, reps: int = 2000) -> dict:
    """Microseconds to open one sealed frame into a fresh buffer (what ``FrameSeal.open`` does)
    vs decrypting in place over the received bytes (saves the allocation, but relies on the
    cipher tolerating aliased buffers, which cryptography does not document)."""
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    aead = ChaCha20Poly1305(KEY)
    data = b"".join(bytes(c) for c in wire.encode_frame(msg)[1])
    nonce, aad = bytes(12), bytes(HEADER_SIZE)
    sealed = aead.encrypt(nonce, data, aad)
    n = len(data)
    t0 = time.perf_counter()
    for _ in range(reps):
        body = bytearray(sealed)  # stands in for the receive buffer
        aead.decrypt_into(nonce, body, aad, bytearray(n))
    fresh = time.perf_counter() - t0
    out: dict = {"fresh_buffer_us": round(fresh / reps * 1e6, 2)}
    try:
        t0 = time.perf_counter()
        for _ in range(reps):
            body = bytearray(sealed)
            mv = memoryview(body)
            aead.decrypt_into(nonce, mv, aad, mv[:n])
        out["in_place_us"] = round((time.perf_counter() - t0) / reps * 1e6, 2)
    except ValueError as e:  # cryptography 51 refuses aliased buffers outright
        out["in_place_us"] = None
        out["in_place_refused"] = f"cryptography {cryptography.__version__}: {e}"
    return out


def machine() -> dict:
    model = platform.processor()
    with contextlib.suppress(OSError):
        model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), model)
    return {
        "host": platform.node(),
        "cpu": model,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cryptography": cryptography.__version__,
        "load_avg_start": list(os.getloadavg()),
    }


def side_by_side(msg: wire.Message, laps: int, rounds: int) -> dict:
    """Bare TCP, then sealed and plaintext rings in alternating rounds, per hop."""
    runs: dict[str, list[float]] = {k: [] for k in ("sealed_forward", "plain_forward", "sealed_decode_encode", "plain_decode_encode")}
    per_round = max(laps // rounds, 1)
    for r in range(rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        for seal in order:
            name = "sealed" if seal else "plain"
            runs[f"{name}_forward"] += edgespec_ring(msg, per_round, decode=False, seal=seal)
            runs[f"{name}_decode_encode"] += edgespec_ring(msg, per_round, decode=True, seal=seal)
    bare = per_hop_us(bare_ring(frame_size(msg), per_round * rounds))
    out: dict = {"frame_bytes_sealed": frame_size(msg), "frame_bytes_plain": frame_size(msg, sealed=False), "bare_tcp_us": bare}
    for k, v in runs.items():
        out[f"{k}_us"] = per_hop_us(v)
    for kind in ("forward", "decode_encode"):
        sealed, plain = out[f"sealed_{kind}_us"]["median"], out[f"plain_{kind}_us"]["median"]
        out[f"sealing_cost_{kind}_us"] = round(sealed - plain, 1)
        out[f"overhead_sealed_{kind}_us"] = round(sealed - bare["median"], 1)
        out[f"overhead_plain_{kind}_us"] = round(plain - bare["median"], 1)
    out["aead_seal_and_open_us"] = aead_us(msg)
    out["open_copy_vs_in_place"] = open_copy_vs_in_place(msg)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--laps", type=int, default=2000, help="laps per ring kind, split over the rounds")
    ap.add_argument("--rounds", type=int, default=4, help="alternating sealed/plaintext rounds")
    ap.add_argument("--model", type=Path, default=Path.home() / ".cache/edgespec/models/qwen2.5-coder-0.5b-instruct.gguf")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: 20 laps in 2 rounds; quantization errors on random states "
                         "only (a tiny model, unless --model, fits neither width)")
    args = ap.parse_args(argv)
    if args.smoke:
        from bench import smoke

        smoke.apply(ap, args, laps=20, rounds=2, model=lambda: Path(smoke.tiny_model()))

    report: dict = {
        "command": " ".join([Path(sys.executable).name, *(sys.argv if argv is None
                                                           else ["-m", "bench.transport_bench",
                                                                 *argv])]),
        "machine": machine(),
        "ring_hops": HOPS,
        "laps": args.laps,
        "rounds": args.rounds,  # alternating sealed/plaintext repetitions (not a ring round)
    }
    report["one_token_hop"] = {"message": "HIDDEN, 1 token, n_embd 896, f16", **side_by_side(one_token(896, "f16"), args.laps, args.rounds)}
    report["tree64_hop"] = {"message": "HIDDEN, 64-row tree (token ids, 16 leaf sequences), n_embd 896, f16", **side_by_side(tree_frame(64, 896, "f16"), args.laps, args.rounds)}
    report["machine"]["load_avg_end"] = list(os.getloadavg())

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
