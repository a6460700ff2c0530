"""A vLLM release with a patch applied, as a tree kvcheck runs like a checkout.

``vllm@0.33.0+findings/fixes/sink-reserves-blocks.diff`` is the installed
release with that unified diff applied: a folder of symlinks to the release's
files in which only the files the diff touches are real, patched copies
(``patch -p1``; paths in the diff start with ``vllm/``). It is built once per
(release, diff contents) under ``.vllm/trees/`` and then run as a source
checkout (``vllm@PATH``). This is how a fix kept as a small diff is checked:
fuzz the patched tree, replay the findings on it.

A series, ``vllm@0.33.0+A.diff+B.diff``, applies its diffs in turn. A diff
written against the release (every finding's ``fix.diff``) is merged into
the tree the ones before it left, file by file, as a three-way merge with the
release as the common base (``git merge-file``): fixes of different findings
in one function compose as long as they change different lines. A diff that
does not apply to the release (one written on top of the diffs before it)
is applied to that tree as it is. Changes that overlap are refused with the
names of both sides: fixes are kept as diffs, never as hand-merged copies.
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


def series(patches: str) -> list[str]:
    """The diffs of ``A.diff+B.diff`` in order (a ``+`` inside a name that
    does not end a ``.diff`` or ``.patch`` stays in the name)."""
    out, part = [], ""
    for piece in patches.split("+"):
        part = f"{part}+{piece}" if part else piece
        if part.endswith((".diff", ".patch")):
            out.append(part)
            part = ""
    if part:
        out.append(part)
    return out


def overlay_tree(release: str, diff: Path | list[Path]) -> Path:
    """The tree of ``release`` with ``diff`` applied, or a series of diffs in
    turn (built on first use). ``release`` may also be a checkout's folder
    (holding ``vllm/``): its files then, run as that checkout is, over the
    release of its line (a finding's fix tried on a pull request's tree)."""
    diffs = list(diff) if isinstance(diff, list | tuple) else [diff]
    if not diffs:
        raise Unsupported(f"vllm {release}+: no diff named")
    texts = []
    for d in diffs:
        try:
            text = d.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise Unsupported(f"cannot read the patch {d}: {e}") from None
        files = touched_files(text)
        if not files or any(not f.startswith("vllm/") or ".." in f for f in files):
            raise Unsupported(f"{d}: not a unified diff of files under vllm/ "
                              f"(+++ b/vllm/... lines)")
        texts.append(text)
    # the links name the release's real folder, not a path through this
    # checkout (a tree outlives the checkout that built it)
    if compat.parse_release(release) is not None:
        base = compat.install_dir(release).resolve()
        if not (base / "vllm" / "__init__.py").is_file():
            raise Unsupported(f"vllm {release} is not installed; run: "
                              f"{compat.install_command(release)}")
        name = release
    else:
        base = Path(release).expanduser().resolve()
        base = base.parent if base.name == "vllm" else base
        if not (base / "vllm" / "__init__.py").is_file():
            raise Unsupported(f"{release}: no vllm/ package there")
        name = "tree-" + hashlib.sha256(str(base).encode()).hexdigest()[:8]
    digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()[:12]
    stems = "-".join(_stem(d) for d in diffs)[:100]
    dest = compat.REPO / ".vllm" / "trees" / f"{name}-{stems}-{digest}"
    if (dest / "vllm" / "__init__.py").exists():
        return dest
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copytree(base / "vllm", tmp / "vllm", copy_function=os.symlink,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for i, (d, text) in enumerate(zip(diffs, texts, strict=True)):
        after = f" after {', '.join(_stem(x) + '.diff' for x in diffs[:i])}" if i else ""
        files = touched_files(text)
        for f in files:
            p = tmp / f
            if not p.is_symlink():
                if p.is_file():  # a diff before it in the series made it a copy
                    continue
                shutil.rmtree(tmp, ignore_errors=True)
                raise Unsupported(f"{d}: {f} is not a file of vllm {release}")
            real = p.resolve()
            p.unlink()
            shutil.copyfile(real, p)
        alone = _patched(base, d, files) if i else None
        if alone is not None:  # against the release: merged into what is there
            try:
                _merge(tmp, base, alone, files, d, after)
            finally:
                shutil.rmtree(alone, ignore_errors=True)
            continue
        why = _patch(tmp, d)
        if why is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            raise Unsupported(f"{d} does not apply to vllm {release}{after}: {why}")
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


def _patch(tree: Path, diff: Path, fuzz: bool = True) -> str | None:
    """Apply ``diff`` in ``tree``; None, or why not."""
    r = subprocess.run(["patch", "-p1", "--batch", "--forward", "--silent", "-d", str(tree),
                        *(() if fuzz else ("--fuzz=0",)), "-i", str(diff.resolve())],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else " ".join((r.stdout + r.stderr).split())[:200]


def _patched(base: Path, diff: Path, files: list[str]) -> Path | None:
    """A scratch folder with the release's ``files`` and ``diff`` applied to
    them exactly (no fuzz), or None where it is not a diff of the release."""
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="kvcheck-merge-"))
    for f in files:
        (out / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(base / f, out / f)
    if _patch(out, diff, fuzz=False) is not None:
        shutil.rmtree(out, ignore_errors=True)
        return None
    return out


def _merge(tree: Path, base: Path, alone: Path, files: list[str], diff: Path,
           after: str) -> None:
    """Merge the release-relative change of ``diff`` (``alone``) into
    ``tree``, file by file, the release as the common base."""
    for f in files:
        r = subprocess.run(["git", "merge-file", "-p", "-L", "series", "-L", "release",
                            "-L", diff.name, str(tree / f), str(base / f), str(alone / f)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            shutil.rmtree(tree, ignore_errors=True)
            raise Unsupported(f"{diff} changes lines of {f} that the diffs before it "
                              f"change too ({after.strip() or 'the series'}): merge them "
                              f"into one diff or order them")
        (tree / f).write_text(r.stdout)


def _stem(d: Path) -> str:
    """A diff's name in a tree's folder: ``fix`` of a finding's folder is
    named by the folder (``05-mamba-align-.../fix.diff`` -> ``05-mamba-...``)."""
    return d.parent.name if d.stem == "fix" and d.parent.parent.name == "findings" else d.stem
