"""``train.compile_cache``: what happens to a run when its cache file is damaged or cannot be written (a
warning, never a failed run). That a restart in a fresh process loads the file and compiles nothing is
``test_compile.py``'s resume test, on the trainer's real compiled step."""

import torch

from convbert_ds.engine.compile_cache import CompileCache, cache_file, load_artifacts


def _compile_something() -> None:
    """A graph of this process's own, so that it has something to write (the cache counts graphs per
    process, and other tests in this process may have compiled theirs)."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.sin(x) * 3 + 1)
    assert torch.allclose(compiled(torch.ones(4)), torch.sin(torch.ones(4)) * 3 + 1)


def test_a_damaged_file_is_a_warning_then_written_anew(tmp_path, capsys):
    path = tmp_path / "cache" / "torch-x-cpu-stage0-0.bin"
    path.parent.mkdir()
    path.write_bytes(b"not what torch wrote" * 100)
    cache = CompileCache(path, writes=True)
    cache.load()
    said = capsys.readouterr().out
    assert f"warning: train.compile_cache: {path} is damaged" in said and "the first step compiles" in said
    _compile_something()
    cache.after_step()
    said = capsys.readouterr().out
    assert f"compile cache: wrote {path}" in said and "graph(s) found in inductor's caches" in said
    assert load_artifacts(path) == path.read_bytes()  # torch reads back what was written
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # written under another name, then renamed
    cache.after_step()  # no new graph since: nothing written again
    assert capsys.readouterr().out == ""


def test_an_unwritable_directory_is_a_warning(tmp_path, capsys):
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("a file where the cache directory would go")
    path = cache_file(blocker, {"any": "settings"}, stage=1)
    assert path.name.startswith(f"torch-{torch.__version__.replace('+', '_')}-cpu_") and "-stage1-" in path.name
    cache = CompileCache(path, writes=True)
    cache.load()  # nothing there: silent, and the first step compiles
    _compile_something()
    cache.after_step()
    said = capsys.readouterr().out
    assert f"warning: train.compile_cache: cannot write {path}" in said
    assert "set train.compile_cache_dir to a writable directory" in said


def test_names_differ_by_settings_and_stage(tmp_path):
    base = {"seq_len": 128, "micro_batch_size": 32}
    names = {cache_file(tmp_path, base, 0), cache_file(tmp_path, {**base, "seq_len": 512}, 0),
             cache_file(tmp_path, base, 1), cache_file(tmp_path, dict(reversed(base.items())), 0)}
    assert len(names) == 3  # key order does not matter; the settings and the stage do
