/* The control plane's frame pump: epoll, recv, frame assembly, MAC check, sealing and sending of
 * replies for the authenticated plain-TCP connections of a FrameServer (rpc/server.py, rpc/pump.py).
 *
 * A CPython extension (not plain C under ctypes: one call returns a batch of frames as bytes objects
 * and one takes a batch of replies; docs/design.md has the measured per-call costs). Python keeps
 * accept, TLS, the pool's handshake and the handler; it hands a connection over once authenticated
 * (``adopt``: the socket's descriptor, the session's keys and counters, bytes already read or not yet
 * sent), and from then on this file owns and closes the descriptor. The Python selector's own epoll
 * descriptor is watched here too, so one ``poll`` waits on both.
 *
 * Frames are ``u32 length | u64 request id | body`` and, on an authenticated connection, a keyed
 * BLAKE2b-16 over ``sequence (u64 LE) | head | body`` (auth.Session), one key and counter per
 * direction. The bounds are FrameServer's: a header over ``max_frame`` or a failed MAC closes the
 * connection (and none of the frames of that read is answered); unfinished frames of all connections
 * together (``buffered``, plus the Python side's passed in) at most ``max_buffered``; unsent reply
 * bytes at most ``max_reply`` per connection and ``max_pending`` (with the Python side's) in all, or
 * the connection is closed; ``sweep`` closes those silent longer than the idle timeout.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "../native/blake2b.h"

#define HEAD 12
#define READ_CHUNK 65536
#define MAX_EVENTS 256
#define PY_SLOT UINT64_MAX
#define RUN_MAX 300 /* replies of one connection per sendmsg (3 pieces each, under IOV_MAX) */

typedef struct {
    int fd;
    uint32_t gen;
    int maclen;           /* 16, or 0 with authentication off */
    int writing;          /* EPOLLOUT is asked for */
    uint8_t *in;
    size_t in_len, in_cap;
    uint8_t *out;
    size_t out_off, out_len, out_cap; /* unsent bytes: out[out_off:out_len] */
    mc_b2b ksend, krecv;
    uint64_t sent, received;
    double last;
} conn_t;

typedef struct {
    PyObject_HEAD int ep;
    conn_t **conns;
    size_t nconns, cap;
    size_t open;
    int64_t buffered, pending;
    size_t max_frame, max_reply;
    PyObject *closed; /* ids closed since the last poll */
    uint8_t *rbuf;
} Pump;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static uint64_t cid_of(size_t slot, conn_t *c) { return ((uint64_t)c->gen << 32) | slot; }

static conn_t *lookup(Pump *p, uint64_t cid)
{
    size_t slot = (size_t)(cid & 0xffffffffu);
    if (slot >= p->nconns || p->conns[slot] == NULL || p->conns[slot]->fd < 0 || p->conns[slot]->gen != (cid >> 32))
        return NULL;
    return p->conns[slot];
}

