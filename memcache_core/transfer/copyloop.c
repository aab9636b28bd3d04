/* Shared-memory copies with their checksums, a whole list of ops per call (transfer/native.py).
 *
 * Plain C, no Python API: loaded with ctypes, whose foreign calls release the GIL for the whole
 * call, so the per-piece work of a batch runs without it. The hash functions are XXH3-64 streaming
 * (reset, update, digest) from the installed xxhash package's extension, passed in as pointers, so
 * the digests are those of xxhash.xxh3_64 byte for byte.
 *
 * An op is an object's payload: its bytes laid end to end from ``seg`` in the segment, and in the
 * caller's memory as pieces (address, bytes). An op may cover only the stream bytes
 * [skip, skip + len) (an object cut between threads). Each piece is handled in slices of ``slice``
 * bytes: a read copies a slice, then hashes the destination while it is still in L1/L2; a write
 * hashes the source slice, then copies it. The hashed side is always the caller's memory.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int (*mc_reset_fn)(void *state);
typedef int (*mc_update_fn)(void *state, const void *data, size_t len);
typedef uint64_t (*mc_digest_fn)(const void *state);

enum {
    MC_READ = 1,     /* segment -> caller (else caller -> segment) */
    MC_COPY = 2,     /* copy the bytes */
    MC_HASH = 4,     /* feed the caller's side of each slice to the hash */
    MC_RESET = 8,    /* reset the hash state before this op */
    MC_DIGEST = 16,  /* store the digest in ``digest`` after this op */
};

typedef struct {
    uint64_t seg;     /* segment address of the payload's first byte */
    uint64_t first;   /* index of the op's first piece */
    uint64_t count;   /* its number of pieces */
    uint64_t skip;    /* stream bytes left out before this op's range */
    uint64_t len;     /* stream bytes of this op's range */
    uint64_t flags;
    uint64_t digest;  /* out, with MC_DIGEST */
} mc_op;

typedef struct {
    mc_reset_fn reset;
    mc_update_fn update;
    mc_digest_fn digest;
} mc_hash;

static void mc_range(char *caller, char *seg, uint64_t n, uint64_t flags, uint64_t slice,
                     const mc_hash *h, void *state)
{
    int reading = (flags & MC_READ) != 0, copy = (flags & MC_COPY) != 0, hash = (flags & MC_HASH) != 0;
    for (uint64_t off = 0; off < n; off += slice) {
        size_t m = (size_t)(n - off < slice ? n - off : slice);
        if (hash && !reading)
            h->update(state, caller + off, m);
        if (copy && reading)
            memmove(caller + off, seg + off, m);
        else if (copy)
            memmove(seg + off, caller + off, m);
        if (hash && reading)
            h->update(state, caller + off, m);
    }
}

static void mc_one(const uint64_t *pieces, mc_op *op, uint64_t slice, const mc_hash *h, void *state)
{
    uint64_t skip = op->skip, left = op->len;
    char *seg = (char *)(uintptr_t)(op->seg + op->skip);
    if (op->flags & MC_RESET)
        h->reset(state);
    for (uint64_t k = op->first; k < op->first + op->count && left; k++) {
        char *caller = (char *)(uintptr_t)pieces[2 * k];
        uint64_t n = pieces[2 * k + 1];
        if (skip >= n) {
            skip -= n;
            continue;
        }
        caller += skip;
        n -= skip;
        skip = 0;
        if (n > left)
            n = left;
        mc_range(caller, seg, n, op->flags, slice, h, state);
        seg += n;
        left -= n;
    }
    if (op->flags & MC_DIGEST)
        op->digest = h->digest(state);
}

/* Run ``nops`` ops in order with one hash state; ``pieces`` holds (address, bytes) pairs. */
int mc_copy_ops(const uint64_t *pieces, mc_op *ops, uint64_t nops, uint64_t slice, void *state,
                mc_reset_fn reset, mc_update_fn update, mc_digest_fn digest)
{
    mc_hash h = {reset, update, digest};
    if (slice == 0)
        return -1;
    for (uint64_t i = 0; i < nops; i++)
        mc_one(pieces, &ops[i], slice, &h, state);
    return 0;
}

/* What the Python side checks before it trusts this library's layout of an op. */
uint64_t mc_op_size(void)
{
    return sizeof(mc_op);
}
