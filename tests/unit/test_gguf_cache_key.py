"""engine/loader.py: $PDSERVE_DEFAULT_MODEL names the default model; a GGUF's
conversion is keyed by the file's content, so the same file installed again (another
venv path, another mtime) reuses the conversion, and a different file does not."""

import os

from pdserve.engine import loader


def test_the_same_content_elsewhere_maps_to_one_conversion(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "cache_dir", lambda: tmp_path / "cache")
    a, b, c = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, data in ((a, b"GGUF" * 1000), (b, b"GGUF" * 1000), (c, b"GGUF" * 999 + b"FUGG")):
        path.parent.mkdir()
        path.write_bytes(data)
    os.utime(b, ns=(1, 1))                        # another install: another mtime
    converted = []
    monkeypatch.setattr(loader, "_convert",
                        lambda gguf, out: (out.mkdir(parents=True), converted.append(gguf)))
    assert loader._converted_gguf(a) == loader._converted_gguf(b)
    assert loader._converted_gguf(c) != loader._converted_gguf(a)
    assert converted == [a, c]                    # b found a's conversion


def test_the_environment_can_name_the_default_model(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("PDSERVE_DEFAULT_MODEL", str(tmp_path))
    assert loader.resolve_model("default") == tmp_path
    assert loader.resolve_model(None) == tmp_path


def test_a_files_key_is_hashed_once_per_version(tmp_path, monkeypatch):
    """The key is kept per (path, size, mtime): another process reads it, a new
    version of the file is hashed again."""
    monkeypatch.setattr(loader, "cache_dir", lambda: tmp_path / "cache")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" * 1000)
    st = gguf.stat()
    key = loader._content_key(str(gguf), st.st_size, st.st_mtime_ns)
    loader._content_key.cache_clear()           # as in another process
    gguf.write_bytes(b"FUGG" * 1000)            # same size; the old mtime put back
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert loader._content_key(str(gguf), st.st_size, st.st_mtime_ns) == key   # kept
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1))   # a new version
    assert loader._content_key(str(gguf), st.st_size, st.st_mtime_ns + 1) != key
