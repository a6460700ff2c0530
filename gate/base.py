"""The base a gate compares its target with, and the lines that differ.

Default base (``gate --base`` omitted):

* a release (``vllm@0.33.0``): itself; nothing can be introduced, the gate
  lists what the release shows;
* a release with fixes (``vllm@0.33.0+findings/NN-NAME/fix.diff``): the release;
* a checkout with git history whose branch tracks another: their merge-base,
  taken out of the checkout's git (``git archive``: the checkout itself is
  never touched) into ``.vllm/bases/<commit>/`` and laid over the same
  release as the checkout;
* any other checkout: the release it is laid over.

The changed lines are a comparison of the two trees' files under ``vllm/``
(a tree without ``.git`` works too).
"""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASES = ROOT / ".vllm" / "bases"
# the folders of vllm/ whose changes the rows can execute: the scheduler, the
# KV-cache managers and block pool, requests, the KV connectors, the configs
WATCHED = ("v1/core", "v1/request.py", "v1/kv_cache_interface.py", "v1/outputs.py",
           "v1/engine/core.py", "v1/simple_kv_offload", "distributed/kv_transfer", "config")


@dataclass
class Base:
    target: str  # a target name, as --target takes it
    why: str  # how it was chosen, for the first line
    same: bool = False  # the very tree of the target: nothing can be introduced
    release: str | None = None  # the vLLM release under it (findings' fixes apply there)


@dataclass
class Changes:
    files: dict[str, list[int]] = field(default_factory=dict)  # vllm/REL -> target lines

    @property
    def lines(self) -> int:
        return sum(len(v) for v in self.files.values())

    def text(self) -> str:
        if not self.files:
            return "no line differs from the base under vllm/"
        names = ", ".join(sorted(self.files)[:4]) + (" ..." if len(self.files) > 4 else "")
        n, m = self.lines, len(self.files)
        return (f"{n} changed line{'s' * (n != 1)} in {m} file{'s' * (m != 1)} under vllm/ "
                f"({names})")


def _engine(target: str) -> str:
    return target.partition("@")[0]


def release_of(target: str) -> str | None:
    """The vLLM release a target runs on: the release itself, the release a
    patched one starts from, the release a checkout is laid over."""
    if not target.startswith("vllm@"):
        return None
    from impl.vllm import compat, resolve

    spec = target[len("vllm@"):]
    release = spec.partition("+")[0]
    if compat.parse_release(release) is not None:
        return release
    inst = resolve(spec)
    return inst.path[-1].name if len(inst.path) > 1 else None


def _tree_of(target: str) -> Path | None:
    """The vllm/ package a vLLM target imports (None for other engines)."""
    if not target.startswith("vllm@"):
        return None
    from impl.vllm import resolve

    return resolve(target[len("vllm@"):]).pkg


def same_tree(a: str, b: str) -> bool:
    if a.strip() == b.strip():
        return True
    if _engine(a) != _engine(b) or _engine(a) != "vllm":
        return False
    ta, tb = _tree_of(a), _tree_of(b)
    return ta is not None and tb is not None and ta.resolve() == tb.resolve()


def default_base(target: str) -> Base:
    if not target.startswith("vllm@"):
        return Base(target, "the target itself", same=True)
    from impl.vllm import compat

    spec = target[len("vllm@"):]
    release, plus, _ = spec.partition("+")
    if compat.parse_release(release) is not None:
        if not plus:
            return Base(target, "the release itself: nothing can be introduced", True, release)
        return Base(f"vllm@{release}", "the release the diffs apply to", False, release)
    laid = release_of(target)
    tree = Path(spec).expanduser().resolve()
    if tree.name == "vllm" and (tree / "__init__.py").is_file():
        tree = tree.parent
    mb = merge_base(tree)
    if mb is not None:
        commit, upstream = mb
        folder = archive_tree(tree, commit, laid)
        if folder is not None:
            return Base(f"vllm@{folder}", f"merge-base {commit[:12]} with {upstream}",
                        False, laid)
    return Base(f"vllm@{laid}", "the release the checkout is laid over", False, laid)


