"""Model files (moa_serve/model_files.py): what a hub download fetches."""


def test_hub_download_fetches_only_what_is_loaded(tmp_path, monkeypatch):
    """A hub id that is not local is fetched with file patterns: safetensors weights (no .bin /
    ONNX / GGUF duplicates) for model replicas, config + tokenizer only for the router."""
    import huggingface_hub

    from moa_serve import model_files as models

    calls = []

    def fake_snapshot(repo_id, allow_patterns=None, **kw):
        calls.append(allow_patterns)
        (tmp_path / "config.json").write_text("{}")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    monkeypatch.setenv("MOA_MODEL_DIR", str(tmp_path / "nothing-here"))
    assert models.resolve_model_path("some-org/some-model") == tmp_path
    assert models.resolve_model_path("some-org/some-model", weights=False) == tmp_path
    with_weights, without = calls
    assert "*.safetensors" in with_weights and "*.json" in with_weights
    assert "*.safetensors" not in without and "*.json" in without
    assert "*" not in with_weights and not any(x in p for p in with_weights for x in (".bin", ".gguf", ".onnx"))
