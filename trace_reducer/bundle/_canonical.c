/* A payload's one JSON encoding in C: the bytes _payloads.canonical_json's reference makes,
 * `json.dumps(value, separators=(",", ":"), sort_keys=True).encode()`, for the values a
 * payload is made of.
 *
 * Every request body and payload the agent records, sends or matches is encoded this way, and
 * a request re-sends the whole history: json's encoder spends most of its time making a str
 * for every piece and joining them (about 4 us an item, 8 ms a request at 1,000 turns). Here
 * the same text is written into one buffer. The rules are json's, step by step:
 *
 * - None, True, False: null, true, false;
 * - an int: int.__repr__; a float: float.__repr__, or NaN, Infinity, -Infinity;
 * - a str: quoted, with `"` and `\` escaped, \b \f \n \r \t as json writes them, every other
 *   character outside space to `~` as \uxxxx in lowercase hex (a character past U+FFFF as its
 *   surrogate pair; a lone surrogate as itself);
 * - a list or tuple: [a,b]; a dict: {"k":v} in the order of its keys sorted as str.
 *
 * Only exact types are taken (json calls a subclass's own methods for some of them), a dict
 * only when every key is a str (json turns other keys into text after sorting them as they
 * are), and nothing nested deeper than MAX_DEPTH; for anything else encode() returns None and
 * the Python reference decides (which raises where json raises).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* Deeper than any payload the agent makes; past it json's own recursion decides. */
#define MAX_DEPTH 200

typedef struct {
    char *data;
    Py_ssize_t size;
    Py_ssize_t capacity;
} Buffer;

/* Room for `more` bytes; 0, or -1 with MemoryError set. */
static int reserve(Buffer *out, Py_ssize_t more) {
    if (out->capacity - out->size >= more) return 0;
    Py_ssize_t capacity = out->capacity ? out->capacity : 256;
    while (capacity - out->size < more) {
        if (capacity > PY_SSIZE_T_MAX / 2) {
            PyErr_NoMemory();
            return -1;
        }
        capacity *= 2;
    }
    char *data = PyMem_Realloc(out->data, (size_t)capacity);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    out->data = data;
    out->capacity = capacity;
    return 0;
}

static int put(Buffer *out, const char *text, Py_ssize_t size) {
    if (reserve(out, size) < 0) return -1;
    memcpy(out->data + out->size, text, (size_t)size);
    out->size += size;
    return 0;
}

static int put_char(Buffer *out, char c) {
    if (reserve(out, 1) < 0) return -1;
    out->data[out->size++] = c;
    return 0;
}

static const char hex[] = "0123456789abcdef";

/* \uxxxx of one UTF-16 code unit. */
static void put_unit(char *at, Py_UCS4 unit) {
    at[0] = '\\';
    at[1] = 'u';
    at[2] = hex[(unit >> 12) & 0xf];
    at[3] = hex[(unit >> 8) & 0xf];
    at[4] = hex[(unit >> 4) & 0xf];
    at[5] = hex[unit & 0xf];
}

/* The escape json writes for a character it does not write as itself, at `at`; returns the
 * end. A character past U+FFFF becomes its surrogate pair. */
static char *put_escape(char *at, Py_UCS4 c) {
    *at++ = '\\';
    switch (c) {
    case '"': *at++ = '"'; return at;
    case '\\': *at++ = '\\'; return at;
    case '\b': *at++ = 'b'; return at;
    case '\f': *at++ = 'f'; return at;
    case '\n': *at++ = 'n'; return at;
    case '\r': *at++ = 'r'; return at;
    case '\t': *at++ = 't'; return at;
    }
    at--; /* put_unit writes its own backslash */
    if (c >= 0x10000) {
        Py_UCS4 v = c - 0x10000;
        put_unit(at, 0xd800 | ((v >> 10) & 0x3ff));
        at += 6;
        c = 0xdc00 | (v & 0x3ff);
    }
    put_unit(at, c);
    return at + 6;
}

/* Whether json writes an ASCII character as itself (space to `~`, but for `"` and `\`). */
static char plain[128];

