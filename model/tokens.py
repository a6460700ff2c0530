"""The token stream every target feeds its requests (docs/SEMANTICS.md).

Every request's prompt is the same stream, :func:`prompt_token`, and every
generated token is :data:`OUTPUT_TOKEN`. So two requests hold the same
tokens up to position ``q`` exactly when both are still in their prompts
there, or when their prompts have the same length: :func:`prefix_key` names
that token prefix, and the KV of position ``q`` is valid for a request only
if it was computed for the request's own key. (No prompt token equals
``OUTPUT_TOKEN`` below position 5,000, which the tests pin.)

    request A, prompt 5:  p0 p1 p2 p3 p4 o  o  o
    request B, prompt 7:  p0 p1 p2 p3 p4 p5 p6 o
                          |- same keys -|  differ from position 5 on
"""

from __future__ import annotations

OUTPUT_TOKEN = 7  # every generated token
DRAFT_TOKEN = 9  # a draft proposed at depth 1 (async drafts are vLLM's placeholders)

Key = int | tuple[int, int]


def prompt_token(t: int) -> int:
    """The prompt token at position ``t``: the same for every request, so
    prefix caching hits across requests."""
    return (t * 7919 + 17) % 32000


def prefix_key(prompt_len: int, q: int) -> Key:
    """Names the tokens ``[0, q]`` of a request with ``prompt_len`` prompt
    tokens: equal keys, equal token prefixes."""
    return q if q < prompt_len else (prompt_len, q)


def key_position(key: Key) -> int:
    """The position a key names."""
    return key if isinstance(key, int) else key[1]


def describe_key(key: Key | tuple[str, int]) -> str:
    if isinstance(key, int):
        return f"prompt position {key}"
    if key[0] == "sink":
        return f"sink token {key[1]}"
    return f"position {key[1]} of a {key[0]}-token prompt and its outputs"