def given_base(target: str, base: str) -> Base:
    from impl.target import make_target

    make_target(base)  # a base that is not a target: one line, exit 2 / 3
    if _engine(base) != _engine(target):
        from impl.target import Unsupported

        raise Unsupported(f"--base {base}: not the engine of --target {target}")
    same = same_tree(target, base)
    why = "given" + (": the target's own tree, nothing can be introduced" if same else "")
    return Base(base, why, same, release_of(base) if base.startswith("vllm@") else None)


def _git(tree: Path, *args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def merge_base(tree: Path) -> tuple[str, str] | None:
    """(commit, upstream) of a checkout whose branch tracks another, else None."""
    if not (tree / ".git").exists():
        return None
    upstream = _git(tree, "rev-parse", "--abbrev-ref", "--symbolic-full-name", "@{upstream}")
    if not upstream:
        return None
    commit = _git(tree, "merge-base", "HEAD", upstream)
    head = _git(tree, "rev-parse", "HEAD")
    if not commit:
        return None
    if commit == head and not _git(tree, "status", "--porcelain", "--", "vllm"):
        return None  # the checkout is its merge-base: compare with the release instead
    return commit, upstream


def archive_tree(tree: Path, commit: str, release: str | None) -> Path | None:
    """``commit``'s ``vllm/`` out of ``tree``'s git into ``.vllm/bases/``
    (once per commit), its release line written beside it so that it is laid
    over the same release as the checkout."""
    dest = BASES / commit[:16]
    if (dest / "vllm" / "__init__.py").is_file():
        return dest
    BASES.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=BASES))
    try:
        with tempfile.TemporaryFile() as f:
            r = subprocess.run(["git", "-C", str(tree), "archive", "--format=tar", commit,
                                "vllm"], stdout=f, stderr=subprocess.PIPE, timeout=120)
            if r.returncode != 0:
                return None
            f.seek(0)
            with tarfile.open(fileobj=f) as tar:
                tar.extractall(tmp, filter="data")
        if release and not (tmp / "vllm" / "_version.py").exists():
            (tmp / "vllm" / "_version.py").write_text(f'__version__ = "{release}"\n')
        os.replace(tmp, dest)
    except (OSError, subprocess.SubprocessError, tarfile.TarError):
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest if (dest / "vllm" / "__init__.py").is_file() else None


def _files(pkg: Path) -> dict[str, Path]:
    out = {}
    for w in WATCHED:
        p = pkg / w
        if p.is_file():
            out[f"vllm/{w}"] = p
        elif p.is_dir():
            for f in p.rglob("*.py"):
                out[f"vllm/{f.relative_to(pkg)}"] = f
    return out


def changed_lines(target: str, base: str) -> Changes:
    """The lines of the target's files (under :data:`WATCHED`) that are not in
    the base's: added or edited lines that can run (blank and comment lines
    left out), by target line number (a deletion counts the first such line
    after it)."""
    ta, tb = _tree_of(target), _tree_of(base)
    out = Changes()
    if ta is None or tb is None:
        return out
    fa, fb = _files(ta), _files(tb)
    for rel, pa in sorted(fa.items()):
        pb = fb.get(rel)
        try:
            if pb is not None and (pa.resolve() == pb.resolve()
                                   or pa.read_bytes() == pb.read_bytes()):
                continue
            a = pa.read_text(errors="replace").splitlines()
            b = pb.read_text(errors="replace").splitlines() if pb is not None else []
        except OSError:
            continue
        def code(n: int, a: list[str] = a) -> bool:  # a line that can run (code)
            text = a[n - 1].strip() if 0 < n <= len(a) else ""
            return bool(text) and not text.startswith("#")

        lines: set[int] = set()
        for tag, _i1, _i2, j1, j2 in difflib.SequenceMatcher(None, b, a, autojunk=False) \
                .get_opcodes():
            if tag in ("replace", "insert"):
                lines.update(n for n in range(j1 + 1, j2 + 1) if code(n))
            elif tag == "delete":  # the first line that runs after it
                n = j1 + 1
                while n < len(a) and not code(n):
                    n += 1
                lines.add(min(n, max(1, len(a))))
        if lines:
            out.files[rel] = sorted(lines)
    return out
