/* The bundle reader's frame scanner: frames split, CRC-checked and sorted in one C call a buffer;
 * and the writer's text-delta frame, the one layout the scanner takes whole, made and written in
 * one C call (write_text_delta, at the end).
 *
 * A bundle is mostly text deltas of one item, whose text the reducer rarely needs (the item
 * completes with it whole). Reading them frame by frame in Python costs several hundred
 * nanoseconds each; here a buffer's frames are walked once, and handed back as a few pieces:
 *
 *   (call, first_seq, count, last_time_us, container)   a run of text deltas of one call
 *   (-1, first_seq, count, start, container)            a stretch of any other records
 *
 * `container` is the frames, each after a 0x0A byte: a repeated field 1 whose elements are the
 * frames' bodies, parsed by the Python side in one call.
 *
 * A delta of a run is taken only in the one layout that a parser reads exactly one way:
 *
 *   08 <seq> [10 <time_us>] 5A <n> 08 <call> 12 <m> <text> 7D <crc32c, 4 bytes LE>
 *
 * with n and m spanning exactly to the CRC field and the text valid UTF-8, so its seq, time,
 * call and text are what a parse would find. Any other record joins a stretch once its CRC
 * holds, its first field is the seq expected and its other top-level fields are well formed,
 * with no second seq, no header and no footer among them (plain_record): so a parse of the
 * stretch gives each record the seq read here and no header or footer, and the Python side
 * only parses it, reading it frame by frame when the parse fails or the count is off. The scan
 * stops, for the Python side to read one frame alone, at the header (seq 1), at a CRC that
 * does not hold, at a seq out of order, at a record plain_record refuses (the footer among
 * them) and at a length prefix it does not take; and it stops before a frame not wholly in
 * the buffer.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>

#define MAX_RECORD_BYTES (4u * 1024u * 1024u)
#define CRC_TAG 0x7D
#define CRC_TRAILER 5
#define TAG_SEQ 0x08
#define TAG_TIME 0x10
#define TAG_DELTA 0x5A
#define TAG_CALL 0x08
#define TAG_TEXT 0x12
#define TAG_ITEM 0x18
#define TAG_KIND 0x20
#define CONTAINER_TAG 0x0A
/* TraceRecord's field numbers that a record of a stretch must not hold after its seq. */
#define FIELD_SEQ 1
#define FIELD_HEADER 3
#define FIELD_FOOTER 4

/* -- CRC-32C ---------------------------------------------------------------------------------- */

static uint32_t crc_table[8][256];

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = crc_table[0][n];
        for (int t = 1; t < 8; t++) {
            c = crc_table[0][c & 0xFF] ^ (c >> 8);
            crc_table[t][n] = c;
        }
    }
}

