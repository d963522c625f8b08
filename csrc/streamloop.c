/* The safekeeper's Append stream in C: sidecar.safekeeper._streamloop.
 *
 * The compiled implementation of the term holder's steady state on one proposer connection
 * (sidecar/safekeeper/streamloop.py chooses it; server.py's converse loop is the Python reference
 * it must match, and tests/unit/safekeeper/test_streamloop.py runs both on the same streams).
 *
 * It receives frames into its own buffer and serves each one that is a plain Append of the term
 * holder: WAL that continues write_lsn inside the segment open for writing. For each, under the
 * acceptor lock, it checks what Acceptor.on_append checks, pwrite()s the data and lets the Python
 * side record it (Safekeeper._wrote_in_place: the acceptor's transition, the positions, the
 * counters). After each frame it asks the same GroupCommit object the reference asks, and on
 * SYNC_NOW calls the reference's own acknowledgement (Safekeeper._acknowledge). Anything else (a
 * frame of another kind, a heartbeat, an Append the checks refuse, one that reaches a segment's
 * end, a field out of bounds, a frame length out of bounds) is handed back unread, with the bytes
 * after it, for the reference to decode and serve: the errors and refusals are the reference's.
 *
 * TLS is the connection's ssl.SSLSocket (its recv_into and pending), so certificates, the
 * handshake and the records stay in Python's ssl module, in this same thread; on a plain
 * socket it calls recv() and poll() itself. Every blocking call drops the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define FRAME_HEADER 4          /* u32 big-endian length of what follows: tag + body */
#define TAG_APPEND 'a'
#define APPEND_HEADER 32        /* term, begin_lsn, commit_lsn, peer_horizon_lsn */
#define MAX_TERM ((uint64_t)INT64_MAX)
#define MAX_LSN (UINT64_C(0xFFFFFFFFFFFFFFFF) - (UINT64_C(1) << 30) + 1)
#define MIN_BUFFER (256 * 1024)

/* What run() returns with, first in its tuple. */
enum { HANDED_BACK = 0, CONDITION = 1, RECEIVE_FAILED = 2 };

static uint64_t be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = (v << 8) | p[i];
    return v;
}

static uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/* Interned attribute and method names. */
static PyObject *s_owner, *s_elected_term, *s_state, *s_term, *s_write_lsn, *s_flush_lsn, *s_append_limit,
    *s_stopped, *s_fatal, *s_reason, *s_acquire, *s_release, *s_acknowledge, *s_wrote_in_place,
    *s_recv_into, *s_pending;

typedef struct {
    unsigned char *buf;
    size_t cap, start, end;
} Buffer;

static int reserve(Buffer *b, size_t need) {
    /* Room for `need` bytes from b->start on: move the unread bytes to the front, grow if needed. */
    if (b->start) {
        memmove(b->buf, b->buf + b->start, b->end - b->start);
        b->end -= b->start;
        b->start = 0;
    }
    if (need <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : MIN_BUFFER;
    while (cap < need) cap *= 2;
    unsigned char *grown = PyMem_Realloc(b->buf, cap);
    if (!grown) {
        PyErr_NoMemory();
        return -1;
    }
    b->buf = grown;
    b->cap = cap;
    return 0;
}

/* A Python int attribute as uint64; -1 with an exception set on failure. */
static int get_u64(PyObject *obj, PyObject *name, uint64_t *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)x;
    return 0;
}

/* 1 if obj.name is None, 0 if not, -1 on error. */
static int attr_is_none(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    int none = v == Py_None;
    Py_DECREF(v);
    return none;
}