static void set_plain(void) {
    for (int c = ' '; c <= '~'; c++) plain[c] = 1;
    plain['"'] = 0;
    plain['\\'] = 0;
}

/* A str as json writes it with ensure_ascii: quoted, escaped. */
static int put_string(Buffer *out, PyObject *text) {
    Py_ssize_t length = PyUnicode_GET_LENGTH(text);
    if (PyUnicode_IS_ASCII(text)) {
        /* Most text: runs of plain characters copied whole, at most 6 bytes for any other. */
        const unsigned char *from = PyUnicode_1BYTE_DATA(text);
        const unsigned char *end = from + length;
        if (length > (PY_SSIZE_T_MAX - 2) / 6) {
            PyErr_NoMemory();
            return -1;
        }
        if (reserve(out, 6 * length + 2) < 0) return -1;
        char *at = out->data + out->size;
        *at++ = '"';
        while (from < end) {
            const unsigned char *run = from;
            while (from < end && plain[*from]) from++;
            memcpy(at, run, (size_t)(from - run));
            at += from - run;
            if (from == end) break;
            at = put_escape(at, *from++);
        }
        *at++ = '"';
        out->size = at - out->data;
        return 0;
    }
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    /* At most 12 bytes a character (a surrogate pair), and the quotes. */
    if (length > (PY_SSIZE_T_MAX - 2) / 12) {
        PyErr_NoMemory();
        return -1;
    }
    if (reserve(out, 12 * length + 2) < 0) return -1;
    char *at = out->data + out->size;
    *at++ = '"';
    for (Py_ssize_t i = 0; i < length; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        if (c < 128 && plain[c]) {
            *at++ = (char)c;
        } else {
            at = put_escape(at, c);
        }
    }
    *at++ = '"';
    out->size = at - out->data;
    return 0;
}

/* The ASCII text of a str made by a repr (an int's or a float's). */
static int put_repr(Buffer *out, PyObject *text) {
    if (text == NULL) return -1;
    Py_ssize_t size;
    const char *utf8 = PyUnicode_AsUTF8AndSize(text, &size);
    int result = utf8 == NULL ? -1 : put(out, utf8, size);
    Py_DECREF(text);
    return result;
}

/* 1: written; 0: not a value this encoder takes (nothing of it kept); -1: an error set. */
static int put_value(Buffer *out, PyObject *value, int depth);

static int put_list(Buffer *out, PyObject *sequence, int depth) {
    Py_ssize_t count = PySequence_Fast_GET_SIZE(sequence);
    PyObject **items = PySequence_Fast_ITEMS(sequence);
    if (put_char(out, '[') < 0) return -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i && put_char(out, ',') < 0) return -1;
        int done = put_value(out, items[i], depth + 1);
        if (done <= 0) return done;
    }
    return put_char(out, ']') < 0 ? -1 : 1;
}

typedef struct {
    PyObject *key, *value; /* borrowed: nothing here runs code that could change the dict */
} Entry;

/* Two str keys in code point order, as sorted() puts them; ASCII ones (nearly every key)
 * compared here, any other by PyUnicode_Compare, which cannot fail on two str. */
static int key_order(PyObject *a, PyObject *b) {
    if (PyUnicode_IS_ASCII(a) && PyUnicode_IS_ASCII(b)) {
        Py_ssize_t size_a = PyUnicode_GET_LENGTH(a), size_b = PyUnicode_GET_LENGTH(b);
        int order = memcmp(PyUnicode_1BYTE_DATA(a), PyUnicode_1BYTE_DATA(b),
                           (size_t)(size_a < size_b ? size_a : size_b));
        return order ? order : (size_a > size_b) - (size_a < size_b);
    }
    return PyUnicode_Compare(a, b);
}

/* For qsort: a dict's keys are never equal. */
static int entry_order(const void *a, const void *b) {
    return key_order(((const Entry *)a)->key, ((const Entry *)b)->key);
}

/* Entries up to this many are sorted on the stack, by insertion. */
#define SMALL_DICT 16