static uint32_t crc_soft(const uint8_t *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    while (n >= 8) {
        uint32_t lo = c ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                           (uint32_t)p[3] << 24);
        uint32_t hi = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 |
                      (uint32_t)p[7] << 24;
        c = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^
            crc_table[5][(lo >> 16) & 0xFF] ^ crc_table[4][lo >> 24] ^
            crc_table[3][hi & 0xFF] ^ crc_table[2][(hi >> 8) & 0xFF] ^
            crc_table[1][(hi >> 16) & 0xFF] ^ crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define HAVE_HW_CRC 1
__attribute__((target("sse4.2"))) static uint32_t crc_hw(const uint8_t *p, size_t n) {
    uint64_t c = 0xFFFFFFFFu;
    while (n >= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        c = _mm_crc32_u64(c, word);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n--) c32 = _mm_crc32_u8(c32, *p++);
    return c32 ^ 0xFFFFFFFFu;
}
#endif

static uint32_t (*crc32c)(const uint8_t *, size_t) = crc_soft;

/* -- field readers ---------------------------------------------------------------------------- */

/* A varint of at most `limit` bytes at *p (before end): its value, *p moved past it; 0 when it
 * is longer or runs past end (then *p is left where it was). */
static int read_varint(const uint8_t **p, const uint8_t *end, int limit, uint64_t *value) {
    const uint8_t *at = *p;
    uint64_t v = 0;
    for (int i = 0; i < limit && at < end; i++, at++) {
        v |= (uint64_t)(*at & 0x7F) << (7 * i);
        if (*at < 0x80) {
            *value = v;
            *p = at + 1;
            return 1;
        }
    }
    return 0;
}

/* Strict UTF-8, as the protobuf runtime checks a string field: no overlong forms, no
 * surrogates, nothing past U+10FFFF. */
static int utf8_ok(const uint8_t *p, const uint8_t *end) {
    while (p < end) {
        uint8_t b = *p;
        if (b < 0x80) {
            p++;
            continue;
        }
        if (b >= 0xC2 && b <= 0xDF) {
            if (end - p < 2 || (p[1] & 0xC0) != 0x80) return 0;
            p += 2;
        } else if (b >= 0xE0 && b <= 0xEF) {
            if (end - p < 3 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80) return 0;
            if (b == 0xE0 && p[1] < 0xA0) return 0;
            if (b == 0xED && p[1] > 0x9F) return 0;
            p += 3;
        } else if (b >= 0xF0 && b <= 0xF4) {
            if (end - p < 4 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 ||
                (p[3] & 0xC0) != 0x80)
                return 0;
            if (b == 0xF0 && p[1] < 0x90) return 0;
            if (b == 0xF4 && p[1] > 0x8F) return 0;
            p += 4;
        } else {
            return 0;
        }
    }
    return 1;
}

/* Whether body (CRC field excluded) is a text delta in the one layout a run takes; its call and
 * time_us when it is. The seq was read already; `at` is just past it. */
static int plain_delta(const uint8_t *at, const uint8_t *end, uint64_t *time_us,
                       uint64_t *call) {
    *time_us = 0;
    if (at < end && *at == TAG_TIME) {
        at++;
        if (!read_varint(&at, end, 9, time_us)) return 0;
    }
    if (at >= end || *at != TAG_DELTA) return 0;
    at++;
    uint64_t n;
    if (!read_varint(&at, end, 3, &n) || n != (uint64_t)(end - at)) return 0;
    if (at >= end || *at != TAG_CALL) return 0;
    at++;
    if (!read_varint(&at, end, 5, call) || *call > 0xFFFFFFFFu) return 0;
    if (at >= end || *at != TAG_TEXT) return 0;
    at++;
    uint64_t m;
    if (!read_varint(&at, end, 3, &m) || m != (uint64_t)(end - at)) return 0;
    return utf8_ok(at, end);
}

/* Whether the fields after a record's seq (from `at` to the CRC field) are well formed, at the
 * top level, none of them a second seq, a header or a footer: then a parse of the record finds
 * the seq the scan read and a body the Python side may take as it comes, without asking each
 * record for its seq and its body's name again. Groups (wire types 3 and 4) are left to it. */
static int plain_record(const uint8_t *at, const uint8_t *end) {
    while (at < end) {
        uint64_t tag, skip;
        if (!read_varint(&at, end, 5, &tag)) return 0;
        uint64_t number = tag >> 3;
        if (number == FIELD_SEQ || number == FIELD_HEADER || number == FIELD_FOOTER || number == 0)
            return 0;
        switch (tag & 7) {
        case 0:
            if (!read_varint(&at, end, 10, &skip)) return 0;
            break;
        case 1:
            if (end - at < 8) return 0;
            at += 8;
            break;
        case 2:
            if (!read_varint(&at, end, 5, &skip) || skip > (uint64_t)(end - at)) return 0;
            at += skip;
            break;
        case 5:
            if (end - at < 4) return 0;
            at += 4;
            break;
        default:
            return 0;
        }
    }
    return 1;
}

/* -- pieces ------------------------------------------------------------------------------------ */

typedef struct {
    Py_ssize_t start;   /* the first frame's offset in the buffer */
    Py_ssize_t end;     /* just past the last frame */
    Py_ssize_t count;
    uint64_t first_seq;
    int64_t call;       /* -1: a stretch of other records */
    uint64_t last_time_us;
} Piece;

/* The piece's frames, each after a 0x0A byte, as one bytes object. */
static PyObject *container(const uint8_t *buffer, const Piece *piece) {
    Py_ssize_t size = piece->end - piece->start + piece->count;
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (out == NULL) return NULL;
    uint8_t *to = (uint8_t *)PyBytes_AS_STRING(out);
    const uint8_t *from = buffer + piece->start;
    const uint8_t *stop = buffer + piece->end;
    while (from < stop) {
        /* Every frame was read whole before it joined the piece. */
        const uint8_t *body = from;
        uint64_t length = 0;
        read_varint(&body, stop, 5, &length);
        Py_ssize_t frame = (Py_ssize_t)(body - from) + (Py_ssize_t)length;
        *to++ = CONTAINER_TAG;
        memcpy(to, from, (size_t)frame);
        to += frame;
        from += frame;
    }
    return out;
}

static int emit(PyObject *pieces, const uint8_t *buffer, const Piece *piece) {
    if (piece->count == 0) return 0;
    PyObject *data = container(buffer, piece);
    if (data == NULL) return -1;
    PyObject *tuple;
    if (piece->call >= 0)
        tuple = Py_BuildValue("(LKnKN)", (long long)piece->call,
                              (unsigned long long)piece->first_seq, piece->count,
                              (unsigned long long)piece->last_time_us, data);
    else
        tuple = Py_BuildValue("(LKnnN)", -1LL, (unsigned long long)piece->first_seq,
                              piece->count, piece->start, data);
    if (tuple == NULL) return -1;
    int failed = PyList_Append(pieces, tuple);
    Py_DECREF(tuple);
    return failed;
}

PyDoc_STRVAR(scan_doc,
             "scan(buffer, pos, next_seq) -> (pieces, pos, next_seq, stopped)\n\n"
             "The frames of buffer from pos on, as pieces (see the module's docstring); where\n"
             "the scan ended and the seq the next frame must have; stopped is True when it\n"
             "ended at a whole frame it does not take (the caller reads that one alone), False\n"
             "at the end of the buffer or before a frame not wholly in it.");

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t pos;
    unsigned long long next_seq_arg;
    if (!PyArg_ParseTuple(args, "y*nK", &view, &pos, &next_seq_arg)) return NULL;
    const uint8_t *buffer = (const uint8_t *)view.buf;
    const uint8_t *end = buffer + view.len;
    uint64_t next_seq = next_seq_arg;
    PyObject *pieces = PyList_New(0);
    if (pieces == NULL || pos < 0 || pos > view.len) {
        if (pieces != NULL) {
            Py_DECREF(pieces);
            PyErr_SetString(PyExc_ValueError, "pos outside the buffer");
        }
        PyBuffer_Release(&view);
        return NULL;
    }
    int stopped = 0;
    Piece piece = {pos, pos, 0, next_seq, -1, 0};

    const uint8_t *at = buffer + pos;
    while (at < end) {
        const uint8_t *body = at;
        uint64_t size;
        if (!read_varint(&body, end, 5, &size)) {
            /* A prefix still coming ends the scan quietly; a bad one is the caller's to name. */
            stopped = (end - at) >= 5;
            break;
        }
        if (size > MAX_RECORD_BYTES) {
            stopped = 1;
            break;
        }
        if ((uint64_t)(end - body) < size) break;
        const uint8_t *frame_end = body + size;
        if (next_seq == 1 || size < CRC_TRAILER + 2 || frame_end[-CRC_TRAILER] != CRC_TAG ||
            body[0] != TAG_SEQ) {
            stopped = 1;
            break;
        }
        const uint8_t *crc_at = frame_end - 4;
        uint32_t stored = (uint32_t)crc_at[0] | (uint32_t)crc_at[1] << 8 |
                          (uint32_t)crc_at[2] << 16 | (uint32_t)crc_at[3] << 24;
        const uint8_t *fields_end = frame_end - CRC_TRAILER;
        if (crc32c(body, (size_t)(fields_end - body)) != stored) {
            stopped = 1;
            break;
        }
        const uint8_t *field = body + 1;
        uint64_t seq;
        if (!read_varint(&field, fields_end, 9, &seq) || seq != next_seq) {
            stopped = 1;
            break;
        }
        uint64_t time_us, call;
        int64_t kind = plain_delta(field, fields_end, &time_us, &call) ? (int64_t)call : -1;
        if (kind < 0 && !plain_record(field, fields_end)) {
            stopped = 1;
            break;
        }
        if (piece.count && piece.call != kind) {
            if (emit(pieces, buffer, &piece) < 0) goto fail;
            piece.start = piece.end;
            piece.count = 0;
            piece.first_seq = seq;
        }
        piece.call = kind;
        piece.count++;
        piece.end = frame_end - buffer;
        piece.last_time_us = time_us;
        next_seq++;
        at = frame_end;
    }
    if (emit(pieces, buffer, &piece) < 0) goto fail;
    PyBuffer_Release(&view);
    return Py_BuildValue("(NnKO)", pieces, (Py_ssize_t)(at - buffer),
                         (unsigned long long)next_seq, stopped ? Py_True : Py_False);
fail:
    Py_DECREF(pieces);
    PyBuffer_Release(&view);
    return NULL;
}

