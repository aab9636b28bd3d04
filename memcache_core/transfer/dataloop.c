/* The data server's request loop for one plain-TCP connection (transfer/dataloop.py).
 *
 * Plain C, no Python API: loaded with ctypes, whose foreign calls release the GIL for the whole
 * call. It answers the connection's plain reads itself: it receives the request (head, ranges and
 * the session's MAC), checks the MAC, the segment id and the ranges, then sends the sealed answer and
 * the segment's bytes with one sendmsg. Everything else (writes, disk ops, a segment id it does not
 * find, ranges out of bounds, a failed MAC, another magic, more ranges than MC_DL_RANGES) is handed
 * back to Python untouched: the bytes of that request read so far are in ``buf`` and neither
 * sequence counter has moved, so Python handles it as if it had read them itself. The wire format is
 * transfer/tcp.py's; the MAC is auth.Session's (keyed BLAKE2b-16 over seq (u64 LE) | frame).
 */
#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include "../native/blake2b.h"

#define MC_DL_HEAD 17                /* magic (4), op (1), count (u32), segment id (u64) */
#define MC_DL_RANGE 16               /* offset (u64), length (u64) */
#define MC_DL_ANSWER 12              /* status (i32), length (u64) */
#define MC_DL_RANGES 64              /* the most ranges a read served here may have */
#define MC_DL_IDS 64                 /* segment ids in the shared table */
#define MC_DL_BUF (MC_DL_HEAD + MC_DL_RANGES * MC_DL_RANGE + 64)
#define MC_DL_OP_READ 1

enum {
    MC_DL_OK = -1,       /* (inside: received or sent all) */
    MC_DL_COUNT = 0,     /* returned so Python can pass the served counts on; nothing pending */
    MC_DL_HANDBACK = 1,  /* a request for Python: ``got`` bytes of it are in buf */
    MC_DL_CLOSED = 2,    /* the peer closed (or shut down here): close the connection */
    MC_DL_TIMEOUT = 3,   /* idle past the timeout: close the connection */
    MC_DL_ERROR = 4,     /* a socket error (``err``): close the connection */
    MC_DL_BADARG = 5,
};

typedef struct {
    uint64_t sent;       /* the session's frames sent (in and out) */
    uint64_t received;   /* the session's frames received (in and out) */
    uint64_t reads;      /* reads served in this call (out) */
    uint64_t bytes;      /* their payload bytes (out) */
    uint64_t got;        /* bytes of the handed-back request in buf (out) */
    int64_t err;         /* errno of MC_DL_ERROR (out) */
} mc_dl_state;

uint64_t mc_dataloop_state_size(void) { return sizeof(mc_dl_state); }
uint64_t mc_dataloop_buf_size(void) { return MC_DL_BUF; }

/* The MAC of ``data`` (split in two parts at ``split``) as auth.Session makes it; for the tests. */
int mc_dataloop_mac(const uint8_t *key, uint64_t keylen, uint64_t seq, const uint8_t *data, uint64_t len,
                    uint64_t split, uint8_t *out, uint64_t outlen)
{
    mc_b2b keyed;
    if (split > len || mc_b2b_init(&keyed, outlen, key, keylen) != 0)
        return -1;
    const void *parts[2] = {data, data + split};
    size_t lens[2] = {split, len - split};
    mc_b2b_mac(&keyed, seq, parts, lens, 2, out);
    return 0;
}

static uint64_t mc_dl_le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static int64_t mc_dl_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Wait for ``events`` on fd: 1 ready, 0 timed out, -1 error (errno). */
static int mc_dl_wait(int fd, short events, int timeout_ms)
{
    struct pollfd p = {fd, events, 0};
    for (;;) {
        int r = poll(&p, 1, timeout_ms);
        if (r >= 0)
            return r;
        if (errno != EINTR)
            return -1;
    }
}

/* Receive into buf[*got, want) until at least ``least`` bytes are there: MC_DL_OK then, else the MC_DL_* code
 * to return. A wait is bounded by idle_ms; the first one of a request by quiet_ms too when ``quiet``
 * (then MC_DL_COUNT). */
static int mc_dl_recv(int fd, uint8_t *buf, size_t *got, size_t least, size_t want, int idle_ms, int quiet_ms,
                      int quiet, mc_dl_state *st)
{
    while (*got < least) {
        ssize_t r = recv(fd, buf + *got, want - *got, MSG_DONTWAIT);
        if (r > 0) {
            *got += (size_t)r;
            continue;
        }
        if (r == 0)
            return MC_DL_CLOSED;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            st->err = errno;
            return MC_DL_ERROR;
        }
        if (quiet && *got == 0) {
            int w = mc_dl_wait(fd, POLLIN, quiet_ms < idle_ms ? quiet_ms : idle_ms);
            if (w == 0 && quiet_ms < idle_ms)
                return MC_DL_COUNT;
            quiet = 0;
            if (w > 0)
                continue;
            if (w == 0)
                return MC_DL_TIMEOUT;
        } else {
            int w = mc_dl_wait(fd, POLLIN, idle_ms);
            if (w > 0)
                continue;
            if (w == 0)
                return MC_DL_TIMEOUT;
        }
        st->err = errno;
        return MC_DL_ERROR;
    }
    return MC_DL_OK;
}