static int put_dict(Buffer *out, PyObject *dict, int depth) {
    Py_ssize_t count = PyDict_GET_SIZE(dict);
    if (count == 0) return put(out, "{}", 2) < 0 ? -1 : 1;
    Entry small[SMALL_DICT];
    Entry *entries = small;
    if (count > SMALL_DICT) {
        entries = PyMem_Malloc((size_t)count * sizeof(Entry));
        if (entries == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    int result = 0;
    Py_ssize_t position = 0, taken = 0;
    PyObject *key, *value;
    while (taken < count && PyDict_Next(dict, &position, &key, &value)) {
        if (!PyUnicode_CheckExact(key)) goto done; /* json's rules for other keys */
        Entry entry = {key, value};
        Py_ssize_t at = taken++;
        if (count <= SMALL_DICT) {
            while (at > 0 && key_order(entries[at - 1].key, key) > 0) {
                entries[at] = entries[at - 1];
                at--;
            }
        }
        entries[at] = entry;
    }
    if (count > SMALL_DICT) qsort(entries, (size_t)taken, sizeof(Entry), entry_order);
    result = -1;
    if (put_char(out, '{') < 0) goto done;
    for (Py_ssize_t i = 0; i < taken; i++) {
        if ((i && put_char(out, ',') < 0) || put_string(out, entries[i].key) < 0 ||
            put_char(out, ':') < 0) {
            goto done;
        }
        int done_value = put_value(out, entries[i].value, depth + 1);
        if (done_value <= 0) {
            result = done_value;
            goto done;
        }
    }
    result = put_char(out, '}') < 0 ? -1 : 1;
done:
    if (entries != small) PyMem_Free(entries);
    return result;
}

static int put_value(Buffer *out, PyObject *value, int depth) {
    if (depth > MAX_DEPTH) return 0;
    if (value == Py_None) return put(out, "null", 4) < 0 ? -1 : 1;
    if (value == Py_True) return put(out, "true", 4) < 0 ? -1 : 1;
    if (value == Py_False) return put(out, "false", 5) < 0 ? -1 : 1;
    if (PyUnicode_CheckExact(value)) return put_string(out, value) < 0 ? -1 : 1;
    if (PyLong_CheckExact(value)) return put_repr(out, PyObject_Repr(value)) < 0 ? -1 : 1;
    if (PyFloat_CheckExact(value)) {
        double number = PyFloat_AS_DOUBLE(value);
        if (Py_IS_NAN(number)) return put(out, "NaN", 3) < 0 ? -1 : 1;
        if (Py_IS_INFINITY(number)) {
            return (number > 0 ? put(out, "Infinity", 8) : put(out, "-Infinity", 9)) < 0 ? -1 : 1;
        }
        return put_repr(out, PyObject_Repr(value)) < 0 ? -1 : 1;
    }
    if (PyList_CheckExact(value) || PyTuple_CheckExact(value)) {
        /* A list may be changed by nothing here (no Python code runs), but hold it. */
        Py_INCREF(value);
        int result = put_list(out, value, depth);
        Py_DECREF(value);
        return result;
    }
    if (PyDict_CheckExact(value)) return put_dict(out, value, depth);
    return 0;
}

PyDoc_STRVAR(encode_doc,
             "encode(value, /)\n--\n\n"
             "json.dumps(value, separators=(',', ':'), sort_keys=True).encode() for the values "
             "made of None, bool, int, float, str, list, tuple and dicts with str keys (exact "
             "types, nested no deeper than 200); None for any other value.");

static PyObject *encode(PyObject *module, PyObject *value) {
    Buffer out = {NULL, 0, 0};
    PyObject *result = NULL;
    int done = put_value(&out, value, 0);
    if (done > 0) {
        result = PyBytes_FromStringAndSize(out.data, out.size);
    } else if (done == 0) {
        result = Py_NewRef(Py_None);
    }
    PyMem_Free(out.data);
    return result;
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_O, encode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_canonical",
    "A payload's JSON encoding in C (see _canonical.c): json's bytes, one buffer.",
    -1,
    methods,
};

PyMODINIT_FUNC PyInit__canonical(void) {
    set_plain();
    return PyModule_Create(&module);
}
