"""
Where the project's data comes from: an offline mirror folder, or the public homes when online.

One setting names the mirror: the environment variable PREPROJ_MIRROR (or the `--mirror` flag of every script).
With a mirror, files are read from it and nothing is downloaded; without one, files are downloaded once into
data/cache/downloads. Files that are byte-identical upstream are pinned by sha256 and checked either way.
"""

import contextlib
import errno
import hashlib
import io
import os
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

MIRROR_ENV = "PREPROJ_MIRROR"
UMASK = os.umask(0)
os.umask(UMASK)  # read once (umask can only be read by setting it)
CACHE = Path(__file__).resolve().parent / "cache"
NLTK = "https://raw.githubusercontent.com/nltk/nltk_data/gh-pages/packages/corpora"
WIKITEXT2 = "https://wikitext.smerity.com/wikitext-2-raw-v1.zip"
ARC = "https://ai2-public-datasets.s3.amazonaws.com/arc/ARC-V1-Feb2018.zip"


class DataError(Exception):
    """A data file is missing, corrupt or malformed, or a file cannot be written; the message says which and what
    to do."""


@dataclass(frozen=True)
class Source:
    url: str
    member: str = ""  # path inside a zip archive, when the upstream file is an archive
    sha256: str = ""  # pinned only where the mirror's file is byte-identical to the upstream one
    items: int = 0  # where it is not: the number of items the full file holds, which its reader checks


SOURCES = {
    "lambada/lambada_test.jsonl": Source(
        "https://openaipublic.blob.core.windows.net/gpt-2/data/lambada_test.jsonl",
        sha256="4aa8d02cd17c719165fc8a7887fddd641f43fcafa4b1c806ca8abc31fabdb226"),
    "wikitext/wiki.test.raw": Source(
        WIKITEXT2, member="wikitext-2-raw/wiki.test.raw",
        sha256="173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08"),
    # WikiText-2's validation split holds the same lines as WikiText-103's (the split the paper's PPL reads)
    "wikitext/wiki.valid.raw": Source(
        WIKITEXT2, member="wikitext-2-raw/wiki.valid.raw",
        sha256="4cd0f6876d07a413aa911261ff6d363c72d757d47f0fdd6015702014c89cb9c7"),
    # the mirror's HellaSwag is rebuilt, not byte-identical upstream (its README): checked by its count instead
    "hellaswag/hellaswag_val.jsonl": Source(
        "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl", items=10_042),
    # AI2's ARC-Easy splits (Train: the mirror's copy, rebuilt as Dev and Test were, no published hash to check)
    **{f"arc/ARC-Easy-{split}.jsonl": Source(ARC, member=f"ARC-V1-Feb2018-2/ARC-Easy/ARC-Easy-{split}.jsonl",
                                             sha256=digest) for split, digest in (
        ("Dev", "f4364b808a68df6bf500ce1070fb0105d40cacd2391c210deb00ff83ba75d1f4"),
        ("Test", "ce32a0774b4beb1977d2c6b16dda5dd2b24fdc9c7f506882c452678676bd09be"),
        ("Train", "c62e5482d8c01f2d5a7f24239ac9db3b12f9e47267c4e3f088c6ffe41d5545ef"))},
    "tokenizers/20B_tokenizer.json": Source("https://huggingface.co/EleutherAI/pythia-160m/resolve/main/tokenizer.json"),
    "corpus/tinyshakespeare.txt": Source(
        "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"),
    "corpus/kjv.txt": Source("https://www.gutenberg.org/cache/epub/10/pg10.txt"),
}
# Whole folders of the corpus come from NLTK's data packages (zip archives).
FOLDERS = {name: f"{NLTK}/{name}.zip" for name in ("gutenberg", "inaugural", "state_union")}


def mirror_dir(mirror: str | None = None) -> Path | None:
    path = mirror or os.environ.get(MIRROR_ENV)
    if not path:
        return None
    if not os.path.isdir(path):
        raise DataError(f"mirror folder {path} does not exist; point {MIRROR_ENV} or --mirror at the data mirror")
    return Path(path)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.read()
    except OSError as e:
        raise DataError(f"could not download {url} ({e}); offline, set {MIRROR_ENV} to a data mirror") from e


