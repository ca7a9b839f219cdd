"""Cluster shared secret on the KV handshake: a mutual HMAC challenge-response, shared
by every transport (TCP and UCX carry the same frames through it).

    D (receiver, secret s)                         P (sender, secret s)
    nonce_d = 32 random bytes
      -- CHALLENGE  nonce_d ---------------------->
                                                   nonce_p = 32 random bytes
      <-- HANDSHAKE {layout, epoch, nonce_p,
                     auth: HMAC-SHA256(s, "pdserve-kv prefill" | nonce_d | nonce_p)} --
    check P's proof; wrong or missing:
      -- HANDSHAKE_ACK {error: "cluster secret mismatch"} --> and close
                                                   (P raises KVAuthError)
      -- HANDSHAKE_ACK {layout, epoch, error,
                        auth: HMAC-SHA256(s, "pdserve-kv decode" | nonce_d | nonce_p)} -->
                                                   check D's proof; wrong or missing:
                                                   KVAuthError, close

The secret itself never crosses the wire. Fresh nonces on both ends make every proof
good for one connection only (no replay), and the role label in each MAC keeps a proof
from being reflected back. Without a secret on either end both proofs are null and
pairing goes on as before; a side with a secret refuses a peer without one, and a
side without one refuses a peer that presents a proof (the cluster is misconfigured
either way).

What this does not do: encrypt the KV or authenticate the frames after pairing. It
keeps strangers (a port scan, a process of another cluster on the same network) from
pairing with a KV port and writing into its cache; an attacker on the path between
two workers still needs the network itself to be trusted (or a tunnel).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from .base import KVAuthError
from .frames import AUTH_REFUSED, NONCE_BYTES

PREFILL = b"pdserve-kv prefill"  # label of P's proof
DECODE = b"pdserve-kv decode"  # label of D's proof


def secret_bytes(secret: str | None) -> bytes | None:
    """The cluster secret as HMAC key bytes; None for no secret. ValueError for an empty
    or non-str secret (the message never contains the secret)."""
    if secret is None:
        return None
    if not isinstance(secret, str) or not secret:
        raise ValueError("KV secret must be a non-empty str (or None for no secret)")
    return secret.encode("utf-8")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(key: bytes | None, role: bytes, nonce_d: bytes, nonce_p: bytes) -> bytes | None:
    """HMAC-SHA256(key, role | nonce_d | nonce_p), 32 bytes; None without a key."""
    if key is None:
        return None
    return hmac.new(key, role + nonce_d + nonce_p, hashlib.sha256).digest()


def verify(key: bytes | None, role: bytes, nonce_d: bytes, nonce_p: bytes,
           answer: bytes | None) -> bool:
    """True when ``answer`` is the peer's right proof for ``role``, or when neither this
    side has a key nor the peer sent a proof. Constant-time comparison."""
    expected = proof(key, role, nonce_d, nonce_p)
    if expected is None or answer is None:
        return expected is None and answer is None
    return hmac.compare_digest(expected, answer)


def refused(addr: tuple[str, int], why: str = "") -> KVAuthError:
    """The sender's error for a handshake that failed on the secret, on either end."""
    return KVAuthError(f"KV handshake refused by {addr[0]}:{addr[1]}: {AUTH_REFUSED}{why}")


def check_ack(key: bytes | None, addr: tuple[str, int], nonce_d: bytes, nonce_p: bytes,
              error: str | None, answer: bytes | None) -> None:
    """On P, after reading D's ack: raise KVAuthError if D refused P's proof, or if D's
    own proof is wrong or missing (D without the secret, or not a decode worker of this
    cluster)."""
    if error == AUTH_REFUSED:
        raise refused(addr)
    if not verify(key, DECODE, nonce_d, nonce_p, answer):
        why = ("decode worker proved no cluster secret" if answer is None else
               "decode worker has a cluster secret, this prefill worker none" if key is None
               else "decode worker's proof is wrong")
        raise refused(addr, f" ({why})")
