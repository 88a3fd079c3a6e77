"""`kdamesh up`'s generated checkpoint is made once, kept while its generator stamp is current, and made again when
an older generator wrote it (so a cache from before a layout change is never served stale)."""

from deploy import checkpoints


def test_made_once_then_kept_then_remade_when_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("KDAMESH_HOME", str(tmp_path))
    calls = []

    def fake_make(preset, out):
        calls.append(preset)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "tokenizer.json").write_text("{}")

    monkeypatch.setattr("engine.model.checkpoint.make_checkpoint", fake_make)
    folder = checkpoints.default_model_dir("tiny-k3")
    assert calls == ["tiny-k3"] and (folder / checkpoints.GENERATOR_STAMP).read_text() == checkpoints.GENERATOR_VERSION
    assert checkpoints.default_model_dir("tiny-k3") == folder and calls == ["tiny-k3"]  # current: kept
    (folder / checkpoints.GENERATOR_STAMP).unlink()  # as a folder from before the stamp existed
    (folder / "tokenizer.json").unlink()
    assert checkpoints.default_model_dir("tiny-k3") == folder and calls == ["tiny-k3", "tiny-k3"]
    assert (folder / "tokenizer.json").is_file() and not folder.with_name("tiny-k3.tmp").exists()
