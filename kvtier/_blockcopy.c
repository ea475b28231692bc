/* kvtier._blockcopy: a block's copy into memory no one reads soon, with
 * streaming (non-temporal) stores. See kvtier/blockcopy.py, its only user.
 *
 * A plain memcpy of a 1 MiB block into a cold slot reads each destination
 * line into the cache before writing it (a read for ownership) and evicts
 * other lines to hold it; streaming stores write whole lines straight to
 * memory through the write-combining buffers, with no read of the
 * destination. On x86-64 they are SSE2's (every x86-64 CPU has them); elsewhere
 * the copy is memcpy's.
 *
 * copy(dst, src, 0) is memcpy's, through the caches: for a destination
 * likely cached already and read soon.
 *
 * copy_many(dsts, srcs[, stream[, fault]]) is copy() for each pair of two
 * lists of the same length, with the GIL released once for them all:
 * between two blocks this thread need not win the GIL back from a thread
 * that keeps it busy (each win can wait the interpreter's switch interval,
 * 5 ms). It checks every pair before it copies any, and copies nothing when
 * one does not fit. With fault > 0, each destination is touched first as
 * touch(dst, fault) does (its pages mapped by read faults), in the same
 * stretch without the GIL.
 *
 * Invariants: copy(dst, src[, stream]) leaves the first len(src) bytes of
 * dst equal to src and the rest untouched; it refuses a dst shorter than
 * src; the stores are fenced (sfence) before it returns, so another process
 * that reads dst after a message this one sends next sees them all; a copy
 * of STREAM_MIN bytes or more runs without the GIL.
 *
 * touch(buf, step) reads one byte of buf every step bytes, and its last
 * byte, without the GIL: a shared file's pages mapped into this process
 * (each read fault maps the kernel's fault-around window) while the
 * process's other threads run. It writes nothing.
 *
 * populate(buf) has the kernel allocate every page of buf (a span of a
 * writable shared mapping) and map it writable into this process
 * (Linux's MADV_POPULATE_WRITE, 5.14 on), without the GIL and without
 * changing a byte: True once done, False where the kernel has no such
 * advice (nothing done).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <sys/mman.h>
#include <unistd.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define STREAMING 1
#else
#define STREAMING 0
#endif

/* below this many bytes a copy is memcpy's, with the GIL held: too short
 * for the stores' fence and the GIL's round trip to pay */
#define STREAM_MIN (64 * 1024)

static void
stream_copy(char *dst, const char *src, size_t n)
{
#if STREAMING
    /* the head, up to dst's first 16-byte boundary, is copied plainly */
    size_t head = (size_t)((16 - ((uintptr_t)dst & 15)) & 15);
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
    _mm_sfence();
#else
    memcpy(dst, src, n);
#endif
}

/* read one byte every step bytes of buf, and its last: its pages mapped
 * by read faults (the kernel's fault-around window each); call without the
 * GIL */
static void
touch_span(const char *buf, Py_ssize_t len, Py_ssize_t step)
{
    const volatile char *p = (const volatile char *)buf;
    char sink = 0;
    if (len <= 0)
        return;
    for (Py_ssize_t i = 0; i < len; i += step)
        sink ^= p[i];
    sink ^= p[len - 1];
    (void)sink;
}

