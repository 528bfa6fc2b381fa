/* A provider read's events in one C call: the SSE split (agent_server/sse.py's parse_events)
 * and, for the Responses dialect, each event's JSON read (provider.py's parse_event, which
 * every dialect and the gateway call for an event's data, is here on its own too).
 *
 * Every delta a provider streams is its own read, and in Python the steps between the bytes
 * and the event (decode, split lines, partition, join, encode again, the digit scan, orjson's
 * read, the checks, the named tuple) cost several times orjson's read itself. Here they are
 * the same steps on the same values, for the case nearly every read is: no carriage return,
 * every decoded piece valid UTF-8, and every event's data JSON that orjson reads exactly as
 * json does, an object, with no escaped surrogate and not nested deep. Anything else returns
 * None and the Python way, the reference, takes the whole read.
 *
 * setup_sse() and setup_events() hand over, once, what the rules are made of (the two named
 * tuple types, orjson's read and its error, the depth and long-number limits), so that none
 * is spelled twice.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* What the setups were given. */
static PyObject *sse_event, *provider_event, *loads, *decode_error;
static Py_ssize_t max_depth;
/* A run of this many digits may be an integer past 64 bits, which orjson reads as a float
 * where json keeps it exact (trace_reducer's fast_json rule). */
static Py_ssize_t long_number;
static PyObject *s_type;

/* A named tuple of `type` holding the given (stolen) items, made as its _make makes it. */
static PyObject *make(PyObject *type, PyObject *first, PyObject *second, PyObject *third) {
    PyObject *fields = third == NULL ? PyTuple_Pack(2, first, second)
                                     : PyTuple_Pack(3, first, second, third);
    Py_DECREF(first);
    Py_DECREF(second);
    Py_XDECREF(third);
    if (fields == NULL) return NULL;
    PyObject *args = PyTuple_Pack(1, fields);
    Py_DECREF(fields);
    if (args == NULL) return NULL;
    PyObject *made = PyTuple_Type.tp_new((PyTypeObject *)type, args, NULL);
    Py_DECREF(args);
    return made;
}

/* Text from UTF-8 bytes; NULL with no error set when they are not valid UTF-8 (the Python way
 * replaces what is not, so the read is left to it). */
static PyObject *text(const char *bytes, Py_ssize_t size) {
    PyObject *decoded = PyUnicode_DecodeUTF8(bytes, size, "strict");
    if (decoded == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) PyErr_Clear();
    return decoded;
}

/* One dispatched event: its name and its data lines joined with newlines. */
typedef struct {
    const char *name;
    Py_ssize_t name_size;
    const char *data; /* the one data line, or NULL when joined into `joined` */
    Py_ssize_t data_size;
    int lines;
} Pending;

/* The joined data of an event with several `data:` lines. */
typedef struct {
    char *bytes;
    Py_ssize_t size, capacity;
} Joined;

static int join_line(Joined *joined, Pending *pending, const char *line, Py_ssize_t size) {
    if (pending->lines == 0) {
        /* Nearly every event: one data line, used where it lies. */
        pending->data = line;
        pending->data_size = size;
        pending->lines = 1;
        return 0;
    }
    Py_ssize_t kept = pending->lines == 1 ? pending->data_size : joined->size;
    Py_ssize_t need = kept + 1 + size;
    if (need > joined->capacity) {
        char *grown = PyMem_Realloc(joined->bytes, (size_t)need * 2);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        joined->bytes = grown;
        joined->capacity = need * 2;
    }
    if (pending->lines == 1) {
        memcpy(joined->bytes, pending->data, (size_t)pending->data_size);
        pending->data = NULL;
    }
    joined->bytes[kept] = '\n';
    memcpy(joined->bytes + kept + 1, line, (size_t)size);
    joined->size = need;
    pending->lines++;
    return 0;
}

/* What to do with each dispatched event: 0 to go on, 1 to leave the read to Python, -1 on an
 * error. */
typedef int (*Dispatch)(PyObject *out, const char *name, Py_ssize_t name_size, const char *data,
                        Py_ssize_t data_size);

