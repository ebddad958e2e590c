"""
The experiment's run records as the repository keeps them: one tarball of every record file of the grid's folder
(no checkpoints, tokenizers, logs or per-item files), from which study/report.py rebuilds RESULTS.md in a fresh
clone without training anything; and one tarball of the bases the grid pre-trained (their weights without the
optimizer state), so that a later sitting continues the grid on the very same bases (docs/experiment.md,
the amendment of 2026-12-02, has the commands).

    python -m study.records                                  # out/experiment-500 -> study/experiment-500.tar.gz
                                                             # and its bases -> study/experiment-500-bases.tar.gz
    python -m study.records --out OUT --tarball T.tar.gz --bases_tarball B.tar.gz

The tarball is deterministic (members sorted, times and owners zeroed), so the same records give the same bytes.
Paths inside the records are written relative to the project that ran the grid, and the Python interpreter as
`python`, so that the records name no machine.
"""

import argparse
import gzip
import io
import json
import tarfile
from pathlib import Path

import torch

from data.sources import DataError, write_atomic
from lab.checkpoint import NANO_DIR, ROOT, CheckpointError, read_checkpoint
from lab.cli import ArgumentParser, out_file
from study.design import OUT

TARBALL = ROOT / "study" / "experiment-500.tar.gz"
BASES_TARBALL = ROOT / "study" / "experiment-500-bases.tar.gz"
RECORDS = ("grid.json", "lr_search.json", "job.json", "timing.json", "measures.json", "windows.json", "layers.json",
           "metrics.jsonl", "config.json", "diverged.json", "eval.json", "eval-*.json")  # per-item files: too large
BASE_FILES = ("ckpt.pt", "config.json", "eval.json", "metrics.jsonl", "tokenizer.json")  # eval.json: it is finished


def record_files(out: Path) -> list[Path]:
    """Every record file under the grid's folder, sorted."""
    return sorted({p for pattern in RECORDS for p in out.rglob(pattern) if p.is_file()})


def portable(value, root: str):
    """A record's value with paths under root made relative to it and an interpreter's path made `python`."""
    if isinstance(value, dict):
        return {k: portable(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v, root) for v in value]
    if isinstance(value, str) and value.startswith("/"):
        if Path(value).name.startswith("python"):
            return "python"
        return value[len(root):] if value.startswith(root) else value
    return value


def portable_bytes(path: Path, root: str) -> bytes:
    """A record file's bytes with its paths made portable (JSON lines one by one)."""
    if path.suffix == ".jsonl":
        lines = [json.dumps(portable(json.loads(line), root)) for line in path.read_text().splitlines()
                 if line.endswith("}")]  # a line being appended by a running training is left out
        return ("\n".join(lines) + "\n").encode()
    return (json.dumps(portable(json.loads(path.read_text()), root), indent=2) + "\n").encode()


def project_root(out: Path) -> str:
    """The project whose out/ holds the grid's folder, as a prefix of the paths under it."""
    return str(out.resolve().parent.parent) + "/"


def write_tarball(tarball: Path, members: dict[str, bytes]) -> None:
    """A gzipped tarball of the members (name -> bytes) in the order given, times and owners zeroed: the same
    members give the same bytes."""
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    write_atomic(tarball, buffer.getvalue())


def pack(out: Path, tarball: Path) -> int:
    """Write the records of the grid folder `out` to `tarball`; returns how many files it holds."""
    root = project_root(out)
    files = record_files(out)
    write_tarball(tarball, {f"{out.name}/{path.relative_to(out).as_posix()}": portable_bytes(path, root)
                            for path in files})
    return len(files)


def built_bases(out: Path) -> list[Path]:
    """The folders of the bases this project pre-trained for the grid (the study base, the embedded one) that are
    finished; a base the grid was given from elsewhere (a Pythia, a folder of the user's) is not the grid's to keep."""
    root = Path(project_root(out))
    named = json.loads((out / "grid.json").read_text()).get("bases", {}).values()
    folders = [NANO_DIR.relative_to(ROOT) if b == "nano" else Path(b) for b in named]
    folders = [f if f.is_absolute() else root / f for f in folders]
    return [f for f in folders if f.resolve().is_relative_to(root / "out") and (f / "eval.json").is_file()]


def base_bytes(folder: Path, name: str, root: str) -> bytes:
    """One file of a base's folder as kept: the checkpoint without its optimizer state (a finished base is only
    read), the JSON records with their paths made portable, the tokenizer as it is."""
    path = folder / name
    if name == "ckpt.pt":
        buffer = io.BytesIO()
        torch.save({**read_checkpoint(folder), "optimizer": None}, buffer)
        return buffer.getvalue()
    return path.read_bytes() if name == "tokenizer.json" else portable_bytes(path, root)


def pack_bases(out: Path, tarball: Path) -> list[str]:
    """Write the grid's finished bases to `tarball` as out/ holds them (`study-base/ckpt.pt`, ...); returns their
    folder names."""
    root, folders = project_root(out), built_bases(out)
    write_tarball(tarball, {f"{f.name}/{name}": base_bytes(f, name, root) for f in folders for name in BASE_FILES
                            if (f / name).is_file()})
    return [f.name for f in folders]


def unpack(tarball: Path, into: Path) -> Path:
    """Extract a records tarball into a folder; returns the grid's folder inside it."""
    with tarfile.open(tarball) as tar:
        names = tar.getnames()
        tar.extractall(into, filter="data")
    return into / names[0].split("/")[0]


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m study.records", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(OUT), help="the grid's folder")
    p.add_argument("--tarball", type=out_file, default=str(TARBALL), help="the records' tarball")
    p.add_argument("--bases_tarball", type=out_file, default=str(BASES_TARBALL), help="the bases' tarball")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = get_args(argv)
    out = Path(args.out)
    if not (out / "grid.json").is_file():
        raise SystemExit(f"error: {out} holds no grid (no grid.json); run `python -m study.grid` first")
    try:
        n = pack(out, Path(args.tarball))
        bases = pack_bases(out, Path(args.bases_tarball))
    except (DataError, CheckpointError, json.JSONDecodeError) as e:
        raise SystemExit(f"error: {e}")
    print(f"wrote {n} record files of {out} to {args.tarball}")
    print(f"wrote the bases {', '.join(bases) or '(none finished)'} to {args.bases_tarball}")


if __name__ == "__main__":
    main()
