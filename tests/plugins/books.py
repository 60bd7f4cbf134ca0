"""``NullBook``: a usage book (``ratelimit.admission``'s ledger side) that bills nowhere and has billed nothing,
for tests that check limits, not the ledger."""

from __future__ import annotations


class NullBook:
    def record(self, row: dict[str, object]) -> None:
        pass

    async def tokens_on_day(
        self, *, tenant_id: str | None = None, key_id: str | None = None, day: str
    ) -> int:
        return 0