/* The SSE split of block, each event handed to dispatch; 1 when Python must take the read. */
static int split(const char *block, Py_ssize_t size, Dispatch dispatch, PyObject *out) {
    if (memchr(block, '\r', (size_t)size) != NULL) return 1; /* other line endings: Python's */
    Pending pending = {"", 0, NULL, 0, 0};
    Joined joined = {NULL, 0, 0};
    int status = 0;
    const char *end = block + size, *line = block;
    while (status == 0) {
        const char *newline = memchr(line, '\n', (size_t)(end - line));
        const char *stop = newline == NULL ? end : newline;
        Py_ssize_t length = stop - line;
        if (length == 0) {
            if (pending.lines) {
                status = pending.data != NULL
                             ? dispatch(out, pending.name, pending.name_size, pending.data,
                                        pending.data_size)
                             : dispatch(out, pending.name, pending.name_size, joined.bytes,
                                        joined.size);
            }
            pending.name = "";
            pending.name_size = 0;
            pending.lines = 0;
        } else {
            /* field, _, value = line.partition(":"); one space after the colon is dropped. */
            const char *colon = memchr(line, ':', (size_t)length);
            Py_ssize_t field = colon == NULL ? length : colon - line;
            const char *value = colon == NULL ? stop : colon + 1;
            if (value < stop && *value == ' ') value++;
            if (field == 4 && memcmp(line, "data", 4) == 0) {
                status = join_line(&joined, &pending, value, stop - value);
            } else if (field == 5 && memcmp(line, "event", 5) == 0) {
                pending.name = value;
                pending.name_size = stop - value;
            }
        }
        if (newline == NULL) break;
        line = newline + 1;
    }
    if (status == 0 && pending.lines) {
        status = pending.data != NULL
                     ? dispatch(out, pending.name, pending.name_size, pending.data,
                                pending.data_size)
                     : dispatch(out, pending.name, pending.name_size, joined.bytes, joined.size);
    }
    PyMem_Free(joined.bytes);
    return status;
}

static int append(PyObject *out, PyObject *made) {
    if (made == NULL) return -1;
    int failed = PyList_Append(out, made);
    Py_DECREF(made);
    return failed ? -1 : 0;
}

/* An SseEvent(name, data). */
static int sse_dispatch(PyObject *out, const char *name, Py_ssize_t name_size, const char *data,
                        Py_ssize_t data_size) {
    PyObject *event = text(name, name_size);
    if (event == NULL) return PyErr_Occurred() ? -1 : 1;
    PyObject *joined = text(data, data_size);
    if (joined == NULL) {
        Py_DECREF(event);
        return PyErr_Occurred() ? -1 : 1;
    }
    return append(out, make(sse_event, event, joined, NULL));
}

/* Whether an event's data may take the C way: no run of long_number digits (json keeps such an
 * integer exact where orjson would not), no escaped surrogate (it may be a lone one, which the
 * Python way replaces), no more brackets than an event may nest. */
static int plain_data(const char *data, Py_ssize_t size) {
    Py_ssize_t run = 0, brackets = 0;
    for (Py_ssize_t i = 0; i < size; i++) {
        char c = data[i];
        if (c >= '0' && c <= '9') {
            if (++run >= long_number) return 0;
            continue;
        }
        run = 0;
        brackets += (c == '[') | (c == '{');
        if (c == '\\' && i + 2 < size && data[i + 1] == 'u' &&
            (data[i + 2] == 'd' || data[i + 2] == 'D'))
            return 0;
    }
    return brackets <= max_depth;
}

/* ProviderEvent(type, data, raw) of plain data: `json` (bytes or str) read by orjson, `raw` the
 * same text as str, `name` the SSE event's (str; NULL to make it from name_bytes). Steals
 * nothing. NULL with no error set: the Python way must take it. */
static PyObject *provider_event_of(PyObject *json, PyObject *raw, PyObject *name,
                                   const char *name_bytes, Py_ssize_t name_size) {
    PyObject *parsed = PyObject_CallOneArg(loads, json);
    if (parsed == NULL) {
        if (PyErr_ExceptionMatches(decode_error)) PyErr_Clear();
        return NULL;
    }
    if (!PyDict_Check(parsed)) {
        Py_DECREF(parsed);
        return NULL;
    }
    PyObject *type = PyDict_GetItemWithError(parsed, s_type);
    if (type == NULL && PyErr_Occurred()) {
        Py_DECREF(parsed);
        return NULL;
    }
    if (type != NULL && PyUnicode_Check(type)) {
        Py_INCREF(type);
    } else if (name != NULL) {
        type = name;
        Py_INCREF(type);
    } else {
        type = text(name_bytes, name_size);
        if (type == NULL) {
            Py_DECREF(parsed);
            return NULL;
        }
    }
    Py_INCREF(raw);
    return make(provider_event, type, parsed, raw);
}

/* A ProviderEvent for a Responses event of a read; an event whose data is empty carries none
 * and is skipped, as EventBatches skips it. */
static int responses_dispatch(PyObject *out, const char *name, Py_ssize_t name_size,
                              const char *data, Py_ssize_t data_size) {
    if (data_size == 0) return 0;
    if (!plain_data(data, data_size)) return 1;
    PyObject *raw = text(data, data_size);
    if (raw == NULL) return PyErr_Occurred() ? -1 : 1;
    PyObject *bytes = PyBytes_FromStringAndSize(data, data_size);
    if (bytes == NULL) {
        Py_DECREF(raw);
        return -1;
    }
    PyObject *event = provider_event_of(bytes, raw, NULL, name, name_size);
    Py_DECREF(bytes);
    Py_DECREF(raw);
    if (event == NULL) return PyErr_Occurred() ? -1 : 1;
    return append(out, event);
}

