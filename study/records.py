"""
The experiment's run records as the repository keeps them: one tarball of every record file of the grid's folder
(no checkpoints, tokenizers, logs or per-item files), from which study/report.py rebuilds RESULTS.md in a fresh
clone without training anything.

    python -m study.records                                  # out/experiment-500 -> study/experiment-500.tar.gz
    python -m study.records --out OUT --tarball T.tar.gz

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

from data.sources import DataError, write_atomic
from lab.checkpoint import ROOT
from lab.cli import ArgumentParser, out_file
from study.design import OUT

TARBALL = ROOT / "study" / "experiment-500.tar.gz"
RECORDS = ("grid.json", "lr_search.json", "job.json", "timing.json", "measures.json", "windows.json", "layers.json",
           "metrics.jsonl", "config.json", "diverged.json", "eval-*.json")  # per-item files are left out: too large


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


def pack(out: Path, tarball: Path) -> int:
    """Write the records of the grid folder `out` to `tarball`; returns how many files it holds."""
    root = str(out.resolve().parent.parent) + "/"  # the project whose out/ holds the grid's folder
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        files = record_files(out)
        for path in files:
            data = portable_bytes(path, root)
            info = tarfile.TarInfo(f"{out.name}/{path.relative_to(out).as_posix()}")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    write_atomic(tarball, buffer.getvalue())
    return len(files)


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
    p.add_argument("--tarball", type=out_file, default=str(TARBALL), help="the file written")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = get_args(argv)
    out = Path(args.out)
    if not (out / "grid.json").is_file():
        raise SystemExit(f"error: {out} holds no grid (no grid.json); run `python -m study.grid` first")
    try:
        n = pack(out, Path(args.tarball))
    except (DataError, json.JSONDecodeError) as e:
        raise SystemExit(f"error: {e}")
    print(f"wrote {n} record files of {out} to {args.tarball}")


if __name__ == "__main__":
    main()