PyDoc_STRVAR(count_doc,
             "count_deltas(buffer) -> int\n\n"
             "How many of buffer's whole frames have a text delta's body tag right after\n"
             "their seq and time fields: the bare walk over the frames, nothing checked, the\n"
             "floor the bench sets the scan beside.");

static PyObject *count_deltas(PyObject *self, PyObject *args) {
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "y*", &view)) return NULL;
    const uint8_t *at = (const uint8_t *)view.buf;
    const uint8_t *end = at + view.len;
    Py_ssize_t count = 0;
    while (at < end) {
        const uint8_t *body = at;
        uint64_t size, value;
        if (!read_varint(&body, end, 5, &size) || (uint64_t)(end - body) < size) break;
        const uint8_t *frame_end = body + size;
        const uint8_t *field = body;
        if (field < frame_end && *field == TAG_SEQ) {
            field++;
            read_varint(&field, frame_end, 10, &value);
        }
        if (field < frame_end && *field == TAG_TIME) {
            field++;
            read_varint(&field, frame_end, 10, &value);
        }
        count += field < frame_end && *field == TAG_DELTA;
        at = frame_end;
    }
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(count);
}

PyDoc_STRVAR(crc_doc,
             "crc32c(data, portable=False) -> int\n\n"
             "The CRC-32C of data, as the scan checks it (portable: the table-driven code used\n"
             "where the CPU has no CRC instruction).");

