"""The handshake's shared pieces (``backend.protocol``), no model: proofs, nonces, the secret, the messages.

The proofs must depend on the role, both nonces and the secret (RFC 5802's ClientProof/ServerSignature split:
one side's proof never serves as the other's); a secret is read from a file (whitespace trimmed) or the
environment and refused when short; the new messages survive the framing and an older Hello still decodes.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec
import pytest

from backend import protocol as P


def test_proof_is_hmac_sha256_over_role_and_both_nonces():
    k, a, b = b"k" * 32, P.new_nonce(), P.new_nonce()
    assert a != b and len(a) == len(b) == P.NONCE_BYTES
    # RFC 2104 HMAC with SHA-256, over the documented message
    assert P.proof_of("gateway", k, a, b) == hmac.new(k, b"gateway\0" + a + b, hashlib.sha256).digest()
    assert P.proof_matches(P.proof_of("gateway", k, a, b), "gateway", k, a, b)
    assert P.proof_matches(P.proof_of("backend", k, a, b), "backend", k, a, b)


@pytest.mark.parametrize(
    "change",
    [
        "role",
        "swapped nonces",
        "other client nonce",
        "other secret",
        "empty proof",
        "short nonce",
        "truncated",
    ],
)
def test_proof_of_anything_else_does_not_match(change):
    k, a, b = b"k" * 32, P.new_nonce(), P.new_nonce()
    proof = P.proof_of("gateway", k, a, b)
    role, key, ca, sb = "gateway", k, a, b
    if change == "role":
        role = "backend"
    elif change == "swapped nonces":
        ca, sb = b, a
    elif change == "other client nonce":
        ca = P.new_nonce()
    elif change == "other secret":
        key = b"j" * 32
    elif change == "empty proof":
        proof = b""
    elif change == "short nonce":
        ca = a[:-1]
    elif change == "truncated":
        proof = proof[:16]
    assert not P.proof_matches(proof, role, key, ca, sb)


def test_proof_refuses_nonces_of_another_length():
    with pytest.raises(P.AuthenticationFailed):
        P.proof_of("gateway", b"k" * 32, b"", P.new_nonce())


def test_load_secret_from_file_env_or_none(tmp_path):
    f = tmp_path / "s"
    f.write_bytes(b"  0123456789abcdef0123\n")
    assert P.load_secret(str(f), {}) == b"0123456789abcdef0123"
    assert P.load_secret(None, {P.SECRET_ENV: "fedcba9876543210 "}) == b"fedcba9876543210"
    assert P.load_secret(str(f), {P.SECRET_ENV: "fedcba9876543210"}) == b"0123456789abcdef0123"  # file first
    assert P.load_secret(None, {}) is None and P.load_secret(None, {P.SECRET_ENV: ""}) is None
    with pytest.raises(ValueError, match="cannot read the secret file .*missing"):
        P.load_secret(str(tmp_path / "missing"), {})
    f.write_text("short\n")
    with pytest.raises(ValueError, match=f"holds 5 bytes; a secret needs at least {P.MIN_SECRET_BYTES}"):
        P.load_secret(str(f), {})
    with pytest.raises(ValueError, match=P.SECRET_ENV):
        P.load_secret(None, {P.SECRET_ENV: "x"})


def test_handshake_messages_round_trip_and_an_old_hello_decodes():
    nonce = P.new_nonce()
    frames = P.encode_frame(P.Hello(nonce=nonce)) + P.encode_frame(P.Proof(proof=b"p" * 32))
    hello, proof = P.to_backend_decoder().feed(frames)
    assert hello.nonce == nonce and hello.version == P.PROTOCOL_VERSION == 2 and proof.proof == b"p" * 32
    (challenge,) = P.from_backend_decoder().feed(P.encode_frame(P.Challenge(nonce=nonce)))
    assert challenge == P.Challenge(nonce=nonce)
    old = msgspec.msgpack.encode({"type": "hello", "version": 1, "client": "gateway"})  # no nonce field
    hello = msgspec.msgpack.Decoder(P.Handshake).decode(old)
    assert hello.version == 1 and hello.nonce == b""
