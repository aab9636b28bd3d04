"""The keyed BLAKE2b of the native loops (``memcache_core/native/blake2b.h``) against hashlib's, through
the data loop's exported ``mc_dataloop_mac``: the MAC ``auth.Session`` makes (key, ``seq`` u64 LE, frame)
for many keys, lengths around the 128-byte block, split points and sequence numbers, byte for byte."""

from __future__ import annotations

import hashlib
import random

import pytest

from memcache_core.auth import Session
from memcache_core.transfer import dataloop
from tests.loops import NATIVE_BUILT

pytestmark = pytest.mark.skipif(not NATIVE_BUILT, reason="the C data loop is not built")

LENGTHS = [0, 1, 7, 8, 12, 17, 33, 49, 63, 64, 65, 111, 112, 119, 120, 127, 128, 129, 255, 256, 257,
           383, 384, 385, 1000, 1057, 4096, 65537]


def reference(key: bytes, seq: int, data: bytes, size: int = 16) -> bytes:
    return hashlib.blake2b(seq.to_bytes(8, "little") + data, key=key, digest_size=size).digest()


@pytest.mark.parametrize("keylen", [0, 1, 16, 32, 63, 64])
def test_macs_equal_hashlibs_for_keys_lengths_and_splits(keylen):
    rng = random.Random(keylen)
    lib = dataloop.load()
    assert lib is not None
    for n in LENGTHS:
        key, data = rng.randbytes(keylen), rng.randbytes(n)
        seq = rng.choice([0, 1, 2, 255, 256, (1 << 32) + 5, (1 << 64) - 1, rng.getrandbits(64)])
        for split in sorted({0, n // 2, n, rng.randint(0, n), min(n, 128), min(n, 120)}):
            assert lib.mac(key, seq, data, split) == reference(key, seq, data), (keylen, n, seq, split)


@pytest.mark.parametrize("size", [1, 16, 32, 64])
def test_digest_sizes(size):
    lib = dataloop.load()
    assert lib is not None
    for n in (0, 5, 128, 300):
        data = bytes(range(256))[:n] * 1
        assert lib.mac(b"k" * 32, 9, data, n // 2, size) == reference(b"k" * 32, 9, data, size)


def test_bad_arguments_are_refused():
    lib = dataloop.load()
    assert lib is not None
    with pytest.raises(ValueError):
        lib.mac(b"k" * 65, 0, b"x")      # a key longer than 64 bytes
    with pytest.raises(ValueError):
        lib.mac(b"k", 0, b"x", 2)        # a split past the end
    with pytest.raises(ValueError):
        lib.mac(b"k", 0, b"x", 0, 65)    # a digest longer than 64 bytes


def test_the_sessions_frames_check_with_the_native_mac():
    """A session's sealed frames are the native MAC under its send key and counter."""
    lib = dataloop.load()
    assert lib is not None
    client = Session(b"s" * 32, b"n" * 32, b"c" * 32, client=True)
    for i in range(40):
        frame = bytes([i]) * (i * 7)
        send_key, _, sent, _ = client.native_state()
        assert sent == i
        assert lib.mac(send_key, sent, frame, i % (len(frame) + 1)) == client.seal(frame)
