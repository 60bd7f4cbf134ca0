"""``backend.probe_cache``: probed row tiles kept on disk per machine; a bad file is a miss, not an error."""

from __future__ import annotations

import json

import torch

from backend import probe_cache
from backend.models import llama


def test_row_tiles_stored_then_read_back_and_bad_files_are_misses(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_GATEWAY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(probe_cache, "_memory", {})
    w = torch.randn(64, 96)
    packed = llama.onednn_pack(w)
    assert packed is not None
    tiles = llama.row_tiles(packed, 96, torch.float32, None)
    assert tiles[-1] >= 2  # a single row is sent as two: float32 is row-invariant past the GEMV
    data = json.loads((tmp_path / "probes.json").read_text())
    (entry,) = data.values()
    assert list(tiles) in entry.values()

    # a new process (empty memory) reads the file instead of probing
    monkeypatch.setattr(probe_cache, "_memory", {})
    key = next(iter(entry))
    data[probe_cache.fingerprint()][key] = [7]
    (tmp_path / "probes.json").write_text(json.dumps(data))
    assert llama.row_tiles(packed, 96, torch.float32, None) == (7,)

    # corrupt, wrong-shaped or foreign entries: probed again, the file rewritten whole
    for text in (
        "{not json",
        "[]",
        json.dumps({"other-machine": {key: [3]}}),
        json.dumps({probe_cache.fingerprint(): {key: ["x"]}}),
    ):
        (tmp_path / "probes.json").write_text(text)
        monkeypatch.setattr(probe_cache, "_memory", {})
        assert llama.row_tiles(packed, 96, torch.float32, None) == tiles
        assert json.loads((tmp_path / "probes.json").read_text())[probe_cache.fingerprint()][key] == list(
            tiles
        )


def test_unwritable_cache_dir_is_skipped(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("LLM_GATEWAY_CACHE_DIR", str(blocker / "sub"))  # a directory under a file
    monkeypatch.setattr(probe_cache, "_memory", {})
    probe_cache.put("k", [1, 2])
    assert probe_cache.get("k") == [1, 2]  # kept in memory for this process
