"""The token streams every target feeds its requests (docs/SEMANTICS.md).

A request's prompt is one of a few *variants* of one stream,
:func:`prompt_token`: variant 0 is the stream itself, variant ``v > 0``
differs from it at position ``v - 1`` only. So variants share every block
after that position token for token, under a different prefix: a prefix
cache that matched a block by its own tokens, not by its whole prefix,
would hand one variant's KV to another. Every generated token is
:data:`OUTPUT_TOKEN`. Two requests hold the same tokens up to position
``q`` exactly when both are still in their prompts there, or when their
prompts have the same length, and their variants agree up to ``q``:
:func:`prefix_key` names that token prefix, and the KV of position ``q`` is
valid for a request only if it was computed for the request's own key. (No
prompt token equals ``OUTPUT_TOKEN`` below position 5,000, which the tests
pin.)

    request A, prompt 5:             p0 p1 p2 p3 p4 o  o  o
    request B, prompt 7:             p0 p1 p2 p3 p4 p5 p6 o
                                     |- same keys -|  differ from position 5 on
    request C, prompt 7, variant 2:  p0 p1'p2 p3 p4 p5 p6 o
                                        |- differs from B from position 1 on,
                                           though p2..p6 are B's tokens
"""

from __future__ import annotations

OUTPUT_TOKEN = 7  # every generated token
DRAFT_TOKEN = 9  # a draft proposed at depth 1 (async drafts are vLLM's placeholders)

Key = int | tuple


MAX_VARIANT = 4  # prompt variants 0..MAX_VARIANT


def prompt_token(t: int, variant: int = 0) -> int:
    """The prompt token at position ``t`` of prompt ``variant``: the same for
    every request of a variant, so prefix caching hits across requests;
    variant ``v > 0`` differs from variant 0 at position ``v - 1`` only."""
    tok = (t * 7919 + 17) % 32000
    if variant and t == variant - 1:
        tok = 32000 + variant  # outside variant 0's range, never OUTPUT_TOKEN
    return tok


def _diverged(variant: int, prompt_len: int, q: int) -> int:
    """The variant that tokens ``[0, q]`` show (0 when they match variant 0's)."""
    d = variant - 1
    return variant if variant and d <= q and d < prompt_len else 0


def prefix_key(prompt_len: int, q: int, variant: int = 0) -> Key:
    """Names the tokens ``[0, q]`` of a request with ``prompt_len`` prompt
    tokens of ``variant``: equal keys, equal token prefixes. Variant 0: ``q``
    inside the prompt, ``(prompt_len, q)`` past it; a variant that differs by
    ``q`` wraps that as ``("v", variant, ...)``."""
    base = q if q < prompt_len else (prompt_len, q)
    v = _diverged(variant, prompt_len, q)
    return ("v", v, base) if v else base


def key_position(key: Key) -> int:
    """The position a key names."""
    if isinstance(key, int):
        return key
    return key_position(key[2]) if len(key) == 3 else key[1]


def describe_key(key: Key | tuple[str, int]) -> str:
    if isinstance(key, int):
        return f"prompt position {key}"
    if key[0] == "sink":
        return f"sink token {key[1]}"
    if key[0] == "v":
        return f"{describe_key(key[2])} of prompt variant {key[1]}"
    return f"position {key[1]} of a {key[0]}-token prompt and its outputs"
