"""Shard distribution: the head sends a node the window it lacks, resumably and verified.

The node keeps received shards in a store keyed by model fingerprint and layer range. A
transfer is append-only: the node reports how many bytes of the shard it already holds, the
head sends from there in chunks (CONTROL frames carrying a BLOB), and the node checks size and
sha256 before renaming the file into place. An interrupted transfer (head or link gone) leaves
a ``.part`` file that the next attempt continues; a finished shard is never sent again.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

from edgespec.llm.shards import shard_file_name
from edgespec.wire import control as ctl

ShardOp = ctl.ShardStatus | ctl.ShardChunk | ctl.ShardFinish

# Progress bars take ``disable=None`` when wanted: tqdm then draws them on a terminal only, so
# a log file or pipe never collects carriage-return updates.

CHUNK = 4 << 20  # bytes per frame: far below the frame cap, large enough to keep links busy


class TransferError(RuntimeError):
    """A shard could not be stored or did not verify."""


def _sha256(path: Path, upto: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        left = upto
        while True:
            chunk = f.read(CHUNK if left is None else min(CHUNK, left))
            if not chunk:
                break
            h.update(chunk)
            if left is not None:
                left -= len(chunk)
    return h.hexdigest()


class ShardStore:
    """The node's side: where shards arrive and stay."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        # The ``.part`` file is shared on purpose (a resumed transfer continues it), so two
        # heads sending one shard at once take turns here rather than interleave appends.
        self._lock = threading.RLock()

    def path_for(self, fingerprint: str, start: int, stop: int) -> Path:
        if not fingerprint.isalnum():
            raise TransferError(f"bad fingerprint {fingerprint!r}")
        return self.root / shard_file_name(start, stop, fingerprint)

    def _meta_path(self, final: Path) -> Path:
        return final.with_name(final.name + ".json")

    def status(self, fingerprint: str, start: int, stop: int, size: int, sha256: str) -> dict:
        """What the node holds of this shard: ``complete`` or ``have`` bytes of a partial."""
        final = self.path_for(fingerprint, start, stop)
        meta = self._meta_path(final)
        if final.exists() and meta.exists():
            try:
                info = json.loads(meta.read_text())
            except ValueError:
                info = {}
            if info.get("sha256") == sha256 and final.stat().st_size == size:
                return {"complete": True, "have": size, "path": str(final)}
        part = final.with_name(final.name + ".part")
        have = part.stat().st_size if part.exists() else 0
        if have > size:  # a partial of some other file: start over
            part.unlink()
            have = 0
        return {"complete": False, "have": have, "path": str(final)}

    def write(self, fingerprint: str, start: int, stop: int, offset: int, data: bytes) -> int:
        """Append ``data`` at ``offset`` (which must be what the node already holds)."""
        final = self.path_for(fingerprint, start, stop)
        part = final.with_name(final.name + ".part")
        have = part.stat().st_size if part.exists() else 0
        if offset != have:
            raise TransferError(f"chunk at offset {offset}, but {have} bytes are held: resume "
                                f"from {have}")
        with open(part, "ab") as f:
            f.write(data)
        return have + len(data)

    def finish(self, fingerprint: str, start: int, stop: int, size: int, sha256: str) -> Path:
        """Verify the received bytes and put the shard in place (atomically)."""
        final = self.path_for(fingerprint, start, stop)
        part = final.with_name(final.name + ".part")
        if not part.exists() or part.stat().st_size != size:
            got = part.stat().st_size if part.exists() else 0
            raise TransferError(f"shard incomplete: {got} of {size} bytes")
        digest = _sha256(part)
        if digest != sha256:
            part.unlink()  # the bytes are wrong somewhere: a resume could not fix them
            raise TransferError(f"shard sha256 mismatch ({digest} != {sha256}); discarded")
        os.replace(part, final)
        self._meta_path(final).write_text(json.dumps({"sha256": sha256, "size": size}))
        return final


def handle(store: ShardStore, req: ShardOp | Mapping[str, Any], blob: bytes | None) -> dict:
    """Serve the ``shard_status`` / ``shard_chunk`` / ``shard_finish`` control ops (a typed
    request, or a CONTROL frame's META, which is parsed as one)."""
    if not isinstance(req, (ctl.ShardStatus, ctl.ShardChunk, ctl.ShardFinish)):
        parsed = ctl.parse_request(req, blob)
        if not isinstance(parsed, (ctl.ShardStatus, ctl.ShardChunk, ctl.ShardFinish)):
            raise TransferError(f"unknown shard op {parsed.op!r}")
        req = parsed
    with store._lock:
        return _handle(store, req, blob)


def _handle(store: ShardStore, req: ShardOp, blob: bytes | None) -> dict:
    fp, a, b = req.fingerprint, req.start, req.stop
    if isinstance(req, ctl.ShardStatus):
        return store.status(fp, a, b, req.size, req.sha256)
    if isinstance(req, ctl.ShardChunk):
        if blob is None:
            raise TransferError("shard_chunk without data")
        return {"have": store.write(fp, a, b, req.offset, bytes(blob))}
    return {"path": str(store.finish(fp, a, b, req.size, req.sha256))}


Request = Callable[..., Any]  # request(op, blob=None, **body) -> the REPLY Message


def send_shard(request: Request, path: str | os.PathLike[str], fingerprint: str, start: int,
               stop: int, *, name: str = "node", progress: bool = True,
               chunk: int = CHUNK) -> tuple[str, int]:
    """Send ``path`` (a shard of layers [start, stop)) to a node, resuming what it holds.

    Returns (the shard's path on the node, bytes actually sent)."""
    path = Path(path)
    size = path.stat().st_size
    sha = _sha256(path)
    ident = {"fingerprint": fingerprint, "start": start, "stop": stop}
    st = ctl.parse_reply("shard_status", request("shard_status", size=size, sha256=sha, **ident))
    assert isinstance(st, ctl.ShardStatusReply)
    if st.complete:
        return st.path, 0
    offset = st.have
    sent = 0
    with open(path, "rb") as f, tqdm(total=size, initial=offset, unit="B", unit_scale=True,
                                     desc=f"shard {start}:{stop} -> {name}",
                                     disable=None if progress else True) as bar:
        f.seek(offset)
        while offset < size:
            data = f.read(chunk)
            reply = ctl.parse_reply("shard_chunk",
                                    request("shard_chunk", blob=data, offset=offset, **ident))
            assert isinstance(reply, ctl.ShardChunkReply)
            offset = reply.have
            sent += len(data)
            bar.update(len(data))
    done = ctl.parse_reply("shard_finish", request("shard_finish", size=size, sha256=sha, **ident))
    assert isinstance(done, ctl.ShardFinishReply)
    return done.path, sent
