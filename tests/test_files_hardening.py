"""Files on a shared cache: a manifest names only files beside it, and two writers of the same
shard or model never write into one temporary file."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from tinygguf import make_tiny_gguf

from edgespec.llm.gguf_read import ShardError, read_info
from edgespec.llm.shards import Manifest, cut_window, shard_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_gguf(tmp_path_factory.mktemp("files") / "tiny.gguf", "qwen2", n_layer=4,
                          n_embd=64, seed=5)


@pytest.mark.parametrize("name", ["../x.gguf", "/etc/passwd", "sub/x.gguf", ".."])
def test_manifest_names_are_confined_to_its_folder(tiny, tmp_path, name):
    out = tmp_path / "shards"
    shard_model(tiny, out, n_stages=2)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["shards"][0]["file"] = name
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match="not a plain file name"):
        Manifest.load(out / "manifest.json")


def test_concurrent_cuts_of_one_window_both_succeed(tiny, tmp_path):
    target = tmp_path / "w.gguf"
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def cut() -> None:
        try:
            barrier.wait()
            cut_window(tiny, (1, 3), target)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=cut) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert read_info(target).layer_range == (1, 3)
    assert not list(tmp_path.glob("w.gguf.part*"))