static PyObject *
blockcopy_copy(PyObject *module, PyObject *args)
{
    Py_buffer dst, src;
    int stream = 1;
    (void)module;
    if (!PyArg_ParseTuple(args, "w*y*|p:copy", &dst, &src, &stream))
        return NULL;
    if (src.len > dst.len) {
        PyErr_Format(PyExc_ValueError, "a block of %zd bytes does not fit %zd bytes",
                     src.len, dst.len);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    if (src.len >= STREAM_MIN) {
        Py_BEGIN_ALLOW_THREADS
        if (stream)
            stream_copy((char *)dst.buf, (const char *)src.buf, (size_t)src.len);
        else
            memcpy(dst.buf, src.buf, (size_t)src.len);
        Py_END_ALLOW_THREADS
    }
    else {
        memcpy(dst.buf, src.buf, (size_t)src.len);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyObject *
blockcopy_copy_many(PyObject *module, PyObject *args)
{
    PyObject *dsts_arg, *srcs_arg, *dsts = NULL, *srcs = NULL;
    Py_buffer *bufs = NULL;
    Py_ssize_t n = 0, taken = 0, i;
    Py_ssize_t total = 0;
    int stream = 1;
    Py_ssize_t fault = 0;
    PyObject *result = NULL;
    (void)module;
    if (!PyArg_ParseTuple(args, "OO|pn:copy_many", &dsts_arg, &srcs_arg, &stream, &fault))
        return NULL;
    if (fault < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_many needs a fault step of 0 or more bytes");
        return NULL;
    }
    dsts = PySequence_Fast(dsts_arg, "copy_many needs a sequence of destinations");
    if (dsts == NULL)
        goto done;
    srcs = PySequence_Fast(srcs_arg, "copy_many needs a sequence of sources");
    if (srcs == NULL)
        goto done;
    n = PySequence_Fast_GET_SIZE(dsts);
    if (PySequence_Fast_GET_SIZE(srcs) != n) {
        PyErr_SetString(PyExc_ValueError, "copy_many needs one source per destination");
        goto done;
    }
    /* (dst, src) of pair i are bufs[2 * i] and bufs[2 * i + 1] */
    bufs = PyMem_Calloc((size_t)(2 * n + 1), sizeof(Py_buffer));
    if (bufs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(dsts, i), &bufs[2 * i],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        taken = 2 * i + 1;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(srcs, i), &bufs[2 * i + 1],
                               PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        taken = 2 * i + 2;
        if (bufs[2 * i + 1].len > bufs[2 * i].len) {
            PyErr_Format(PyExc_ValueError, "a block of %zd bytes does not fit %zd bytes",
                         bufs[2 * i + 1].len, bufs[2 * i].len);
            goto done;
        }
        total += bufs[2 * i + 1].len;
    }
    if (total >= STREAM_MIN) {
        Py_BEGIN_ALLOW_THREADS
        for (i = 0; i < n; i++) {
            if (fault > 0)
                touch_span((const char *)bufs[2 * i].buf, bufs[2 * i].len, fault);
            if (stream && bufs[2 * i + 1].len >= STREAM_MIN)
                stream_copy((char *)bufs[2 * i].buf, (const char *)bufs[2 * i + 1].buf,
                            (size_t)bufs[2 * i + 1].len);
            else
                memcpy(bufs[2 * i].buf, bufs[2 * i + 1].buf, (size_t)bufs[2 * i + 1].len);
        }
        Py_END_ALLOW_THREADS
    }
    else {
        for (i = 0; i < n; i++)
            memcpy(bufs[2 * i].buf, bufs[2 * i + 1].buf, (size_t)bufs[2 * i + 1].len);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    for (i = 0; i < taken; i++)
        PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    Py_XDECREF(dsts);
    Py_XDECREF(srcs);
    return result;
}

static PyObject *
blockcopy_touch(PyObject *module, PyObject *args)
{
    Py_buffer buf;
    Py_ssize_t step;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*n:touch", &buf, &step))
        return NULL;
    if (step <= 0) {
        PyErr_SetString(PyExc_ValueError, "touch needs a step of at least one byte");
        PyBuffer_Release(&buf);
        return NULL;
    }
    if (buf.len > 0) {
        Py_BEGIN_ALLOW_THREADS
        touch_span((const char *)buf.buf, buf.len, step);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&buf);
    Py_RETURN_NONE;
}

static PyObject *
blockcopy_populate(PyObject *module, PyObject *args)
{
    Py_buffer buf;
    int rc = 0, err = 0;
    (void)module;
    if (!PyArg_ParseTuple(args, "w*:populate", &buf))
        return NULL;
#ifdef __linux__
    if (buf.len > 0) {
        uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
        uintptr_t start = (uintptr_t)buf.buf & ~(page - 1);
        uintptr_t end = ((uintptr_t)buf.buf + (uintptr_t)buf.len + page - 1) & ~(page - 1);
        Py_BEGIN_ALLOW_THREADS
        rc = madvise((void *)start, end - start, MADV_POPULATE_WRITE);
        err = rc ? errno : 0;
        Py_END_ALLOW_THREADS
    }
#else
    rc = -1;
    err = EINVAL; /* no such advice here */
#endif
    PyBuffer_Release(&buf);
    if (rc == 0)
        Py_RETURN_TRUE;
    if (err == EINVAL)
        Py_RETURN_FALSE;
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static PyMethodDef blockcopy_methods[] = {
    {"copy", blockcopy_copy, METH_VARARGS,
     "copy(dst, src, stream=True): src's bytes into the start of dst, with streaming\n"
     "stores unless stream is false."},
    {"copy_many", blockcopy_copy_many, METH_VARARGS,
     "copy_many(dsts, srcs, stream=True, fault=0): copy() of each pair, each destination\n"
     "first touched every fault bytes when fault > 0, the GIL released once."},
    {"touch", blockcopy_touch, METH_VARARGS,
     "touch(buf, step): read a byte of buf every step bytes (and its last), without the GIL."},
    {"populate", blockcopy_populate, METH_VARARGS,
     "populate(buf): every page of buf allocated and mapped writable here; False if unsupported."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef blockcopy_module = {
    PyModuleDef_HEAD_INIT, "kvtier._blockcopy", NULL, -1, blockcopy_methods,
};

PyMODINIT_FUNC
PyInit__blockcopy(void)
{
    PyObject *module = PyModule_Create(&blockcopy_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddIntConstant(module, "STREAMING", STREAMING) < 0 ||
        PyModule_AddIntConstant(module, "STREAM_MIN", STREAM_MIN) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
