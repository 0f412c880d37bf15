"""Block hashes: fixed encoding, chained, salted by model/dtype/block size/cache_salt, never hash()."""
import hashlib
import struct
import subprocess
import sys

import pytest

from pdserve.block_hash import BlockHasher, HashChain, block_hash, root_hash

HASHER = BlockHasher("SmolLM2-135M-Instruct", "float32", 4)


def test_known_vector():
    # Pinned bytes: a change of encoding must be deliberate (servers and orchestrator must agree).
    assert HASHER.root().hex() == "179a97acd56af8566db9bda252fcd915"
    assert [h.hex() for h in HASHER.hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])] == [
        "19924b4dc1a94df239e16ad4b775098f", "bf50f919725d33928bfb0d143f2ece45"]


def test_encoding_is_the_documented_one():
    def field(s):
        return struct.pack("<I", len(s.encode())) + s.encode()

    root = hashlib.blake2b(b"pdserve-kv-block-v1" + field("m") + field("bfloat16") + struct.pack("<I", 16)
                           + b"\x01" + field("salt"), digest_size=16).digest()
    assert root_hash("m", "bfloat16", 16, "salt") == root
    tokens = list(range(70000, 70016))
    assert block_hash(root, tokens) == hashlib.blake2b(root + struct.pack("<16I", *tokens), digest_size=16).digest()


def test_same_in_another_process():
    # Python's hash() is salted per process; ours must not be.
    code = "from pdserve.block_hash import BlockHasher as B; print(B('x', 'float32', 2).hashes([5, 6, 7, 8])[1].hex())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONHASHSEED": "123", "PYTHONPATH": ":".join(sys.path)})
    assert out.stdout.strip() == BlockHasher("x", "float32", 2).hashes([5, 6, 7, 8])[1].hex()


def test_chained_full_blocks_only():
    hs = HASHER.hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    assert len(hs) == 2                                   # the partial third block has no hash
    assert HASHER.hashes([1, 2, 3, 4, 9, 9, 9, 9])[0] == hs[0]
    assert HASHER.hashes([0, 2, 3, 4, 5, 6, 7, 8])[1] != hs[1]   # block 1 names its whole prefix
    assert len(set(hs)) == 2


@pytest.mark.parametrize("other", [BlockHasher("other-model", "float32", 4), BlockHasher(HASHER.model, "bfloat16", 4)])
def test_salted_by_model_and_dtype(other):
    assert other.hashes([1, 2, 3, 4]) != HASHER.hashes([1, 2, 3, 4])


def test_salted_by_block_size_and_cache_salt():
    assert BlockHasher(HASHER.model, "float32", 2).hashes([1, 2, 3, 4])[1] != HASHER.hashes([1, 2, 3, 4])[0]
    plain, a, b = (HASHER.hashes([1, 2, 3, 4], s)[0] for s in (None, "a", "b"))
    assert len({plain, a, b}) == 3
    assert HASHER.hashes([1, 2, 3, 4], "") != [plain]     # an empty salt is still a salt
    assert HASHER.hashes([1, 2, 3, 4], "a")[0] == a


def test_chain_extends_incrementally():
    chain = HASHER.chain()
    tokens = [1, 2, 3]
    assert chain.extend(tokens) == []
    tokens += [4, 5, 6, 7, 8]
    assert chain.extend(tokens) == HASHER.hashes(tokens)
    assert isinstance(chain, HashChain) and len(chain.hashes) == 2


def test_bad_token_ids_and_block_size():
    with pytest.raises(ValueError):
        HASHER.hashes([1, 2, 3, -1])
    with pytest.raises(ValueError):
        HASHER.hashes([1, 2, 3, 2**32])
    with pytest.raises(ValueError):
        root_hash("m", "float32", 0)


def test_orchestrator_router_uses_the_same_hashes():
    from orchestrator.router import block_hashes

    tokens = list(range(40))
    assert list(block_hashes(tokens, 4, model=HASHER.model, dtype="float32", cache_salt="s")) == \
        HASHER.hashes(tokens, "s")
