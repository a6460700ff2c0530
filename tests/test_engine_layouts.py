"""The block sizes vLLM's engine builds (impl/vllm/layouts.py): the kept table
is what vLLM's own padding returns, ``--block-size engine`` draws only those,
and a trace's layout is said to be one no published model builds where it
is."""

import subprocess
import sys
from pathlib import Path

from hypothesis import HealthCheck, find, given, settings

from impl.vllm import layouts
from model.events import Config, Group
from properties.machine import FuzzSpec, config_strategy

ROOT = Path(__file__).resolve().parent.parent
ENGINE = (layouts.attention_block_size(), layouts.hybrid_block_sizes())


def test_the_kept_block_sizes_are_what_vllm_pads_the_families_to():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "engine_layouts.py"),
                        "--release", "0.33.0", "--check"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    fam = layouts.table()["families"]
    # Qwen3-Next's GDN state fills 544 tokens of its attention page at TP 1,
    # half as many where TP 4 splits the state but not the two KV heads
    assert fam["qwen3-next"]["1"] == 544 and fam["qwen3-next"]["4"] == 272
    assert set(fam["jamba"].values()) == {80}


def test_a_layout_is_named_where_no_published_model_builds_it():
    hybrid = (Group("full"), Group("mamba"))
    assert layouts.note(Config(groups=hybrid, block_size=544)) is None
    assert layouts.note(Config(groups=hybrid, block_size=80)) is None
    small = layouts.note(Config(groups=hybrid, block_size=16))
    assert small and "16 tokens beside a Mamba state" in small and "544" in small
    assert layouts.note(Config(groups=(Group("full"),), block_size=16)) is None
    assert "blocks of 4 tokens" in layouts.note(Config(groups=(Group("sliding", 8),),
                                                       block_size=4))
    # a drafter's layer does not make a pure Mamba model a hybrid
    drafted = Config(groups=(Group("mamba"), Group("full", draft=True)), block_size=16,
                     spec_tokens=2, drafter="mtp", prefix_caching=True)
    assert layouts.note(drafted) is None


SPEC = FuzzSpec(target="vllm@0.33.0", kind="hybrid", layout="engine", engine_blocks=ENGINE,
                external=False, prefix_caching=True)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(config_strategy(SPEC))
def test_engine_layouts_draw_only_what_the_engine_builds(cfg):
    assert layouts.note(cfg) is None, cfg.label()


def test_engine_layouts_reach_a_padded_mamba_hybrid():
    cfg = find(config_strategy(SPEC), lambda c: any(g.kind == "mamba" for g in c.groups),
               settings=settings(max_examples=500, database=None))
    assert cfg.block_size in ENGINE[1] and cfg.block_size >= 80


def test_engine_block_sizes_need_an_engine():
    p = subprocess.run([sys.executable, str(ROOT / "kvcheck"), "fuzz", "--target", "reference",
                        "--block-size", "engine", "--examples", "5"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "has no engine" in p.stderr, p.stdout + p.stderr
    assert "Traceback" not in p.stderr


def test_every_saved_vllm_trace_says_whether_a_published_model_builds_its_layout():
    from impl.target import layout_note
    from model.events import Trace

    paths = [*ROOT.glob("traces/vllm/*.json"), *ROOT.glob("findings/[0-9]*/*.json"),
             *ROOT.glob("findings/fixes/*.json")]
    assert len(paths) > 40
    wrong, noted = [], 0
    for p in paths:
        t = Trace.load(p)
        note = layout_note(t.meta.get("target", "vllm"), t.config)
        noted += note is not None
        if t.meta.get("layout") != note:
            wrong.append(f"{p.relative_to(ROOT)}: {t.meta.get('layout')!r}, not {note!r}")
    assert not wrong, "\n".join(wrong)
    assert 0 < noted < len(paths)  # some traces are at sizes the engine builds
