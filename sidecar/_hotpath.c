/* The compiled per-message hot path: FrameDecoder._parse for the frames of a commit (Append and
 * AppendReply) and parse_copy_data for XLogData.
 *
 * The pure-Python code in sidecar/consensus/codec.py and sidecar/pgrepl.py is the reference. This file
 * takes only the fast path of a well-formed message within every bound; anything else (a bad length, an
 * incomplete frame, another tag, a field out of bounds, a short message) is handed to that reference at
 * the exact point it was reached, so every error is raised by the same code, with the same text.
 * sidecar/hotpath.py selects it; tests/unit/test_hotpath.py runs both on the same inputs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define FRAME_HEADER_SIZE 4
#define TAG_APPEND 'a'
#define TAG_APPEND_REPLY 'A'
#define APPEND_BODY 32       /* term, begin_lsn, commit_lsn, peer_horizon_lsn */
#define APPEND_REPLY_BODY 24 /* term, flush_lsn, commit_lsn */
#define XLOGDATA_HEADER 25   /* 'w', start, wal_end, send_time */

static const uint64_t MAX_TERM = (UINT64_C(1) << 63) - 1;
static const uint64_t MAX_LSN = UINT64_MAX - ((UINT64_C(1) << 30) - 1); /* 2**64 - 2**30 */

/* Bound by configure(): the reference's classes and functions. */
static PyObject *Append, *AppendReply, *XLogData;
static PyObject *py_parse;           /* codec.FrameDecoder._parse */
static PyObject *py_parse_copy_data; /* pgrepl.parse_copy_data */

static PyObject *s_scratch, *s_start, *s_end, *s_max_frame;
static PyObject *s_term, *s_begin_lsn, *s_commit_lsn, *s_peer_horizon_lsn, *s_data, *s_flush_lsn;
static PyObject *s_start_f, *s_wal_end, *s_send_time;
static PyObject *empty_tuple;

static inline uint64_t be64(const unsigned char *p) {
    return ((uint64_t)p[0] << 56) | ((uint64_t)p[1] << 48) | ((uint64_t)p[2] << 40) | ((uint64_t)p[3] << 32) |
           ((uint64_t)p[4] << 24) | ((uint64_t)p[5] << 16) | ((uint64_t)p[6] << 8) | (uint64_t)p[7];
}

static inline uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

/* An instance of a frozen dataclass with these fields set, as its generated __init__ sets them
 * (object.__setattr__), without running that __init__ in the interpreter. Steals the values. */
static PyObject *make(PyObject *cls, int n, PyObject **names, PyObject **values) {
    PyTypeObject *type = (PyTypeObject *)cls;
    PyObject *obj = type->tp_new(type, empty_tuple, NULL);
    int i = 0;
    if (obj != NULL) {
        for (; i < n; i++) {
            if (values[i] == NULL || PyObject_GenericSetAttr(obj, names[i], values[i]) < 0) {
                Py_CLEAR(obj);
                break;
            }
            Py_DECREF(values[i]);
        }
    }
    for (; i < n; i++)
        Py_XDECREF(values[i]);
    return obj;
}