static PyObject *crc(PyObject *self, PyObject *args) {
    Py_buffer view;
    int portable = 0;
    if (!PyArg_ParseTuple(args, "y*|p", &view, &portable)) return NULL;
    const uint8_t *data = (const uint8_t *)view.buf;
    uint32_t value = portable ? crc_soft(data, (size_t)view.len) : crc32c(data, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(value);
}

/* -- the writer's text-delta frame: the layout the scan takes whole ------------------------ */

/* Writes v as a varint at p; returns the byte after it. */
static uint8_t *put_varint(uint8_t *p, uint64_t v) {
    while (v > 0x7F) {
        *p++ = (uint8_t)(v & 0x7F) | 0x80;
        v >>= 7;
    }
    *p++ = (uint8_t)v;
    return p;
}

static size_t varint_size(uint64_t v) {
    size_t n = 1;
    while (v > 0x7F) {
        v >>= 7;
        n++;
    }
    return n;
}

/* Room for a frame of a short delta on the stack; a longer one is allocated. */
#define STACK_FRAME 512

PyDoc_STRVAR(write_delta_doc,
             "write_text_delta(fd, seq, time_us, call, item, text, kind) -> (written, size)\n\n"
             "Write the frame of TraceRecord(seq, time_us, output_text_delta(call, text, item,\n"
             "kind)) to fd in one write(): byte for byte the frame encode_text_delta makes.\n"
             "Returns the bytes written and the frame's size (fewer written: a short write);\n"
             "OSError when write() fails, UnicodeEncodeError for a lone surrogate in text.\n"
             "The caller keeps each number in its field's range and the record under the\n"
             "size limit.");

static PyObject *write_text_delta(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "write_text_delta takes 7 arguments");
        return NULL;
    }
    long fd = PyLong_AsLong(args[0]);
    unsigned long long seq = PyLong_AsUnsignedLongLong(args[1]);
    unsigned long long time_us = PyLong_AsUnsignedLongLong(args[2]);
    unsigned long long call = PyLong_AsUnsignedLongLong(args[3]);
    unsigned long long item = PyLong_AsUnsignedLongLong(args[4]);
    unsigned long long kind = PyLong_AsUnsignedLongLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (!PyUnicode_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "write_text_delta's text must be a str");
        return NULL;
    }
    /* ASCII text is its own UTF-8; other text is encoded into a bytes object dropped after the
     * write, not cached on the str (which would keep a second copy of every streamed delta). */
    PyObject *encoded = NULL;
    Py_ssize_t text_len;
    const char *text;
    if (PyUnicode_IS_ASCII(args[5])) {
        text = (const char *)PyUnicode_DATA(args[5]);
        text_len = PyUnicode_GET_LENGTH(args[5]);
    } else {
        encoded = PyUnicode_AsUTF8String(args[5]);
        if (encoded == NULL) return NULL;
        text = PyBytes_AS_STRING(encoded);
        text_len = PyBytes_GET_SIZE(encoded);
    }
    /* OutputTextDelta: call (1), delta (2), item (3), kind (4); zero ones left out. */
    size_t body = 0;
    if (call) body += 1 + varint_size(call);
    if (text_len) body += 1 + varint_size((uint64_t)text_len) + (size_t)text_len;
    if (item) body += 1 + varint_size(item);
    if (kind) body += 1 + varint_size(kind);
    /* TraceRecord: seq (1), time_us (2), output_text_delta (11); then the CRC field. */
    size_t record = 1 + varint_size(seq) + (time_us ? 1 + varint_size(time_us) : 0) + 1 +
                    varint_size(body) + body;
    size_t size = record + CRC_TRAILER;
    size_t total = varint_size(size) + size;
    uint8_t stack[STACK_FRAME];
    uint8_t *frame = total <= STACK_FRAME ? stack : PyMem_Malloc(total);
    if (frame == NULL) {
        Py_XDECREF(encoded);
        return PyErr_NoMemory();
    }
    uint8_t *p = put_varint(frame, size);
    uint8_t *start = p;
    *p++ = TAG_SEQ;
    p = put_varint(p, seq);
    if (time_us) {
        *p++ = TAG_TIME;
        p = put_varint(p, time_us);
    }
    *p++ = TAG_DELTA;
    p = put_varint(p, body);
    if (call) {
        *p++ = TAG_CALL;
        p = put_varint(p, call);
    }
    if (text_len) {
        *p++ = TAG_TEXT;
        p = put_varint(p, (uint64_t)text_len);
        memcpy(p, text, (size_t)text_len);
        p += text_len;
    }
    if (item) {
        *p++ = TAG_ITEM;
        p = put_varint(p, item);
    }
    if (kind) {
        *p++ = TAG_KIND;
        p = put_varint(p, kind);
    }
    Py_XDECREF(encoded);
    uint32_t checksum = crc32c(start, (size_t)(p - start));
    *p++ = CRC_TAG;
    *p++ = (uint8_t)checksum;
    *p++ = (uint8_t)(checksum >> 8);
    *p++ = (uint8_t)(checksum >> 16);
    *p++ = (uint8_t)(checksum >> 24);
    ssize_t written;
    int saved;
    /* The GIL is kept, unlike os.write: a write of a few bytes into the page cache takes a
     * microsecond or two, and letting go of the GIL for it once per delta hands it to whichever
     * thread waits (a worker back from an fsync, gRPC's), the event loop then waiting to take it
     * back: P5's p99 was lower with it kept in 13 of 14 paired rounds (the README's lever row).
     * The loop's thread is held up by the write either way. A call a signal interrupted is
     * made again unless the signal's handler raised, as os.write does (PEP 475). */
    do {
        written = write((int)fd, frame, total);
        saved = errno;
    } while (written < 0 && saved == EINTR && PyErr_CheckSignals() == 0);
    if (frame != stack) PyMem_Free(frame);
    if (written < 0) {
        if (PyErr_Occurred()) return NULL;
        errno = saved;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("nn", (Py_ssize_t)written, (Py_ssize_t)total);
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, scan_doc},
    {"count_deltas", count_deltas, METH_VARARGS, count_doc},
    {"crc32c", crc, METH_VARARGS, crc_doc},
    {"write_text_delta", (PyCFunction)(void (*)(void))write_text_delta, METH_FASTCALL,
     write_delta_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_scan",
    "The bundle format in C (see _scan.c): the reader's frame scanner, the writer's delta frame.",
    -1,
    methods,
};

PyMODINIT_FUNC PyInit__scan(void) {
    crc_init();
#ifdef HAVE_HW_CRC
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) crc32c = crc_hw;
#endif
    return PyModule_Create(&module);
}
