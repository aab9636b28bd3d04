/* A measuring prototype, not part of the package: the MetaService's key -> object map in native memory,
 * answering an Exist request straight from its msgpack bytes (benchmarks/bench_meta_native.py builds
 * it with the system C compiler and compares it with the Python table, answer for answer).
 *
 * What it holds per object is what the Python table's object holds (meta/objects.py): the packed
 * fields (first location, size, offset, generation, checksum, writer slot: five 64-bit words), the
 * lease end, two LRU links, an index of its extras and its state, in an 80-byte record; the key in
 * an arena after a 16-bit length; the map an open-addressing index at most 70% full, each slot a
 * record number and 32 bits of the key's hash (most absent keys cost one cache miss: no record read).
 * Keys are hashed with SipHash-1-3 under a random key (CPython's own string hash; a hash without a
 * secret key would let a client choose colliding keys). An Exist's keys are looked up in
 * groups of 16 whose memory reads are prefetched together (a look-up is a few cache misses; in a group
 * they overlap).
 *
 * One map per process (module state): enough for a measurement. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { PENDING = 1, COMMITTED = 2 };
enum { GROUP = 16 };   /* keys whose look-ups overlap (exist_reply) */

typedef struct {
    uint64_t hash;
    uint32_t key_at;       /* offset of the key's 16-bit length in the arena */
    uint16_t key_len;
    uint8_t state;
    uint8_t pad;
    uint64_t packed[5];
    double lease_until;
    uint32_t prev, next;   /* LRU links: record numbers */
    uint32_t more, pad2;   /* index into a table of extras (0: none) */
} record;

static record *records;
static uint64_t n_records, cap_records;
static uint64_t *slots;    /* high 32 bits: the hash's; low: record number + 1 (0: empty) */
static uint64_t mask;
static unsigned char *arena;
static uint64_t arena_used, arena_cap;
static uint64_t k0, k1;

#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                          \
    do {                                                                  \
        v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32);         \
        v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2;                            \
        v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0;                            \
        v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32);         \
    } while (0)

static uint64_t siphash13(const unsigned char *p, size_t len) {
    uint64_t v0 = k0 ^ 0x736f6d6570736575ULL, v1 = k1 ^ 0x646f72616e646f6dULL;
    uint64_t v2 = k0 ^ 0x6c7967656e657261ULL, v3 = k1 ^ 0x7465646279746573ULL;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t m;
        memcpy(&m, p + i, 8);   /* little-endian hosts (x86-64, aarch64) */
        v3 ^= m; SIPROUND; v0 ^= m;
    }
    uint64_t b = (uint64_t)len << 56;
    for (size_t j = 0; i + j < len; j++) b |= (uint64_t)p[i + j] << (8 * j);
    v3 ^= b; SIPROUND; v0 ^= b;
    v2 ^= 0xff; SIPROUND; SIPROUND; SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

static void release(void) {
    free(records); free(slots); free(arena);
    records = NULL; slots = NULL; arena = NULL;
    n_records = cap_records = arena_used = arena_cap = 0;
}

static PyObject *init(PyObject *self, PyObject *args) {
    unsigned long long n;
    if (!PyArg_ParseTuple(args, "KKK", &n, &k0, &k1)) return NULL;
    release();
    uint64_t cap = 16;
    while (cap * 7 / 10 < n) cap <<= 1;
    mask = cap - 1;
    slots = calloc(cap, sizeof *slots);
    cap_records = n ? n : 1;
    records = malloc(cap_records * sizeof *records);
    arena_cap = cap_records * 96;
    arena = malloc(arena_cap);
    if (!slots || !records || !arena) { release(); return PyErr_NoMemory(); }
    Py_RETURN_NONE;
}

static record *find(const unsigned char *key, size_t len, uint64_t h, uint64_t *at) {
    uint64_t i = h & mask;
    for (uint64_t s; (s = slots[i]) != 0; i = (i + 1) & mask) {
        if ((s >> 32) != (h >> 32)) continue;
        record *r = &records[(uint32_t)s - 1];
        if (r->hash == h && r->key_len == len && memcmp(arena + r->key_at + 2, key, len) == 0) return r;
    }
    *at = i;
    return NULL;
}

