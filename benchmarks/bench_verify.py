"""Time, CPU and peak memory of ``k3ft verify`` on a large bundle archive.

    .venv/bin/python benchmarks/bench_verify.py [--size-mib 1024] [--workdir DIR]
        [--code SRC_TREE ...]

Builds (once per ``--workdir``) a signed bundle: the small test evidence of
``tests/bundle_support.py`` plus one covered file of ``--size-mib`` MiB of hex text (compresses
about 2:1, as raw logs do), packs it with ``write_archive``, then runs ``k3ft verify`` on the
archive in a child process per ``--code`` tree (default: this checkout) so two versions of the
verifier can be compared on the same bytes. Peak memory is the child's max RSS.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def build(workdir: Path, size_mib: int) -> tuple[Path, Path]:
    """The archive and allowed_signers file (built unless already in ``workdir``)."""
    archive = workdir / f"bundle-{size_mib}m.tar.gz"
    signers = workdir / f"keys-{size_mib}m" / "allowed"
    if archive.is_file() and signers.is_file():
        return archive, signers
    sys.path.insert(0, str(ROOT / "tests"))
    from bundle_support import GIT_COMMIT, PROFILE, make_key, write_evidence

    from k3fasttrack.bundle import sign_bundle, write_archive

    key = make_key(signers.parent)
    folder = workdir / f"bundle-{size_mib}m"
    write_evidence(folder)
    blob = folder / "raw" / "blob.txt"
    blob.parent.mkdir(parents=True, exist_ok=True)
    with blob.open("wb") as fh:
        for _ in range(size_mib * 2):
            fh.write(os.urandom(256 * 1024).hex().encode())
    sign_bundle(folder, key.private, profile=PROFILE, verdict="FAIL", git_commit=GIT_COMMIT)
    started = time.perf_counter()
    write_archive(folder, archive)
    print(f"packed {archive.stat().st_size / MIB:.0f} MiB archive in "
          f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    key.allowed_signers.replace(signers)
    return archive, signers


def measure(code: Path, archive: Path, signers: Path) -> dict[str, float | str]:
    """Wall and CPU seconds and peak RSS of one ``k3ft verify``."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    started = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "k3fasttrack", "verify", str(archive), "--allowed-signers",
         str(signers)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _pid, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    last = child.stderr.read().decode().strip().splitlines()[-1:] if child.stderr else []
    return {"exit": os.waitstatus_to_exitcode(status), "wall_s": wall,
            "cpu_s": usage.ru_utime + usage.ru_stime, "rss_mib": usage.ru_maxrss / 1024,
            "said": (last or [""])[0][:100]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--code", type=Path, action="append",
                        help="source tree holding the k3fasttrack package to time (repeatable)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="k3ft-bench-verify-"))
    workdir.mkdir(parents=True, exist_ok=True)
    archive, signers = build(workdir, args.size_mib)
    print(f"k3ft verify, {args.size_mib} MiB bundle ({archive.stat().st_size / MIB:.0f} MiB "
          "archive)")
    for code in args.code or [ROOT]:
        result = measure(code.resolve(), archive, signers)
        print(f"{str(code):<28} exit {result['exit']}  wall {result['wall_s']:6.1f} s  "
              f"cpu {result['cpu_s']:6.1f} s  peak rss {result['rss_mib']:5.0f} MiB  "
              f"| {result['said']}")


if __name__ == "__main__":
    main()