/* Send all of iov (modified as it goes): MC_DL_OK, or the MC_DL_* code to return. */
static int mc_dl_send(int fd, struct iovec *iov, int niov, int idle_ms, mc_dl_state *st)
{
    while (niov > 0) {
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = iov;
        m.msg_iovlen = (size_t)niov;
        ssize_t r = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                st->err = errno;
                return MC_DL_ERROR;
            }
            int w = mc_dl_wait(fd, POLLOUT, idle_ms);
            if (w == 0)
                return MC_DL_TIMEOUT;
            if (w < 0) {
                st->err = errno;
                return MC_DL_ERROR;
            }
            continue;
        }
        size_t left = (size_t)r;
        while (niov > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++;
            niov--;
        }
        if (niov > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return MC_DL_OK;
}

/* Whether the shared table ``ids`` (count, then MC_DL_IDS ids; only ever ids of this segment, written
 * while this runs) lets a request for ``sid`` be served here: a bare server (count 0) serves any. */
static int mc_dl_known(const uint64_t *ids, uint64_t sid)
{
    uint64_t count = __atomic_load_n(&ids[0], __ATOMIC_ACQUIRE);
    if (count == 0)
        return 1;
    if (sid == 0)
        return 0;
    if (count > MC_DL_IDS)
        count = MC_DL_IDS;
    for (uint64_t i = 0; i < count; i++)
        if (__atomic_load_n(&ids[1 + i], __ATOMIC_RELAXED) == sid)
            return 1;
    return 0;
}

/* Serve the connection until a request is for Python, it closes or idles out, or ``max_reads`` were
 * served, or reads served are uncounted and it was quiet ``quiet_ms`` or ``count_ms`` passed since
 * the first of them (MC_DL_COUNT). ``tag`` is 16 (keys given) or 0 (authentication off). */
int mc_dataloop_serve(int fd, const uint8_t *send_key, const uint8_t *recv_key, uint64_t keylen, uint64_t tag,
                      const uint8_t *seg, uint64_t seg_size, const uint64_t *ids, const uint8_t *magic,
                      int idle_ms, int quiet_ms, int count_ms, uint64_t max_reads, mc_dl_state *st,
                      uint8_t *buf, uint64_t buflen)
{
    mc_b2b skey, rkey;
    if (buflen < MC_DL_BUF || (tag != 0 && tag != 16) ||
        (tag && (mc_b2b_init(&skey, tag, send_key, keylen) != 0 || mc_b2b_init(&rkey, tag, recv_key, keylen) != 0)))
        return MC_DL_BADARG;
    st->reads = st->bytes = st->got = 0;
    st->err = 0;
    const size_t first = MC_DL_HEAD + MC_DL_RANGE + tag;   /* the shortest request: read at once */
    int64_t since = 0;
    for (;;) {
        size_t got = 0;
        int r = mc_dl_recv(fd, buf, &got, MC_DL_HEAD, first, idle_ms, quiet_ms, st->reads > 0, st);
        st->got = got;
        if (r != MC_DL_OK)
            return r;
        uint32_t n = (uint32_t)buf[5] | (uint32_t)buf[6] << 8 | (uint32_t)buf[7] << 16 | (uint32_t)buf[8] << 24;
        if (memcmp(buf, magic, 4) != 0 || buf[4] != MC_DL_OP_READ || n == 0 || n > MC_DL_RANGES)
            return MC_DL_HANDBACK;
        size_t end = MC_DL_HEAD + (size_t)n * MC_DL_RANGE;   /* where the MAC starts */
        r = mc_dl_recv(fd, buf, &got, end + tag, end + tag, idle_ms, quiet_ms, 0, st);
        st->got = got;
        if (r != MC_DL_OK)
            return r;
        uint8_t mac[16];
        if (tag) {
            const void *parts[1] = {buf};
            size_t lens[1] = {end};
            mc_b2b_mac(&rkey, st->received, parts, lens, 1, mac);
            uint8_t diff = 0;
            for (size_t i = 0; i < tag; i++)
                diff |= mac[i] ^ buf[end + i];
            if (diff)
                return MC_DL_HANDBACK;   /* Python checks it again, says so and closes */
        }
        if (!mc_dl_known(ids, mc_dl_le64(buf + 9)))
            return MC_DL_HANDBACK;
        struct iovec iov[1 + MC_DL_RANGES];
        uint64_t total = 0;
        for (uint32_t i = 0; i < n; i++) {
            uint64_t off = mc_dl_le64(buf + MC_DL_HEAD + i * MC_DL_RANGE);
            uint64_t len = mc_dl_le64(buf + MC_DL_HEAD + i * MC_DL_RANGE + 8);
            if (len > seg_size || off > seg_size - len)
                return MC_DL_HANDBACK;
            iov[1 + i].iov_base = (void *)(seg + off);
            iov[1 + i].iov_len = len;
            total += len;
        }
        uint8_t answer[MC_DL_ANSWER + 16];
        memset(answer, 0, 4);   /* status 0 */
        for (int i = 0; i < 8; i++)
            answer[4 + i] = (uint8_t)(total >> (8 * i));
        if (tag) {
            const void *parts[1] = {answer};
            size_t lens[1] = {MC_DL_ANSWER};
            mc_b2b_mac(&skey, st->sent, parts, lens, 1, answer + MC_DL_ANSWER);
        }
        st->received += tag ? 1 : 0;
        st->sent += tag ? 1 : 0;
        st->got = 0;
        iov[0].iov_base = answer;
        iov[0].iov_len = MC_DL_ANSWER + tag;
        r = mc_dl_send(fd, iov, 1 + (int)n, idle_ms, st);
        if (r != MC_DL_OK)
            return r;
        if (st->reads++ == 0)
            since = mc_dl_now_ms();
        st->bytes += total;
        if (st->reads >= max_reads || mc_dl_now_ms() - since >= count_ms)
            return MC_DL_COUNT;
    }
}
