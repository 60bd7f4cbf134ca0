"""Text fed through an output filter in chunks, as a generation stream feeds it (for the filter tests)."""

from __future__ import annotations

from gateway.filters import OutputFilter


async def feed_in_chunks(of: OutputFilter, text: str, sizes: list[int]) -> tuple[list[str], int]:
    """Feed ``text`` in chunks of ``sizes`` characters (cycled) until it ends or the filter cuts, then flush.

    Returns ``(pieces, max_held)``: what each ``feed`` and the final ``flush`` released, and the most
    characters the filter held back after any feed.
    """
    out, i, k, max_held = [], 0, 0, 0
    while i < len(text) and not of.cut:
        n = sizes[k % len(sizes)]
        k += 1
        out.append(await of.feed(text[i : i + n]))
        i += n
        max_held = max(max_held, of.held)
    out.append(await of.flush())
    return out, max_held