def write_atomic(path: Path, content: bytes | str | Callable[[Path], None]) -> None:
    """Write a file so that no reader ever sees half of it: into a hidden temp file beside it (.<name>.<pid>.tmp,
    one per process, so that concurrent writers of one file never share a temporary), then a rename. content is
    bytes, text (UTF-8), or a function that writes to the path it is given. A failed write (a full disk, say)
    leaves the previous file intact, removes the temp file and raises a DataError saying so."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if callable(content):
            content(tmp)
        else:
            tmp.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
        os.chmod(tmp, 0o666 & ~UMASK)  # as a plain open() would create it (some writers make their files 0600)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the bytes are on disk before the rename makes them the file
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):  # missing, or under a path that is not a folder
            tmp.unlink()
        raise write_error(path, e) from e


def write_error(path: Path, e: OSError) -> DataError:
    """A failed write, in one line: a full disk says so."""
    if e.errno == errno.ENOSPC:
        return DataError(f"the disk is full: could not write {path} (what was written before is intact); free some "
                         f"space and run again")
    return DataError(f"could not write {path}: {e.strerror or e}")


def read_text(path: Path) -> str:
    """A text file that must be UTF-8; a DataError names the file when it is not."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (byte {e.start}); replace the file") from e


def archive(url: str, digest: str = "") -> Path:
    """A downloaded archive, kept in data/cache/downloads/archives so that each of its members costs no new
    download; checked against its sha256 `digest` where one is pinned. A file that fails a check is set aside as
    `<name>.bad` (never read again, never deleted), so that the next run downloads it anew."""
    path = CACHE / "downloads" / "archives" / url.rsplit("/", 1)[-1]
    if not path.is_file():
        write_atomic(path, download(url))
    if not zipfile.is_zipfile(path):  # e.g. a captive portal's page saved under the name
        set_aside(path, "was not a zip archive (a login or error page saved in its place?)")
    if digest and sha256(path) != digest:
        set_aside(path, f"has the wrong sha256 (expected {digest[:12]}..., published for {url.rsplit('/', 1)[-1]})")
    return path


def set_aside(path: Path, problem: str) -> None:
    aside = path.with_name(path.name + ".bad")
    os.replace(path, aside)
    raise DataError(f"{path} {problem}; it is set aside as {aside.name}: run again to download it anew")


def read_member(path: Path, member: str) -> bytes:
    try:
        with zipfile.ZipFile(path) as z:
            return z.read(member)
    except (zipfile.BadZipFile, KeyError) as e:
        raise DataError(f"{path} is not the expected archive ({e}); delete it to download it again") from e


def fetch(relpath: str, mirror: str | None = None) -> Path:
    """Local path of a data file named by its path in the mirror layout (e.g. 'lambada/lambada_test.jsonl')."""
    src = SOURCES[relpath]
    root = mirror_dir(mirror)
    if root is not None:
        path = root / relpath
        if not path.is_file():
            raise DataError(f"{relpath} is missing from the mirror folder {root}; get it from {src.url}")
    else:
        path = CACHE / "downloads" / relpath
        if not path.is_file():
            write_atomic(path, read_member(archive(src.url), src.member) if src.member else download(src.url))
    if src.sha256 and sha256(path) != src.sha256:
        raise DataError(f"{path} has the wrong sha256 (expected {src.sha256[:12]}...); "
                        f"it is corrupt or another version: replace it with the file from {src.url}")
    return path


def fetch_folder(name: str, mirror: str | None = None) -> list[Path]:
    """The .txt files of a corpus folder ('gutenberg', 'inaugural', 'state_union'), sorted by name."""
    root = mirror_dir(mirror)
    folder = (root / "corpus" / name) if root is not None else CACHE / "downloads" / "corpus" / name
    if root is None and not folder.is_dir():
        with zipfile.ZipFile(io.BytesIO(download(FOLDERS[name]))) as z:
            for member in z.namelist():
                if member.endswith(".txt") and "README" not in member:
                    text = z.read(member).decode("utf-8", errors="replace")  # a few upstream files are Latin-1
                    write_atomic(folder / os.path.basename(member), text.encode("utf-8"))
    files = sorted(folder.glob("*.txt")) if folder.is_dir() else []
    if not files:
        raise DataError(f"corpus/{name}/ is missing or empty in {folder.parent.parent}; get it from {FOLDERS[name]}")
    return files
