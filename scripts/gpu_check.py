#!/usr/bin/env python3
"""The GPU confirmation, one prepared run: every fixed trace of
traces/attention/ replayed on the reference target and pushed through paged
attention on CUDA (torch, and vLLM's own Triton kernel where vLLM imports),
fp32 and bf16. Prints one table; the whole run stays well under 8 minutes.

    python scripts/gpu_check.py              # on a GPU machine (make gpu-check)
    python scripts/gpu_check.py --cpu-ok     # anywhere: the same run on the CPU

Without a GPU it runs the same check on the CPU and says so; the exit status
is then 3 unless --cpu-ok (the GPU confirmation did not happen).
A trace whose ``meta.target`` names a target (a layout only that target
builds: vLLM's align-mode Mamba) is replayed there, unless --target is
given; that target must be installed (``make vllm VLLM=0.33.0``), or its row
is an ERROR.
Exit status: 0 every trace as expected (counterexamples garbled or NaN, clean
traces clean, vLLM's kernel agreeing with torch), 1 otherwise, 2 bad usage,
3 no GPU (without --cpu-ok).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from confirm.attention import AttentionReport, replay_attention  # noqa: E402
from confirm.attention_kernels import pick_device  # noqa: E402
from impl.target import TargetError, make_target  # noqa: E402
from model.events import Trace, TraceError  # noqa: E402


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.splitlines()[0])
    p.add_argument("--cpu-ok", action="store_true",
                   help="without a GPU, run on the CPU and exit 0 if all is as expected")
    p.add_argument("--traces", default=str(ROOT / "traces" / "attention"),
                   help="folder of trace JSON files (default traces/attention)")
    p.add_argument("--target", default=None,
                   help="replay every trace on this target (default: the trace's meta.target, "
                        "else reference)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "both"), default=None,
                   help="default: both on a GPU, fp32 on the CPU")
    p.add_argument("--head-dim", type=int, default=16,
                   help="head size (vLLM's Triton kernel needs >= 16; default 16)")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--vllm-path", default=None,
                   help="a folder holding an installed vllm package, put first on sys.path")
    p.add_argument("--budget", type=float, default=420.0,
                   help="seconds; traces not started by then are listed as skipped")
    return p.parse_args(argv)


def _verdict(rep: AttentionReport, expect_bad: bool) -> tuple[str, bool]:
    if rep.kernel_failed:
        return "KERNEL ERROR", False
    if rep.kernel_ok is False:
        return "KERNEL DISAGREES", False
    if expect_bad:
        if rep.ok:
            return "MISSED", False
        return ("NaN as expected" if rep.first_bad.kind == "nan" else "garbled as expected"), True
    return ("clean", True) if rep.ok else ("GARBLED", False)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.vllm_path:
        sys.path.insert(0, str(Path(a.vllm_path).resolve()))
    dev = pick_device(None)
    on_gpu = dev.type == "cuda"
    dtypes = (["fp32", "bf16"] if on_gpu else ["fp32"]) if a.dtype is None else (
        ["fp32", "bf16"] if a.dtype == "both" else [a.dtype])
    paths = sorted(Path(a.traces).glob("*.json"))
    if not paths:
        print(f"gpu_check: no traces in {a.traces}", file=sys.stderr)
        return 2
    if on_gpu:
        print(f"gpu_check: CUDA {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    else:
        print(f"gpu_check: no CUDA GPU here (torch {torch.__version__}): running the same check "
              "on the CPU; the GPU confirmation did NOT run")
    t_start = time.perf_counter()
    rows, all_ok, kernels, notes = [], True, set(), set()
    not_run = 0  # rows whose target is not installed here: shown, not counted as passed
    targets: dict[str, object] = {}  # one per target name (a vLLM's worker starts once)
    for path in paths:
        try:
            trace = Trace.load(path)
        except TraceError as e:
            print(f"gpu_check: {e}", file=sys.stderr)
            return 2
        expect_bad = bool(trace.meta.get("expect_violation"))
        for dt in dtypes:
            if time.perf_counter() - t_start > a.budget:
                rows.append((path.stem, dt, "-", "-", "-", "-", "-", "SKIPPED (time budget)", 0.0))
                all_ok = False
                continue
            name = a.target or trace.meta.get("target", "reference")
            try:
                if name not in targets:
                    targets[name] = make_target(name)
            except TargetError as e:  # e.g. vLLM not installed on the GPU machine
                rows.append((path.stem, dt, "-", "-", "-", "-", "-", f"NOT RUN ({name})", 0.0))
                notes.add(f"not run: {e}")
                not_run += 1
                continue
            except Exception as e:  # noqa: BLE001
                rows.append((path.stem, dt, "-", "-", "-", "-", "-",
                             f"ERROR {type(e).__name__}: {e}"[:60], 0.0))
                all_ok = False
                continue
            try:
                rep = replay_attention(trace, targets[name], device=dev, dtype=dt,
                                       heads=a.heads, head_dim=a.head_dim)
            except Exception as e:  # noqa: BLE001 - one broken trace must not hide the rest
                rows.append((path.stem, dt, "-", "-", "-", "-", "-",
                             f"ERROR {type(e).__name__}: {e}"[:60], 0.0))
                all_ok = False
                continue
            kernels.add(rep.kernel)
            if rep.kernel_failed:
                notes.add(f"vLLM kernel failed on {path.stem}: {rep.kernel_failed}")
            elif rep.kernel_note and rep.kernel_max_err is None and on_gpu:
                notes.add(rep.kernel_note)
            verdict, ok = _verdict(rep, expect_bad)
            all_ok &= ok
            fb = rep.first_bad
            first = f"s{fb.step} {fb.rid}@{fb.position} {fb.kind}" if fb else "-"
            kdiff = f"{rep.kernel_max_err:.1e}" if rep.kernel_max_err is not None else "-"
            rows.append((path.stem, dt, "violation" if expect_bad else "clean",
                         f"{rep.max_err:.2e}", str(rep.nan_reads), first, kdiff, verdict,
                         rep.seconds))
    head = ("trace", "dtype", "expect", "max err", "NaN", "first bad", "vLLM diff", "verdict")
    w = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    print()
    print("  ".join(f"{h:<{w[i]}}" for i, h in enumerate(head)) + "       s")
    for r in rows:
        print("  ".join(f"{str(x):<{w[i]}}" for i, x in enumerate(r[:-1])) + f"  {r[-1]:6.1f}")
    total = time.perf_counter() - t_start
    print()
    print(f"device:  {'cuda (' + torch.cuda.get_device_name(dev) + ')' if on_gpu else 'cpu'}")
    for k in sorted(kernels):
        print(f"kernel:  {k}")
    for n in sorted(notes):
        print(f"note:    {n}")
    print(f"traces:  {len(paths)} x {'/'.join(dtypes)} in {total:.1f}s")
    print(f"verdict: {'ALL AS EXPECTED' if all_ok else 'NOT AS EXPECTED'}"
          + (f" ({not_run} row(s) NOT RUN: target not installed)" if not_run else "")
          + ("" if on_gpu else " (on the CPU)"))
    if not all_ok:
        return 1
    if not_run and not_run == len(rows):
        print("gpu_check: no row ran (no trace's target is installed here)", file=sys.stderr)
        return 3
    if not on_gpu and not a.cpu_ok:
        print("gpu_check: no GPU: pass --cpu-ok to accept a CPU-only run", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