static void drop(Pump *p, size_t slot)
{
    conn_t *c = p->conns[slot];
    if (c->fd < 0)
        return;
    PyObject *id = PyLong_FromUnsignedLongLong(cid_of(slot, c));
    if (id == NULL || PyList_Append(p->closed, id) < 0)
        PyErr_Clear();
    Py_XDECREF(id);
    epoll_ctl(p->ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    c->fd = -1;
    p->buffered -= (int64_t)c->in_len;
    p->pending -= (int64_t)(c->out_len - c->out_off);
    PyMem_Free(c->in);
    PyMem_Free(c->out);
    c->in = c->out = NULL;
    c->in_len = c->in_cap = c->out_off = c->out_len = c->out_cap = 0;
    p->open--;
}

static int reserve(uint8_t **buf, size_t *cap, size_t need)
{
    if (need <= *cap)
        return 0;
    size_t n = *cap ? *cap : 4096;
    while (n < need)
        n *= 2;
    uint8_t *b = PyMem_Realloc(*buf, n);
    if (b == NULL)
        return -1;
    *buf = b;
    *cap = n;
    return 0;
}

static void want_write(Pump *p, conn_t *c, size_t slot, int on)
{
    if (c->writing == on)
        return;
    struct epoll_event ev = {.events = EPOLLIN | (on ? EPOLLOUT : 0), .data.u64 = slot};
    epoll_ctl(p->ep, EPOLL_CTL_MOD, c->fd, &ev);
    c->writing = on;
}

/* Keep ``n`` unsent bytes; false (and the connection closed) past a bound. */
static int keep(Pump *p, size_t slot, const uint8_t *data, size_t n, int64_t py_pending, int64_t max_pending)
{
    conn_t *c = p->conns[slot];
    if (n == 0)
        return 1;
    if (c->out_off && c->out_off == c->out_len)
        c->out_off = c->out_len = 0;
    if (c->out_len - c->out_off + n > p->max_reply || p->pending + py_pending + (int64_t)n > max_pending) {
        drop(p, slot);
        return 0;
    }
    if (reserve(&c->out, &c->out_cap, c->out_len + n) < 0) {
        drop(p, slot);
        return 0;
    }
    memcpy(c->out + c->out_len, data, n);
    c->out_len += n;
    p->pending += (int64_t)n;
    want_write(p, c, slot, 1);
    return 1;
}

static void flush(Pump *p, size_t slot)
{
    conn_t *c = p->conns[slot];
    while (c->out_off < c->out_len) {
        ssize_t k = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                drop(p, slot);
            return;
        }
        c->out_off += (size_t)k;
        p->pending -= k;
    }
    c->out_off = c->out_len = 0;
    if (c->out_cap > (1 << 20)) { /* a large reply went: do not hold its buffer */
        PyMem_Free(c->out);
        c->out = NULL;
        c->out_cap = 0;
    }
    want_write(p, c, slot, 0);
}

/* Cut the whole frames off the connection's input into ``frames``; -1 closes it. */
static int take(Pump *p, size_t slot, PyObject *frames)
{
    conn_t *c = p->conns[slot];
    size_t pos = 0;
    uint64_t cid = cid_of(slot, c);
    while (c->in_len - pos >= HEAD) {
        const uint8_t *h = c->in + pos;
        uint32_t n = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24;
        uint64_t rid = 0;
        for (int i = 7; i >= 0; i--)
            rid = (rid << 8) | h[4 + i];
        if (n > p->max_frame)
            return -1;
        size_t end = HEAD + (size_t)n;
        if (c->in_len - pos < end + (size_t)c->maclen)
            break;
        if (c->maclen) {
            uint8_t tag[16], diff = 0;
            const void *parts[1] = {h};
            size_t lens[1] = {end};
            mc_b2b_mac(&c->krecv, c->received++, parts, lens, 1, tag);
            for (int i = 0; i < 16; i++)
                diff |= tag[i] ^ h[end + i];
            if (diff)
                return -1;
        }
        PyObject *t = Py_BuildValue("(KKy#)", (unsigned long long)cid, (unsigned long long)rid, h + HEAD,
                                    (Py_ssize_t)n);
        if (t == NULL || PyList_Append(frames, t) < 0) {
            Py_XDECREF(t);
            return -2;
        }
        Py_DECREF(t);
        pos += end + (size_t)c->maclen;
    }
    if (pos) {
        memmove(c->in, c->in + pos, c->in_len - pos);
        c->in_len -= pos;
        p->buffered -= (int64_t)pos;
        if (c->in_cap > (1 << 16) && c->in_len <= c->in_cap / 4) { /* a large frame went: do not hold its buffer */
            size_t n = 4096;
            while (n < c->in_len)
                n *= 2;
            uint8_t *b = PyMem_Realloc(c->in, n);
            if (b != NULL) {
                c->in = b;
                c->in_cap = n;
            }
        }
    }
    return 0;
}