static int call_noargs(PyObject *obj, PyObject *name) {
    PyObject *r = PyObject_CallMethodNoArgs(obj, name);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

typedef struct {
    PyObject *server, *session, *link, *commit, *sync_now, *acceptor, *lock, *guard, *sock;
    int fd, tls;
    Py_ssize_t max_frame;
    uint64_t seg_start, seg_end;
    int seg_fd;
} Ctx;

/* 1 while the reference would go on streaming to this connection: it holds the term, the safekeeper
 * has not stopped, and the disk guard is not holding the WAL back; 0 if not; -1 on error. */
static int streaming(Ctx *c) {
    PyObject *owner = PyObject_GetAttr(c->acceptor, s_owner);
    if (!owner) return -1;
    int holds = owner == c->session;
    Py_DECREF(owner);
    if (!holds) return 0;
    int r;
    if ((r = attr_is_none(c->server, s_stopped)) != 1) return r < 0 ? -1 : 0;
    if ((r = attr_is_none(c->server, s_fatal)) != 1) return r < 0 ? -1 : 0;
    if ((r = attr_is_none(c->guard, s_reason)) != 1) return r < 0 ? -1 : 0;
    return 1;
}

/* Input already here, as the reference's Link.more_waiting sees it: a whole frame of a valid length
 * buffered (a message it would have decoded), bytes TLS holds decrypted, or bytes in the socket. */
static int more_waiting(Ctx *c, Buffer *b) {
    size_t have = b->end - b->start;
    if (have >= FRAME_HEADER) {
        uint32_t length = be32(b->buf + b->start);
        if (length && (Py_ssize_t)length <= c->max_frame && have >= FRAME_HEADER + (size_t)length) return 1;
    }
    if (c->tls) {
        PyObject *p = PyObject_CallMethodNoArgs(c->sock, s_pending);
        if (!p) {
            PyErr_Clear();
            return 1; /* the next read reports the connection's end */
        }
        long n = PyLong_AsLong(p);
        Py_DECREF(p);
        if (n == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 1;
        }
        if (n > 0) return 1;
    }
    struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = poll(&pfd, 1, 0);
    Py_END_ALLOW_THREADS
    return r != 0; /* an error: the next read reports it */
}

static int pwrite_all(int fd, const unsigned char *data, size_t n, off_t off) {
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    while (n) {
        ssize_t w = pwrite(fd, data, n, off);
        if (w < 0) {
            if (errno == EINTR) continue;
            err = errno;
            break;
        }
        data += w;
        n -= (size_t)w;
        off += w;
    }
    Py_END_ALLOW_THREADS
    return err;
}

/* The frame at b->start, whole in the buffer: 1 if it was a plain Append and is written and recorded,
 * 0 if it is the reference's to serve (nothing done), -1 on error. */
static int serve_append(Ctx *c, Buffer *b, uint32_t length) {
    const unsigned char *f = b->buf + b->start + FRAME_HEADER;
    if (f[0] != TAG_APPEND || length < 1 + APPEND_HEADER + 1) return 0; /* not an Append, or a heartbeat */
    uint64_t term = be64(f + 1), begin = be64(f + 9), commit = be64(f + 17), horizon = be64(f + 25);
    size_t size = length - 1 - APPEND_HEADER;
    if (term > MAX_TERM || commit > MAX_LSN || horizon > MAX_LSN || begin > MAX_LSN || size > MAX_LSN - begin)
        return 0; /* the reference's decoder says which field */
    uint64_t end = begin + size;
    if (begin < c->seg_start || end >= c->seg_end) return 0; /* another segment, or this one's end */

    PyObject *r = PyObject_CallMethodNoArgs(c->lock, s_acquire);
    if (!r) return -1;
    Py_DECREF(r);
    int served = 0;
    uint64_t elected, state_term, write_lsn, limit;
    PyObject *state = NULL, *owner = NULL;
    if (!(owner = PyObject_GetAttr(c->acceptor, s_owner))) goto fail;
    if (owner != c->session) goto done; /* on_append refuses it: the reference says why */
    if (get_u64(c->acceptor, s_elected_term, &elected) < 0) goto fail;
    if (!(state = PyObject_GetAttr(c->acceptor, s_state))) goto fail;
    if (get_u64(state, s_term, &state_term) < 0) goto fail;
    if (get_u64(c->acceptor, s_write_lsn, &write_lsn) < 0) goto fail;
    if (get_u64(c->acceptor, s_append_limit, &limit) < 0) goto fail;
    if (term != elected || term != state_term || begin != write_lsn || end > limit) goto done;
    int err = pwrite_all(c->seg_fd, f + 1 + APPEND_HEADER, size, (off_t)(begin - c->seg_start));
    if (err) goto done; /* the reference writes it again and reports the failure as it does */
    PyObject *args = Py_BuildValue("(KKKK)", (unsigned long long)begin, (unsigned long long)end,
                                   (unsigned long long)commit, (unsigned long long)horizon);
    if (!args) goto fail;
    PyObject *meth = PyObject_GetAttr(c->server, s_wrote_in_place);
    if (!meth) {
        Py_DECREF(args);
        goto fail;
    }
    r = PyObject_Call(meth, args, NULL);
    Py_DECREF(meth);
    Py_DECREF(args);
    if (!r) goto fail;
    Py_DECREF(r);
    served = 1;
done:
    Py_XDECREF(owner);
    Py_XDECREF(state);
    if (call_noargs(c->lock, s_release) < 0) return -1;
    if (served) b->start += FRAME_HEADER + length;
    return served;
fail:
    Py_XDECREF(owner);
    Py_XDECREF(state);
    {
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyObject *rr = PyObject_CallMethodNoArgs(c->lock, s_release);
        Py_XDECREF(rr);
        PyErr_Restore(t, v, tb);
    }
    return -1;
}

/* GroupCommit.decide as the reference asks it after a message; SYNC_NOW acknowledges. */
static int group_commit(Ctx *c, Buffer *b) {
    uint64_t write_lsn, flush_lsn;
    if (get_u64(c->acceptor, s_write_lsn, &write_lsn) < 0) return -1;
    if (get_u64(c->acceptor, s_flush_lsn, &flush_lsn) < 0) return -1;
    int more = more_waiting(c, b);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    PyObject *d = PyObject_CallMethod(c->commit, "decide", "KKOOd", (unsigned long long)write_lsn,
                                      (unsigned long long)flush_lsn, more ? Py_True : Py_False, Py_False,
                                      (double)ts.tv_sec + ts.tv_nsec / 1e9);
    if (!d) return -1;
    int sync = d == c->sync_now;
    Py_DECREF(d);
    if (!sync) return 0;
    PyObject *r = PyObject_CallMethodObjArgs(c->server, s_acknowledge, c->session, c->link, c->commit, NULL);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* Receive what the socket has into the buffer: bytes received, 0 at the end of the stream, -1 on error. */
static Py_ssize_t receive(Ctx *c, Buffer *b) {
    size_t have = b->end - b->start, need = have + MIN_BUFFER / 4;
    if (have >= FRAME_HEADER) {
        size_t frame = FRAME_HEADER + (size_t)be32(b->buf + b->start);
        if (frame > need) need = frame;
    }
    if (reserve(b, need) < 0) return -1;
    if (c->tls) {
        PyObject *view = PyMemoryView_FromMemory((char *)b->buf + b->end, (Py_ssize_t)(b->cap - b->end), PyBUF_WRITE);
        if (!view) return -1;
        PyObject *n = PyObject_CallMethodOneArg(c->sock, s_recv_into, view);
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyObject *rr = PyObject_CallMethod(view, "release", NULL);
        Py_XDECREF(rr);
        Py_DECREF(view);
        PyErr_Restore(t, v, tb);
        if (!n) return -1;
        Py_ssize_t got = PyLong_AsSsize_t(n);
        Py_DECREF(n);
        if (got < 0) return -1;
        b->end += (size_t)got;
        return got;
    }
    for (;;) {
        ssize_t got;
        Py_BEGIN_ALLOW_THREADS
        got = recv(c->fd, b->buf + b->end, b->cap - b->end, 0);
        Py_END_ALLOW_THREADS
        if (got >= 0) {
            b->end += (size_t)got;
            return got;
        }
        if (errno == EINTR) {
            if (PyErr_CheckSignals() < 0) return -1;
            continue;
        }
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
}

static PyObject *rest(Buffer *b) {
    return PyBytes_FromStringAndSize((const char *)b->buf + b->start, (Py_ssize_t)(b->end - b->start));
}

PyDoc_STRVAR(run_doc,
"run(server, session, link, commit, sync_now, acceptor, lock, guard, sock, tls, span, initial, max_frame)\n"
"-> (code, rest, end)\n\n"
"Serve the term holder's plain Appends in the segment `span` (fd, first LSN, end LSN) from `initial`\n"
"(bytes already received) and the socket on. `rest` is what was received and not served. code 0:\n"
"`rest` starts with a frame the reference must serve, or `end` is True (the peer closed); code 1:\n"
"the connection no longer streams here (the term, a stop, the disk guard); code 2: the receive\n"
"failed and `end` is its exception.");

static PyObject *run(PyObject *self, PyObject *args) {
    Ctx c = {0};
    PyObject *span, *initial;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOpOSn", &c.server, &c.session, &c.link, &c.commit, &c.sync_now,
                          &c.acceptor, &c.lock, &c.guard, &c.sock, &c.tls, &span, &initial, &c.max_frame))
        return NULL;
    unsigned long long seg_start, seg_end;
    if (!PyArg_ParseTuple(span, "iKK", &c.seg_fd, &seg_start, &seg_end)) return NULL;
    c.seg_start = seg_start;
    c.seg_end = seg_end;
    PyObject *fileno = PyObject_CallMethod(c.sock, "fileno", NULL);
    if (!fileno) return NULL;
    c.fd = (int)PyLong_AsLong(fileno);
    Py_DECREF(fileno);
    if (c.fd < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_OSError, "the connection's socket is closed");
        return NULL;
    }

    Buffer b = {0};
    Py_ssize_t init_len = PyBytes_GET_SIZE(initial);
    if (reserve(&b, (size_t)init_len + MIN_BUFFER / 4) < 0) return NULL;
    memcpy(b.buf, PyBytes_AS_STRING(initial), (size_t)init_len);
    b.end = (size_t)init_len;

    int code = HANDED_BACK, eof = 0;
    PyObject *failure = NULL;
    for (;;) {
        int s = streaming(&c);
        if (s < 0) goto error;
        if (!s) {
            code = CONDITION;
            break;
        }
        size_t have = b.end - b.start;
        if (have >= FRAME_HEADER) {
            uint32_t length = be32(b.buf + b.start);
            if (length == 0 || (Py_ssize_t)length > c.max_frame) break; /* the reference's decoder refuses it */
            if (have >= FRAME_HEADER + (size_t)length) {
                int served = serve_append(&c, &b, length);
                if (served < 0) goto error;
                if (!served) break;
                if (group_commit(&c, &b) < 0) goto error;
                continue;
            }
        }
        Py_ssize_t got = receive(&c, &b);
        if (got < 0) {
            /* The link's end, not a failure of this loop: the reference's Link says which. */
            PyObject *t, *tb;
            PyErr_Fetch(&t, &failure, &tb);
            PyErr_NormalizeException(&t, &failure, &tb);
            if (tb) PyException_SetTraceback(failure, tb);
            Py_XDECREF(t);
            Py_XDECREF(tb);
            code = RECEIVE_FAILED;
            break;
        }
        if (got == 0) {
            eof = 1;
            break;
        }
    }
    PyObject *out = rest(&b);
    PyMem_Free(b.buf);
    if (!out) {
        Py_XDECREF(failure);
        return NULL;
    }
    if (failure) return Py_BuildValue("(iNN)", code, out, failure);
    return Py_BuildValue("(iNO)", code, out, eof ? Py_True : Py_False);
error:
    PyMem_Free(b.buf);
    return NULL;
}

static PyMethodDef methods[] = {
    {"run", run, METH_VARARGS, run_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "sidecar.safekeeper._streamloop",
    "The safekeeper's Append stream, compiled (see sidecar/safekeeper/streamloop.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__streamloop(void) {
#define INTERN(var, text) if (!(var = PyUnicode_InternFromString(text))) return NULL
    INTERN(s_owner, "owner");
    INTERN(s_elected_term, "elected_term");
    INTERN(s_state, "state");
    INTERN(s_term, "term");
    INTERN(s_write_lsn, "write_lsn");
    INTERN(s_flush_lsn, "flush_lsn");
    INTERN(s_append_limit, "append_limit");
    INTERN(s_stopped, "stopped");
    INTERN(s_fatal, "fatal");
    INTERN(s_reason, "reason");
    INTERN(s_acquire, "acquire");
    INTERN(s_release, "release");
    INTERN(s_acknowledge, "_acknowledge");
    INTERN(s_wrote_in_place, "_wrote_in_place");
    INTERN(s_recv_into, "recv_into");
    INTERN(s_pending, "pending");
#undef INTERN
    return PyModule_Create(&module);
}