static PyObject *run(PyObject *block, Dispatch dispatch, PyObject *type, const char *who) {
    if (type == NULL) {
        PyErr_Format(PyExc_RuntimeError, "_sse_split: %s's setup was not called", who);
        return NULL;
    }
    if (!PyBytes_Check(block)) {
        PyErr_Format(PyExc_TypeError, "%s() takes bytes", who);
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    int status = split(PyBytes_AS_STRING(block), PyBytes_GET_SIZE(block), dispatch, out);
    if (status == 0) return out;
    Py_DECREF(out);
    if (status < 0) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(parse_events_doc,
             "parse_events(block: bytes) -> list[SseEvent] | None\n\n"
             "sse.parse_events(block) for the common case (see _sse_split.c); None for the rest.");

static PyObject *parse_events(PyObject *module, PyObject *block) {
    (void)module;
    return run(block, sse_dispatch, sse_event, "parse_events");
}

PyDoc_STRVAR(responses_events_doc,
             "responses_events(block: bytes) -> list[ProviderEvent] | None\n\n"
             "The Responses dialect's events of a read that ends on an event boundary: "
             "parse_event of each event with data that sse.parse_events finds, for the common "
             "case (see _sse_split.c); None for the rest.");

static PyObject *responses_events(PyObject *module, PyObject *block) {
    (void)module;
    return run(block, responses_dispatch, provider_event, "responses_events");
}

PyDoc_STRVAR(parse_event_doc,
             "parse_event(sse_event: str, raw: str) -> ProviderEvent | None\n\n"
             "provider.parse_event for the common case (see _sse_split.c); None for the rest.");

static PyObject *parse_event(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (provider_event == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_sse_split: parse_event's setup was not called");
        return NULL;
    }
    if (nargs != 2 || !PyUnicode_Check(args[0]) || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "parse_event() takes two str");
        return NULL;
    }
    Py_ssize_t size;
    const char *data = PyUnicode_AsUTF8AndSize(args[1], &size);
    if (data == NULL) {
        /* A lone surrogate has no UTF-8: the Python way replaces it. */
        if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (!plain_data(data, size)) Py_RETURN_NONE;
    PyObject *event = provider_event_of(args[1], args[1], args[0], NULL, 0);
    if (event == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
    return event;
}

static int tuple_type(PyObject *type) {
    if (PyType_Check(type) && PyType_IsSubtype((PyTypeObject *)type, &PyTuple_Type)) return 1;
    PyErr_SetString(PyExc_TypeError, "_sse_split: a named tuple type was expected");
    return 0;
}

PyDoc_STRVAR(setup_sse_doc,
             "setup_sse(sse_event)\n\nWhat parse_events() makes, handed over once by sse.py.");

static PyObject *setup_sse(PyObject *module, PyObject *type) {
    (void)module;
    if (!tuple_type(type)) return NULL;
    Py_INCREF(type);
    Py_XSETREF(sse_event, type);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(setup_events_doc,
             "setup_events(provider_event, loads, decode_error, max_depth, long_number)\n\n"
             "What responses_events() and parse_event() are made of, handed over once by "
             "provider.py.");

static PyObject *setup_events(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "setup_events() takes 5 arguments");
        return NULL;
    }
    if (!tuple_type(args[0])) return NULL;
    Py_ssize_t depth = PyLong_AsSsize_t(args[3]);
    if (depth == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t digits = PyLong_AsSsize_t(args[4]);
    if (digits == -1 && PyErr_Occurred()) return NULL;
    if (digits < 1) {
        PyErr_SetString(PyExc_ValueError, "setup_events(): long_number must be positive");
        return NULL;
    }
    PyObject **slots[3] = {&provider_event, &loads, &decode_error};
    for (int i = 0; i < 3; i++) {
        Py_INCREF(args[i]);
        Py_XSETREF(*slots[i], args[i]);
    }
    max_depth = depth;
    long_number = digits;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"parse_events", parse_events, METH_O, parse_events_doc},
    {"responses_events", responses_events, METH_O, responses_events_doc},
    {"parse_event", (PyCFunction)(void (*)(void))parse_event, METH_FASTCALL, parse_event_doc},
    {"setup_sse", setup_sse, METH_O, setup_sse_doc},
    {"setup_events", (PyCFunction)(void (*)(void))setup_events, METH_FASTCALL, setup_events_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sse_split",
    "A provider read's events in C (see _sse_split.c); sse.py and provider.py are the reference.",
    -1,
    methods,
};

PyMODINIT_FUNC PyInit__sse_split(void) {
    s_type = PyUnicode_InternFromString("type");
    if (s_type == NULL) return NULL;
    return PyModule_Create(&module);
}
