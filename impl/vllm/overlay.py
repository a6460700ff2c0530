"""A vLLM release with a patch applied, as a tree kvcheck runs like a checkout.

``vllm@0.33.0+findings/fixes/sink-reserves-blocks.diff`` is the installed
release with that unified diff applied: a folder of symlinks to the release's
files in which only the files the diff touches are real, patched copies
(``patch -p1``; paths in the diff start with ``vllm/``). It is built once per
(release, diff contents) under ``.vllm/trees/`` and then run as a source
checkout (``vllm@PATH``). This is how a fix kept as a small diff is checked:
fuzz the patched tree, replay the findings on it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from impl.target import Unsupported

from . import compat

_TOUCHED = re.compile(r"^\+\+\+ b/(\S+)", re.M)


def touched_files(diff_text: str) -> list[str]:
    """The files a unified diff changes (``+++ b/PATH``), relative to the tree."""
    return sorted(set(_TOUCHED.findall(diff_text)))


def overlay_tree(release: str, diff: Path) -> Path:
    """The tree of ``release`` with ``diff`` applied (built on first use)."""
    try:
        text = diff.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise Unsupported(f"cannot read the patch {diff}: {e}") from None
    files = touched_files(text)
    if not files or any(not f.startswith("vllm/") or ".." in f for f in files):
        raise Unsupported(f"{diff}: not a unified diff of files under vllm/ "
                          f"(+++ b/vllm/... lines)")
    # the links name the release's real folder, not a path through this
    # checkout (a tree outlives the checkout that built it)
    base = compat.install_dir(release).resolve()
    if not (base / "vllm" / "__init__.py").is_file():
        raise Unsupported(f"vllm {release} is not installed; run: "
                          f"{compat.install_command(release)}")
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    dest = compat.REPO / ".vllm" / "trees" / f"{release}-{diff.stem}-{digest}"
    if (dest / "vllm" / "__init__.py").exists():
        return dest
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copytree(base / "vllm", tmp / "vllm", copy_function=os.symlink,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for f in files:
        p = tmp / f
        if not p.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
            raise Unsupported(f"{diff}: {f} is not a file of vllm {release}")
        real = p.resolve()
        p.unlink()
        shutil.copyfile(real, p)
    r = subprocess.run(["patch", "-p1", "--batch", "--forward", "--silent", "-d", str(tmp),
                        "-i", str(diff.resolve())], capture_output=True, text=True)
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        why = " ".join((r.stdout + r.stderr).split())[:200]
        raise Unsupported(f"{diff} does not apply to vllm {release}: {why}")
    for leftover in tmp.rglob("*.orig"):
        leftover.unlink()
    try:
        tmp.rename(dest)
    except OSError:  # another process built it meanwhile, or a stale tree is there
        if (dest / "vllm" / "__init__.py").exists():
            shutil.rmtree(tmp, ignore_errors=True)
        else:  # its links lead into a folder that is gone: replace it
            stale = dest.with_name(dest.name + f".stale{os.getpid()}")
            dest.rename(stale)
            tmp.rename(dest)
            shutil.rmtree(stale, ignore_errors=True)
    return dest