/* Read what one recv gives, then the whole frames; -2: a Python error. */
static int read_conn(Pump *p, size_t slot, PyObject *frames, int64_t py_buffered, int64_t max_buffered)
{
    conn_t *c = p->conns[slot];
    ssize_t k;
    do
        k = recv(c->fd, p->rbuf, READ_CHUNK, 0);
    while (k < 0 && errno == EINTR);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        return 0;
    if (k <= 0 || p->buffered + py_buffered + k > max_buffered || reserve(&c->in, &c->in_cap, c->in_len + k) < 0) {
        drop(p, slot);
        return 0;
    }
    memcpy(c->in + c->in_len, p->rbuf, (size_t)k);
    c->in_len += (size_t)k;
    p->buffered += k;
    c->last = now_s();
    Py_ssize_t mark = PyList_GET_SIZE(frames);
    int r = take(p, slot, frames);
    if (r == -1) { /* none of this read's frames is answered */
        if (PyList_SetSlice(frames, mark, PyList_GET_SIZE(frames), NULL) < 0)
            return -2;
        drop(p, slot);
    }
    return r == -2 ? -2 : 0;
}

static int Pump_init(Pump *p, PyObject *args, PyObject *kw)
{
    int pyfd;
    Py_ssize_t max_frame, max_reply;
    if (!PyArg_ParseTuple(args, "inn", &pyfd, &max_frame, &max_reply))
        return -1;
    p->max_frame = (size_t)max_frame;
    p->max_reply = (size_t)max_reply;
    p->ep = epoll_create1(EPOLL_CLOEXEC);
    p->closed = PyList_New(0);
    p->rbuf = PyMem_Malloc(READ_CHUNK);
    if (p->ep < 0 || p->closed == NULL || p->rbuf == NULL) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = PY_SLOT};
    if (epoll_ctl(p->ep, EPOLL_CTL_ADD, pyfd, &ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static PyObject *Pump_close(Pump *p, PyObject *unused)
{
    for (size_t i = 0; i < p->nconns; i++)
        if (p->conns[i] != NULL && p->conns[i]->fd >= 0)
            drop(p, i);
    if (p->ep >= 0)
        close(p->ep);
    p->ep = -1;
    Py_RETURN_NONE;
}

static void Pump_dealloc(Pump *p)
{
    if (p->closed != NULL)
        Pump_close(p, NULL);
    for (size_t i = 0; i < p->nconns; i++)
        PyMem_Free(p->conns[i]);
    PyMem_Free(p->conns);
    PyMem_Free(p->rbuf);
    Py_XDECREF(p->closed);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* adopt(fd, send_key, recv_key, sent, received, unread, unsent) -> id; the descriptor is this file's. */
static PyObject *Pump_adopt(Pump *p, PyObject *args)
{
    int fd;
    Py_buffer ks, kr, in, out;
    unsigned long long sent, received;
    if (!PyArg_ParseTuple(args, "iy*y*KKy*y*", &fd, &ks, &kr, &sent, &received, &in, &out))
        return NULL;
    PyObject *res = NULL;
    size_t slot = 0;
    while (slot < p->nconns && p->conns[slot] != NULL && p->conns[slot]->fd >= 0)
        slot++;
    if (slot == p->nconns) {
        if (p->nconns == p->cap) {
            size_t cap = p->cap ? 2 * p->cap : 64;
            conn_t **a = PyMem_Realloc(p->conns, cap * sizeof *a);
            if (a == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            memset(a + p->cap, 0, (cap - p->cap) * sizeof *a);
            p->conns = a;
            p->cap = cap;
        }
        p->nconns++;
    }
    if (p->conns[slot] == NULL && (p->conns[slot] = PyMem_Calloc(1, sizeof(conn_t))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    conn_t *c = p->conns[slot];
    c->gen++;
    c->maclen = ks.len ? 16 : 0;
    if (ks.len && (mc_b2b_init(&c->ksend, 16, ks.buf, (size_t)ks.len) < 0 ||
                   mc_b2b_init(&c->krecv, 16, kr.buf, (size_t)kr.len) < 0)) {
        PyErr_SetString(PyExc_ValueError, "session keys of 1 to 64 bytes");
        goto done;
    }
    c->sent = sent;
    c->received = received;
    c->writing = 0;
    c->last = now_s();
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = slot};
    if (epoll_ctl(p->ep, EPOLL_CTL_ADD, fd, &ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    c->fd = fd;
    p->open++;
    res = PyLong_FromUnsignedLongLong(cid_of(slot, c));
    if (in.len) { /* bytes read with the handshake: frames now, or the start of one */
        if (reserve(&c->in, &c->in_cap, (size_t)in.len) < 0) {
            drop(p, slot);
            goto done;
        }
        memcpy(c->in, in.buf, (size_t)in.len);
        c->in_len = (size_t)in.len;
        p->buffered += in.len;
    }
    keep(p, slot, out.buf, (size_t)out.len, 0, INT64_MAX);
done:
    PyBuffer_Release(&ks);
    PyBuffer_Release(&kr);
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    return res;
}

/* take_input(id) -> frames: the whole frames among the bytes ``adopt`` was given. */
static PyObject *Pump_take_input(Pump *p, PyObject *arg)
{
    unsigned long long cid = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    PyObject *frames = PyList_New(0);
    conn_t *c = lookup(p, cid);
    if (frames == NULL || c == NULL)
        return frames;
    size_t slot = (size_t)(cid & 0xffffffffu);
    int r = take(p, slot, frames);
    if (r == -2) {
        Py_DECREF(frames);
        return NULL;
    }
    if (r == -1) {
        drop(p, slot);
        PyList_SetSlice(frames, 0, PyList_GET_SIZE(frames), NULL);
    }
    return frames;
}

/* poll(timeout_ms, py_buffered, max_buffered) -> (frames [(id, rid, body)], closed ids, python ready) */
static PyObject *Pump_poll(Pump *p, PyObject *args)
{
    int timeout;
    long long py_buffered, max_buffered;
    if (!PyArg_ParseTuple(args, "iLL", &timeout, &py_buffered, &max_buffered))
        return NULL;
    struct epoll_event evs[MAX_EVENTS];
    int n;
    if (timeout == 0) { /* a spinning poll: no wait, so the GIL is kept */
        n = epoll_wait(p->ep, evs, MAX_EVENTS, 0);
    } else {
        Py_BEGIN_ALLOW_THREADS
        n = epoll_wait(p->ep, evs, MAX_EVENTS, timeout);
        Py_END_ALLOW_THREADS
    }
    if (n < 0 && errno != EINTR)
        return PyErr_SetFromErrno(PyExc_OSError);
    PyObject *frames = PyList_New(0);
    if (frames == NULL)
        return NULL;
    int py_ready = 0;
    for (int i = 0; i < n; i++) {
        uint64_t slot = evs[i].data.u64;
        if (slot == PY_SLOT) {
            py_ready = 1;
            continue;
        }
        if (slot >= p->nconns || p->conns[slot] == NULL || p->conns[slot]->fd < 0)
            continue;
        if (evs[i].events & EPOLLOUT)
            flush(p, slot);
        if (p->conns[slot]->fd >= 0 && evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR) &&
            read_conn(p, slot, frames, py_buffered, max_buffered) == -2) {
            Py_DECREF(frames);
            return NULL;
        }
    }
    PyObject *closed = p->closed;
    p->closed = PyList_New(0);
    if (p->closed == NULL) {
        p->closed = closed;
        Py_DECREF(frames);
        return NULL;
    }
    return Py_BuildValue("(NNO)", frames, closed, py_ready ? Py_True : Py_False);
}

/* send(replies [(id, rid, body)], py_pending, max_pending): seal and send; a run of one connection's
 * replies goes in one sendmsg, what the socket does not take is kept (within the bounds). */
static PyObject *Pump_send(Pump *p, PyObject *args)
{
    PyObject *replies;
    long long py_pending, max_pending;
    if (!PyArg_ParseTuple(args, "O!LL", &PyList_Type, &replies, &py_pending, &max_pending))
        return NULL;
    Py_ssize_t total = PyList_GET_SIZE(replies), i = 0;
    static uint8_t heads[RUN_MAX][HEAD], tags[RUN_MAX][16];
    struct iovec iov[3 * RUN_MAX];
    while (i < total) {
        unsigned long long cid, rid;
        const char *body;
        Py_ssize_t blen;
        PyObject *t = PyList_GET_ITEM(replies, i);
        if (!PyArg_ParseTuple(t, "KKy#", &cid, &rid, &body, &blen))
            return NULL;
        conn_t *c = lookup(p, cid);
        if (c == NULL) { /* closed meanwhile */
            i++;
            continue;
        }
        size_t slot = (size_t)(cid & 0xffffffffu);
        int k = 0;
        for (;;) { /* this reply and the ones of the same connection right after it */
            uint8_t *h = heads[k];
            for (int j = 0; j < 4; j++)
                h[j] = (uint8_t)((uint64_t)blen >> (8 * j));
            for (int j = 0; j < 8; j++)
                h[4 + j] = (uint8_t)(rid >> (8 * j));
            iov[3 * k] = (struct iovec){h, HEAD};
            iov[3 * k + 1] = (struct iovec){(void *)body, (size_t)blen};
            iov[3 * k + 2] = (struct iovec){tags[k], (size_t)c->maclen};
            if (c->maclen) {
                const void *parts[2] = {h, body};
                size_t lens[2] = {HEAD, (size_t)blen};
                mc_b2b_mac(&c->ksend, c->sent++, parts, lens, 2, tags[k]);
            }
            k++;
            i++;
            if (k == RUN_MAX || i == total)
                break;
            t = PyList_GET_ITEM(replies, i);
            unsigned long long next;
            if (!PyArg_ParseTuple(t, "KKy#", &next, &rid, &body, &blen))
                return NULL;
            if (next != cid)
                break;
        }
        size_t done = 0;
        if (c->out_off == c->out_len) {
            struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)(3 * k)};
            ssize_t w;
            do
                w = sendmsg(c->fd, &m, MSG_NOSIGNAL);
            while (w < 0 && errno == EINTR);
            if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
                drop(p, slot);
                continue;
            }
            done = w > 0 ? (size_t)w : 0;
        }
        for (int j = 0; j < 3 * k && c->fd >= 0; j++) { /* the rest, in order, within the bounds */
            size_t len = iov[j].iov_len;
            if (done >= len) {
                done -= len;
                continue;
            }
            if (!keep(p, slot, (uint8_t *)iov[j].iov_base + done, len - done, py_pending, max_pending))
                break;
            done = 0;
        }
    }
    Py_RETURN_NONE;
}

/* close_id(id): close one connection (reported by the next poll). */
static PyObject *Pump_close_id(Pump *p, PyObject *arg)
{
    unsigned long long cid = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    if (lookup(p, cid) != NULL)
        drop(p, (size_t)(cid & 0xffffffffu));
    Py_RETURN_NONE;
}

/* sweep(idle_s): close the connections silent for longer (reported by the next poll). */
static PyObject *Pump_sweep(Pump *p, PyObject *arg)
{
    double idle = PyFloat_AsDouble(arg);
    if (PyErr_Occurred())
        return NULL;
    double now = now_s();
    for (size_t i = 0; i < p->nconns; i++)
        if (p->conns[i] != NULL && p->conns[i]->fd >= 0 && now - p->conns[i]->last > idle)
            drop(p, i);
    Py_RETURN_NONE;
}

/* waiting(id) -> reply bytes not yet sent on that connection (0 when closed). */
static PyObject *Pump_waiting(Pump *p, PyObject *arg)
{
    unsigned long long cid = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    conn_t *c = lookup(p, cid);
    return PyLong_FromSize_t(c != NULL ? c->out_len - c->out_off : 0);
}

static PyObject *Pump_stats(Pump *p, PyObject *unused)
{
    return Py_BuildValue("(nLL)", (Py_ssize_t)p->open, (long long)p->buffered, (long long)p->pending);
}

/* mac(key, seq, data) -> the 16-byte keyed BLAKE2b of seq (u64 LE) | data: the self-test's. */
static PyObject *fl_mac(PyObject *mod, PyObject *args)
{
    Py_buffer key, data;
    unsigned long long seq;
    if (!PyArg_ParseTuple(args, "y*Ky*", &key, &seq, &data))
        return NULL;
    mc_b2b s;
    uint8_t tag[16];
    PyObject *res = NULL;
    if (mc_b2b_init(&s, 16, key.buf, (size_t)key.len) < 0) {
        PyErr_SetString(PyExc_ValueError, "a key of at most 64 bytes");
    } else {
        const void *parts[1] = {data.buf};
        size_t lens[1] = {(size_t)data.len};
        mc_b2b_mac(&s, seq, parts, lens, 1, tag);
        res = PyBytes_FromStringAndSize((const char *)tag, 16);
    }
    PyBuffer_Release(&key);
    PyBuffer_Release(&data);
    return res;
}

static PyObject *fl_nop(PyObject *mod, PyObject *const *args, Py_ssize_t n) { Py_RETURN_NONE; }

static PyMethodDef Pump_methods[] = {
    {"adopt", (PyCFunction)Pump_adopt, METH_VARARGS, "Take over an authenticated connection: its id."},
    {"take_input", (PyCFunction)Pump_take_input, METH_O, "Frames among the bytes adopt was given."},
    {"poll", (PyCFunction)Pump_poll, METH_VARARGS, "Wait, read, cut and check frames."},
    {"send", (PyCFunction)Pump_send, METH_VARARGS, "Seal and send a batch of replies."},
    {"close_id", (PyCFunction)Pump_close_id, METH_O, "Close one connection."},
    {"sweep", (PyCFunction)Pump_sweep, METH_O, "Close the idle connections."},
    {"waiting", (PyCFunction)Pump_waiting, METH_O, "Reply bytes not yet sent on one connection."},
    {"stats", (PyCFunction)Pump_stats, METH_NOARGS, "(connections, buffered input, pending replies)"},
    {"close", (PyCFunction)Pump_close, METH_NOARGS, "Close every connection and the epoll descriptor."},
    {NULL},
};

static PyTypeObject PumpType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "memcache_core.rpc._frameloop.Pump",
    .tp_basicsize = sizeof(Pump),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pump_init,
    .tp_dealloc = (destructor)Pump_dealloc,
    .tp_methods = Pump_methods,
    .tp_doc = "Pump(selector_fd, max_frame, max_reply): the native frame loop of one FrameServer.",
};

static PyMethodDef fl_methods[] = {
    {"mac", fl_mac, METH_VARARGS, "The keyed BLAKE2b-16 of seq | data."},
    {"nop", (PyCFunction)(void (*)(void))fl_nop, METH_FASTCALL, "Nothing: the cost of a call."},
    {NULL},
};

static struct PyModuleDef fl_module = {PyModuleDef_HEAD_INIT, "_frameloop", NULL, -1, fl_methods};

PyMODINIT_FUNC PyInit__frameloop(void)
{
    if (PyType_Ready(&PumpType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&fl_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&PumpType);
    if (PyModule_AddObject(m, "Pump", (PyObject *)&PumpType) < 0) {
        Py_DECREF(&PumpType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
