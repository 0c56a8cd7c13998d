from leverlab.train.corpus import SourceFile, load_splits, split_files, stdlib_root


def _files(n: int) -> list[SourceFile]:
    return [SourceFile(f"pkg{i % 7}/mod{i}.py", f"x = {i}\n") for i in range(n)]


def test_split_is_deterministic_and_disjoint_by_file():
    files = _files(500)
    a, b = split_files(files), split_files(list(reversed(files)))  # input order must not matter
    assert {k: [f.rel for f in v] for k, v in a.items()} == {k: [f.rel for f in v] for k, v in b.items()}
    names = {k: {f.rel for f in v} for k, v in a.items()}
    assert not (names["train"] & names["val"]) and not (names["train"] & names["heldout"])
    assert not (names["val"] & names["heldout"])
    assert names["train"] | names["val"] | names["heldout"] == {f.rel for f in files}
    assert len(names["val"]) == 20 and len(names["heldout"]) == 30


def test_seed_changes_the_split():
    files = _files(200)
    assert split_files(files, seed=0)["heldout"] != split_files(files, seed=1)["heldout"]


def test_real_stdlib_corpus_is_deduplicated_and_found_through_sysconfig():
    root = stdlib_root()
    assert (root / "json" / "decoder.py").exists()
    splits = load_splits()
    all_files = [f for v in splits.values() for f in v]
    assert len(all_files) > 500
    assert len({f.text for f in all_files}) == len(all_files)  # no duplicate contents
    assert not any("site-packages" in f.rel for f in all_files)