/* insert(key: bytes, packed: 5 ints, committed: bool): add or replace the object of ``key``. */
static PyObject *insert(PyObject *self, PyObject *args) {
    const char *key;
    Py_ssize_t len;
    unsigned long long f[5];
    int committed;
    if (!PyArg_ParseTuple(args, "y#KKKKKp", &key, &len, &f[0], &f[1], &f[2], &f[3], &f[4], &committed))
        return NULL;
    if (len < 1 || len > 65535) { PyErr_SetString(PyExc_ValueError, "key length"); return NULL; }
    uint64_t h = siphash13((const unsigned char *)key, (size_t)len), at = 0;
    record *r = find((const unsigned char *)key, (size_t)len, h, &at);
    if (r == NULL) {
        if (n_records == cap_records || n_records + 1 > (mask + 1) * 7 / 10 || n_records >= UINT32_MAX - 1) {
            PyErr_SetString(PyExc_MemoryError, "map full (init with the object count)"); return NULL;
        }
        if (arena_used + 2 + (uint64_t)len > UINT32_MAX) {
            PyErr_SetString(PyExc_MemoryError, "key arena past 4 GiB"); return NULL;
        }
        if (arena_used + 2 + (uint64_t)len > arena_cap) {
            uint64_t want = (arena_cap * 3) / 2 + 2 + (uint64_t)len;
            unsigned char *grown = realloc(arena, want);
            if (!grown) return PyErr_NoMemory();
            arena = grown; arena_cap = want;
        }
        r = &records[n_records++];
        memset(r, 0, sizeof *r);
        r->hash = h; r->key_at = (uint32_t)arena_used; r->key_len = (uint16_t)len;
        uint16_t l16 = (uint16_t)len;
        memcpy(arena + arena_used, &l16, 2);
        memcpy(arena + arena_used + 2, key, (size_t)len);
        arena_used += 2 + (uint64_t)len;
        slots[at] = (h >> 32 << 32) | (uint32_t)n_records;
    }
    memcpy(r->packed, f, sizeof f);
    r->state = committed ? COMMITTED : PENDING;
    Py_RETURN_NONE;
}

/* msgspec's msgpack: a str header (fix, 8, 16, 32) at p; its length, or -1. */
static int64_t str_len(const unsigned char **p, const unsigned char *end) {
    if (*p >= end) return -1;
    unsigned c = *(*p)++;
    uint64_t n;
    if ((c & 0xe0) == 0xa0) return c & 0x1f;
    if (c == 0xd9) { if (end - *p < 1) return -1; n = (*p)[0]; *p += 1; return (int64_t)n; }
    if (c == 0xda) { if (end - *p < 2) return -1; n = ((uint64_t)(*p)[0] << 8) | (*p)[1]; *p += 2; return (int64_t)n; }
    if (c == 0xdb) {
        if (end - *p < 4) return -1;
        n = ((uint64_t)(*p)[0] << 24) | ((uint64_t)(*p)[1] << 16) | ((uint64_t)(*p)[2] << 8) | (*p)[3];
        *p += 4; return (int64_t)n;
    }
    return -1;
}

static int64_t array_len(const unsigned char **p, const unsigned char *end) {
    if (*p >= end) return -1;
    unsigned c = *(*p)++;
    if ((c & 0xf0) == 0x90) return c & 0x0f;
    if (c == 0xdc) { if (end - *p < 2) return -1; int64_t n = ((*p)[0] << 8) | (*p)[1]; *p += 2; return n; }
    if (c == 0xdd) {
        if (end - *p < 4) return -1;
        int64_t n = ((int64_t)(*p)[0] << 24) | ((*p)[1] << 16) | ((*p)[2] << 8) | (*p)[3];
        *p += 4; return n;
    }
    return -1;
}

static int is_str(const unsigned char **p, const unsigned char *end, const char *want) {
    int64_t n = str_len(p, end);
    size_t w = strlen(want);
    if (n != (int64_t)w || end - *p < n || memcmp(*p, want, w) != 0) return 0;
    *p += n;
    return 1;
}

static const char REPLY_HEAD[] = "\x83\xa4type\xa5" "Flags\xa5" "flags";
static const char REPLY_TAIL[] = "\xa4term\x00";

/* exist_reply(body: bytes) -> bytes: the encoded Flags reply to an encoded Exist request (as the
 * Python path encodes it, term 0), or None when the body is not an Exist of 1..255-byte keys. */