static int get_ssize(PyObject *obj, PyObject *name, Py_ssize_t *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    *out = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int set_ssize(PyObject *obj, PyObject *name, Py_ssize_t value) {
    PyObject *v = PyLong_FromSsize_t(value);
    if (v == NULL)
        return -1;
    int rc = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return rc;
}

/* The message of a whole frame at p (header included) if it is one the fast path takes, else NULL with
 * no error set (the reference decides), or NULL with an error set (memory). */
static PyObject *fast_frame(const unsigned char *p, uint64_t length) {
    unsigned char tag = p[FRAME_HEADER_SIZE];
    const unsigned char *body = p + FRAME_HEADER_SIZE + 1;
    if (tag == TAG_APPEND_REPLY && length == 1 + APPEND_REPLY_BODY) {
        uint64_t term = be64(body), flush = be64(body + 8), commit = be64(body + 16);
        if (term > MAX_TERM || flush > MAX_LSN || commit > MAX_LSN)
            return NULL;
        PyObject *names[3] = {s_term, s_flush_lsn, s_commit_lsn};
        PyObject *values[3] = {PyLong_FromUnsignedLongLong(term), PyLong_FromUnsignedLongLong(flush),
                               PyLong_FromUnsignedLongLong(commit)};
        return make(AppendReply, 3, names, values);
    }
    if (tag == TAG_APPEND && length >= 1 + APPEND_BODY) {
        uint64_t term = be64(body), begin = be64(body + 8), commit = be64(body + 16), horizon = be64(body + 24);
        uint64_t size = length - 1 - APPEND_BODY;
        if (term > MAX_TERM || begin > MAX_LSN || size > MAX_LSN - begin || commit > MAX_LSN || horizon > MAX_LSN)
            return NULL;
        PyObject *names[5] = {s_term, s_begin_lsn, s_commit_lsn, s_peer_horizon_lsn, s_data};
        PyObject *values[5] = {PyLong_FromUnsignedLongLong(term), PyLong_FromUnsignedLongLong(begin),
                               PyLong_FromUnsignedLongLong(commit), PyLong_FromUnsignedLongLong(horizon),
                               PyBytes_FromStringAndSize((const char *)body + APPEND_BODY, (Py_ssize_t)size)};
        return make(Append, 5, names, values);
    }
    return NULL;
}

/* FrameDecoder._parse(self, out): whole frames of the scratch buffer to `out`, from _start to _end. */
static PyObject *parse_frames(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "parse_frames(decoder, out)");
        return NULL;
    }
    PyObject *self = args[0], *out = args[1];
    if (py_parse == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "sidecar._hotpath is not configured");
        return NULL;
    }
    if (!PyList_Check(out))
        return PyObject_CallFunctionObjArgs(py_parse, self, out, NULL);
    Py_ssize_t pos, end, max_frame;
    if (get_ssize(self, s_start, &pos) < 0 || get_ssize(self, s_end, &end) < 0 ||
        get_ssize(self, s_max_frame, &max_frame) < 0)
        return NULL;
    PyObject *scratch = PyObject_GetAttr(self, s_scratch);
    if (scratch == NULL)
        return NULL;
    if (!PyByteArray_CheckExact(scratch) || pos < 0 || end < pos || end > PyByteArray_GET_SIZE(scratch) ||
        max_frame < 0) {
        Py_DECREF(scratch);
        return PyObject_CallFunctionObjArgs(py_parse, self, out, NULL);
    }
    int failed = 0;
    /* The buffer is looked at afresh for every frame: allocating a message may run the garbage collector,
     * and with it any finalizer. */
    while (end - pos >= FRAME_HEADER_SIZE && end <= PyByteArray_GET_SIZE(scratch)) {
        const unsigned char *buf = (const unsigned char *)PyByteArray_AS_STRING(scratch);
        uint64_t length = be32(buf + pos);
        if (length == 0 || length > (uint64_t)max_frame || length > (uint64_t)(end - pos - FRAME_HEADER_SIZE))
            break; /* a bad length or an incomplete frame: the reference rejects or keeps it */
        PyObject *msg = fast_frame(buf + pos, length);
        if (msg == NULL) {
            if (PyErr_Occurred())
                failed = 1;
            break;
        }
        int rc = PyList_Append(out, msg);
        Py_DECREF(msg);
        if (rc < 0) {
            failed = 1;
            break;
        }
        pos += FRAME_HEADER_SIZE + (Py_ssize_t)length;
    }
    Py_DECREF(scratch);
    if (failed) {
        /* As the reference's finally does: what was parsed is consumed. */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (pos == end)
            pos = end = 0;
        if (set_ssize(self, s_start, pos) < 0 || set_ssize(self, s_end, end) < 0)
            PyErr_Clear();
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    if (pos == end) {
        if (set_ssize(self, s_start, 0) < 0 || set_ssize(self, s_end, 0) < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    if (set_ssize(self, s_start, pos) < 0)
        return NULL;
    if (end - pos < FRAME_HEADER_SIZE)
        Py_RETURN_NONE; /* part of a header: the reference would only keep it */
    return PyObject_CallFunctionObjArgs(py_parse, self, out, NULL);
}

/* pgrepl.parse_copy_data(payload) for XLogData; the reference for every other message. */
static PyObject *parse_copy_data(PyObject *module, PyObject *payload) {
    if (py_parse_copy_data == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "sidecar._hotpath is not configured");
        return NULL;
    }
    if (!PyBytes_CheckExact(payload) && !PyByteArray_CheckExact(payload) && !PyMemoryView_Check(payload))
        return PyObject_CallOneArg(py_parse_copy_data, payload);
    Py_buffer view;
    if (PyObject_GetBuffer(payload, &view, PyBUF_FULL_RO) < 0) {
        PyErr_Clear(); /* a released view, say: the reference says what is wrong */
        return PyObject_CallOneArg(py_parse_copy_data, payload);
    }
    /* The reference slices the memoryview by items: take only one-byte items in one contiguous row. */
    if (view.itemsize != 1 || view.ndim != 1 || (view.strides != NULL && view.strides[0] != 1) ||
        (view.format != NULL && strcmp(view.format, "B") != 0) || view.len < XLOGDATA_HEADER ||
        ((const unsigned char *)view.buf)[0] != 'w') {
        PyBuffer_Release(&view);
        return PyObject_CallOneArg(py_parse_copy_data, payload);
    }
    const unsigned char *p = (const unsigned char *)view.buf;
    uint64_t start = be64(p + 1), wal_end = be64(p + 9), send_time = be64(p + 17);
    PyBuffer_Release(&view);
    PyObject *data = NULL, *whole = PyMemoryView_FromObject(payload);
    if (whole != NULL) {
        PyObject *from = PyLong_FromLong(XLOGDATA_HEADER);
        PyObject *slice = from == NULL ? NULL : PySlice_New(from, NULL, NULL);
        Py_XDECREF(from);
        if (slice != NULL) {
            data = PyObject_GetItem(whole, slice);
            Py_DECREF(slice);
        }
        Py_DECREF(whole);
    }
    if (data == NULL)
        return NULL;
    PyObject *names[4] = {s_start_f, s_wal_end, s_send_time, s_data};
    PyObject *values[4] = {PyLong_FromUnsignedLongLong(start), PyLong_FromUnsignedLongLong(wal_end),
                           PyLong_FromUnsignedLongLong(send_time), data};
    return make(XLogData, 4, names, values);
}

static PyObject *configure(PyObject *module, PyObject *args) {
    PyObject *append, *reply, *xlogdata, *parse, *copy_data;
    if (!PyArg_ParseTuple(args, "O!O!O!OO:configure", &PyType_Type, &append, &PyType_Type, &reply, &PyType_Type,
                          &xlogdata, &parse, &copy_data))
        return NULL;
    Py_INCREF(append);
    Py_XSETREF(Append, append);
    Py_INCREF(reply);
    Py_XSETREF(AppendReply, reply);
    Py_INCREF(xlogdata);
    Py_XSETREF(XLogData, xlogdata);
    Py_INCREF(parse);
    Py_XSETREF(py_parse, parse);
    Py_INCREF(copy_data);
    Py_XSETREF(py_parse_copy_data, copy_data);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(Append, AppendReply, XLogData, FrameDecoder._parse, parse_copy_data): bind the reference."},
    {"parse_frames", (PyCFunction)(void (*)(void))parse_frames, METH_FASTCALL,
     "parse_frames(decoder, out): FrameDecoder._parse, compiled for Append and AppendReply."},
    {"parse_copy_data", parse_copy_data, METH_O, "parse_copy_data(payload): pgrepl.parse_copy_data, compiled for XLogData."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "sidecar._hotpath", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__hotpath(void) {
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&s_scratch, "_scratch"}, {&s_start, "_start"}, {&s_end, "_end"}, {&s_max_frame, "max_frame"},
        {&s_term, "term"}, {&s_begin_lsn, "begin_lsn"},
        {&s_commit_lsn, "commit_lsn"}, {&s_peer_horizon_lsn, "peer_horizon_lsn"}, {&s_data, "data"},
        {&s_flush_lsn, "flush_lsn"}, {&s_start_f, "start"}, {&s_wal_end, "wal_end"}, {&s_send_time, "send_time"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].text);
        if (*names[i].slot == NULL)
            return NULL;
    }
    empty_tuple = PyTuple_New(0);
    if (empty_tuple == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    /* parse_frames as a method: an instancemethod binds the decoder as its first argument. */
    PyObject *fn = PyObject_GetAttrString(m, "parse_frames");
    PyObject *method = fn == NULL ? NULL : PyInstanceMethod_New(fn);
    Py_XDECREF(fn);
    if (method == NULL || PyModule_AddObject(m, "parse_frames_method", method) < 0) {
        Py_XDECREF(method);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
