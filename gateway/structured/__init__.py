"""Structured output: request fields -> ``backend.protocol.Grammar`` (``formats``), checked before any byte
is sent (``checker``). The backend enforces the grammar with token masks (``backend.grammar``)."""