static PyObject *exist_reply(PyObject *self, PyObject *arg) {
    Py_buffer in;
    if (PyObject_GetBuffer(arg, &in, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *p = in.buf, *end = p + in.len;
    int64_t n = -1;
    if (in.len > 0 && *p++ == 0x82 && is_str(&p, end, "type") && is_str(&p, end, "Exist") && is_str(&p, end, "keys"))
        n = array_len(&p, end);
    if (n < 0) { PyBuffer_Release(&in); Py_RETURN_NONE; }
    Py_ssize_t head = sizeof REPLY_HEAD - 1, tail = sizeof REPLY_TAIL - 1;
    Py_ssize_t arr = n < 16 ? 1 : n < 65536 ? 3 : 5;
    PyObject *out = PyBytes_FromStringAndSize(NULL, head + arr + n + tail);
    if (!out) { PyBuffer_Release(&in); return NULL; }
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(out);
    memcpy(o, REPLY_HEAD, head); o += head;
    if (n < 16) *o++ = 0x90 | (unsigned char)n;
    else if (n < 65536) { *o++ = 0xdc; *o++ = (unsigned char)(n >> 8); *o++ = (unsigned char)n; }
    else { *o++ = 0xdd; *o++ = (unsigned char)(n >> 24); *o++ = (unsigned char)(n >> 16);
           *o++ = (unsigned char)(n >> 8); *o++ = (unsigned char)n; }
    /* In groups of GROUP keys: hash all and prefetch their slots, then prefetch the records their
     * first slots name, then probe: the cache misses of a group overlap instead of queuing. */
    for (int64_t i = 0; i < n; i += GROUP) {
        const unsigned char *key[GROUP];
        size_t klen[GROUP];
        uint64_t h[GROUP];
        int g = (int)(n - i < GROUP ? n - i : GROUP);
        for (int j = 0; j < g; j++) {
            int64_t len = str_len(&p, end);
            if (len < 1 || len > 255 || end - p < len) { Py_DECREF(out); PyBuffer_Release(&in); Py_RETURN_NONE; }
            key[j] = p; klen[j] = (size_t)len; p += len;
            h[j] = siphash13(key[j], klen[j]);
            __builtin_prefetch(&slots[h[j] & mask]);
        }
        for (int j = 0; j < g; j++) {
            uint64_t s = slots[h[j] & mask];
            if (s != 0 && (s >> 32) == (h[j] >> 32)) __builtin_prefetch(&records[(uint32_t)s - 1]);
        }
        for (int j = 0; j < g; j++) {
            uint64_t at;
            record *r = find(key[j], klen[j], h[j], &at);
            *o++ = (r != NULL && r->state == COMMITTED) ? 0xc3 : 0xc2;
        }
    }
    memcpy(o, REPLY_TAIL, tail);
    PyBuffer_Release(&in);
    if (p != end) { Py_DECREF(out); Py_RETURN_NONE; }
    return out;
}

/* nbytes() -> (records, index, arena): the bytes each part holds for the objects inserted. */
static PyObject *nbytes(PyObject *self, PyObject *unused) {
    return Py_BuildValue("(KKK)", (unsigned long long)(n_records * sizeof(record)),
                         (unsigned long long)((mask + 1) * sizeof(uint64_t)), (unsigned long long)arena_used);
}

static PyObject *record_size(PyObject *self, PyObject *unused) { return PyLong_FromSize_t(sizeof(record)); }

static PyObject *drop(PyObject *self, PyObject *unused) { release(); Py_RETURN_NONE; }

static PyMethodDef methods[] = {
    {"init", init, METH_VARARGS, "init(objects, k0, k1): an empty map for that many objects"},
    {"insert", insert, METH_VARARGS, "insert(key, f0, f1, f2, f3, f4, committed)"},
    {"exist_reply", exist_reply, METH_O, "exist_reply(body) -> the encoded reply, or None"},
    {"nbytes", nbytes, METH_NOARGS, "(records, index, arena) bytes"},
    {"record_size", record_size, METH_NOARGS, "bytes of one record"},
    {"drop", drop, METH_NOARGS, "free the map"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "native_table_probe", NULL, -1, methods};

PyMODINIT_FUNC PyInit_native_table_probe(void) { return PyModule_Create(&module); }
