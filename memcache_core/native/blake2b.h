/* Keyed BLAKE2b (RFC 7693), header-only, for the native loops' frame MACs.
 *
 * The MACs of auth.Session are keyed BLAKE2b with a 16-byte digest over ``sequence (u64 LE) | frame``;
 * hashlib.blake2b is the reference, and each library that includes this file has a self-test at load
 * and unit tests comparing digests with hashlib's for keys, lengths and split points
 * (tests/unit/test_native_blake2b.py). Written from the RFC's description; every function is static,
 * so each extension carries its own copy and none links against another.
 *
 * A keyed state is made once per connection and direction (``mc_b2b_init``) and copied per frame,
 * as Session does with hashlib's ``copy()``: the key block is absorbed but not yet compressed, so a
 * copy costs 216 bytes of memcpy.
 */
#ifndef MC_BLAKE2B_H
#define MC_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint64_t h[8];
    uint64_t t[2];        /* bytes compressed so far (128-bit counter) */
    uint8_t b[128];       /* the block not yet compressed */
    size_t c;             /* bytes in b */
    size_t outlen;
} mc_b2b;

static const uint64_t mc_b2b_iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t mc_b2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t mc_b2b_rotr(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t mc_b2b_load(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

#define MC_B2B_G(a, b, c, d, x, y)                 \
    do {                                           \
        v[a] = v[a] + v[b] + (x);                  \
        v[d] = mc_b2b_rotr(v[d] ^ v[a], 32);       \
        v[c] = v[c] + v[d];                        \
        v[b] = mc_b2b_rotr(v[b] ^ v[c], 24);       \
        v[a] = v[a] + v[b] + (y);                  \
        v[d] = mc_b2b_rotr(v[d] ^ v[a], 16);       \
        v[c] = v[c] + v[d];                        \
        v[b] = mc_b2b_rotr(v[b] ^ v[c], 63);       \
    } while (0)

static void mc_b2b_compress(mc_b2b *s, int last)
{
    uint64_t v[16], m[16];
    for (int i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = mc_b2b_iv[i];
    }
    v[12] ^= s->t[0];
    v[13] ^= s->t[1];
    if (last)
        v[14] = ~v[14];
    for (int i = 0; i < 16; i++)
        m[i] = mc_b2b_load(s->b + 8 * i);
    for (int r = 0; r < 12; r++) {
        const uint8_t *z = mc_b2b_sigma[r];
        MC_B2B_G(0, 4, 8, 12, m[z[0]], m[z[1]]);
        MC_B2B_G(1, 5, 9, 13, m[z[2]], m[z[3]]);
        MC_B2B_G(2, 6, 10, 14, m[z[4]], m[z[5]]);
        MC_B2B_G(3, 7, 11, 15, m[z[6]], m[z[7]]);
        MC_B2B_G(0, 5, 10, 15, m[z[8]], m[z[9]]);
        MC_B2B_G(1, 6, 11, 12, m[z[10]], m[z[11]]);
        MC_B2B_G(2, 7, 8, 13, m[z[12]], m[z[13]]);
        MC_B2B_G(3, 4, 9, 14, m[z[14]], m[z[15]]);
    }
    for (int i = 0; i < 8; i++)
        s->h[i] ^= v[i] ^ v[i + 8];
}

static void mc_b2b_update(mc_b2b *s, const void *data, size_t len)
{
    const uint8_t *in = (const uint8_t *)data;
    while (len > 0) {
        if (s->c == sizeof s->b) {   /* a full block is compressed only once more input follows it */
            s->t[0] += sizeof s->b;
            if (s->t[0] < sizeof s->b)
                s->t[1]++;
            mc_b2b_compress(s, 0);
            s->c = 0;
        }
        size_t k = sizeof s->b - s->c;
        if (k > len)
            k = len;
        memcpy(s->b + s->c, in, k);
        s->c += k;
        in += k;
        len -= k;
    }
}

/* outlen 1..64, keylen 0..64; -1 otherwise. */
static int mc_b2b_init(mc_b2b *s, size_t outlen, const void *key, size_t keylen)
{
    if (outlen == 0 || outlen > 64 || keylen > 64)
        return -1;
    memcpy(s->h, mc_b2b_iv, sizeof s->h);
    s->h[0] ^= 0x01010000ULL ^ ((uint64_t)keylen << 8) ^ (uint64_t)outlen;
    s->t[0] = s->t[1] = 0;
    s->c = 0;
    s->outlen = outlen;
    if (keylen > 0) {
        uint8_t block[128] = {0};
        memcpy(block, key, keylen);
        mc_b2b_update(s, block, sizeof block);
    }
    return 0;
}

static void mc_b2b_final(mc_b2b *s, uint8_t *out)
{
    s->t[0] += s->c;
    if (s->t[0] < s->c)
        s->t[1]++;
    memset(s->b + s->c, 0, sizeof s->b - s->c);
    mc_b2b_compress(s, 1);
    for (size_t i = 0; i < s->outlen; i++)
        out[i] = (uint8_t)(s->h[i / 8] >> (8 * (i % 8)));
}

/* The MAC of one frame: a copy of the keyed state ``keyed``, then ``seq`` (u64 LE), then the parts. */
static void mc_b2b_mac(const mc_b2b *keyed, uint64_t seq, const void *const *parts, const size_t *lens,
                       size_t nparts, uint8_t *out)
{
    mc_b2b s;
    uint8_t le[8];
    memcpy(&s, keyed, sizeof s);
    for (int i = 0; i < 8; i++)
        le[i] = (uint8_t)(seq >> (8 * i));
    mc_b2b_update(&s, le, sizeof le);
    for (size_t i = 0; i < nparts; i++)
        mc_b2b_update(&s, parts[i], lens[i]);
    mc_b2b_final(&s, out);
}

#endif
