/* parse_item's common case in one C call: a conversation item's JSON bytes described as the
 * reducer needs them (trace_reducer/reduce/_items.py holds the rules, and the reference).
 *
 * A replay parses every item it meets once; in Python the steps between orjson's read and its
 * sorted write (a normalised copy, a dozen lookups, the content parts) cost several times the
 * two orjson calls themselves. Here they are the same steps, in the same order, on the same
 * values, for the one case nearly every item is: JSON that orjson reads exactly as json does,
 * an object, shallow, whose canonical form holds no `null` (so no NaN or infinity hides in it).
 * Anything else returns None, and _items.parse_item takes it the Python way, which handles
 * every other case (the opaque items, the lone surrogates, the keys that are not JSON text).
 *
 * setup() hands over, once, what the rules are made of (orjson's two calls and their error
 * types, ItemInfo, the role and kind tables, the enum values), so that none is spelled twice.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* What setup() was given. */
static PyObject *loads, *dumps, *decode_error, *encode_error, *sort_option, *item_info;
static PyObject *roles, *kinds, *kind_other, *role_unspecified, *role_tool;
static PyObject *kind_function_call_output, *kind_reasoning;
/* _chat.CHAT_MESSAGE_KEY: how a Chat client spelt a message, left out of the key. */
static PyObject *chat_message_key;
static Py_ssize_t max_depth;
/* A run of this many digits may be an integer past 64 bits, which orjson reads as a float
 * where json keeps it exact (_payloads.fast_json's rule). */
static Py_ssize_t long_number;
static PyObject *option_names; /* ("option",): dumps(value, option=sort_option) */
/* ConversationItem's field numbers and its parts' and timestamp's, from set_item_fields(). */
enum {
    F_ITEM_ID, F_THREAD_ID, F_TURN_ID, F_RESPONSES_ITEM_ID, F_FIRST_SEEN_SEQ, F_PAYLOAD_ID,
    F_ROLE, F_KIND, F_CALL_ID, F_NAME, F_ARGUMENTS, F_OUTPUT, F_CONTENT, F_FIRST_SEEN_AT,
    F_PRODUCED_BY, F_PART_TYPE, F_PART_TEXT, F_SECONDS, F_NANOS, F_COUNT
};
static uint32_t item_field[F_COUNT];
static int item_fields_set;

/* The keys and texts the rules use, interned once. */
static PyObject *s_id, *s_status, *s_type, *s_role, *s_content, *s_text, *s_refusal;
static PyObject *s_summary, *s_call_id, *s_name, *s_arguments, *s_output, *s_message;
static PyObject *s_input_text, *s_output_text, *s_summary_text, *s_empty;

/* dict.get(key): a borrowed reference, or NULL (absent, or an error set). */
static PyObject *get(PyObject *dict, PyObject *key) { return PyDict_GetItemWithError(dict, key); }

/* _items._text: the value when it is a string, else "" (a new reference). */
static PyObject *text_of(PyObject *value) {
    PyObject *text = (value != NULL && PyUnicode_Check(value)) ? value : s_empty;
    Py_INCREF(text);
    return text;
}

/* part.get("text", part.get("refusal")): borrowed, NULL when neither (or an error set). */
static PyObject *part_text(PyObject *part) {
    PyObject *text = get(part, s_text);
    if (text == NULL && !PyErr_Occurred()) text = get(part, s_refusal);
    return text;
}

/* _items._parts: a string is one part of default_type; a list, its dict parts as (type, text)
 * pairs; anything else, no parts. */
static PyObject *parts_of(PyObject *value, PyObject *default_type) {
    if (value != NULL && PyUnicode_Check(value)) {
        PyObject *pair = PyTuple_Pack(2, default_type, value);
        if (pair == NULL) return NULL;
        PyObject *parts = PyTuple_Pack(1, pair);
        Py_DECREF(pair);
        return parts;
    }
    if (value == NULL || !PyList_Check(value)) return PyTuple_New(0);
    PyObject *collected = PyList_New(0);
    if (collected == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(value); i++) {
        PyObject *part = PyList_GET_ITEM(value, i);
        if (!PyDict_Check(part)) continue;
        PyObject *type = get(part, s_type);
        if (type == NULL && PyErr_Occurred()) goto fail;
        PyObject *text = part_text(part);
        if (text == NULL && PyErr_Occurred()) goto fail;
        PyObject *type_text = text_of(type), *text_text = text_of(text);
        PyObject *pair = PyTuple_Pack(2, type_text, text_text);
        Py_DECREF(type_text);
        Py_DECREF(text_text);
        if (pair == NULL) goto fail;
        int appended = PyList_Append(collected, pair);
        Py_DECREF(pair);
        if (appended < 0) goto fail;
    }
    PyObject *parts = PyList_AsTuple(collected);
    Py_DECREF(collected);
    return parts;
fail:
    Py_DECREF(collected);
    return NULL;
}

/* _items._output_text: the string, or the texts of a list's dict parts joined. */
static PyObject *output_of(PyObject *value) {
    if (value == NULL || !PyList_Check(value)) return text_of(value);
    PyObject *texts = PyList_New(0);
    if (texts == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(value); i++) {
        PyObject *part = PyList_GET_ITEM(value, i);
        if (!PyDict_Check(part)) continue;
        PyObject *text = get(part, s_text);
        if (text == NULL && PyErr_Occurred()) goto fail;
        PyObject *piece = text_of(text);
        int appended = PyList_Append(texts, piece);
        Py_DECREF(piece);
        if (appended < 0) goto fail;
    }
    PyObject *joined = PyUnicode_Join(s_empty, texts);
    Py_DECREF(texts);
    return joined;
fail:
    Py_DECREF(texts);
    return NULL;
}

/* Whether value is the string text (ASCII), as Python's value == text is. */
static int is_string(PyObject *value, const char *text) {
    return value != NULL && PyUnicode_Check(value) &&
           PyUnicode_CompareWithASCIIString(value, text) == 0;
}

/* The normalised content: a string as one part of text_type (its role's: output_text for
 * the assistant's, input_text for the rest); a list with each dict part that has a text cut to
 * its type and text (annotations and logprobs are not sent back in), Chat's `text` type as
 * text_type (_items._part_type). */
static PyObject *normalised_content(PyObject *content, PyObject *text_type) {
    if (PyUnicode_Check(content)) {
        PyObject *part = PyDict_New();
        if (part == NULL) return NULL;
        if (PyDict_SetItem(part, s_type, text_type) < 0 ||
            PyDict_SetItem(part, s_text, content) < 0) {
            Py_DECREF(part);
            return NULL;
        }
        PyObject *list = PyList_New(1);
        if (list == NULL) {
            Py_DECREF(part);
            return NULL;
        }
        PyList_SET_ITEM(list, 0, part);
        return list;
    }
    Py_ssize_t count = PyList_GET_SIZE(content);
    PyObject *list = PyList_New(count);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *part = PyList_GET_ITEM(content, i);
        PyObject *text = PyDict_Check(part) ? get(part, s_text) : NULL;
        if (text == NULL && PyErr_Occurred()) goto fail;
        if (text == NULL) {
            Py_INCREF(part);
            PyList_SET_ITEM(list, i, part);
            continue;
        }
        PyObject *type = get(part, s_type);
        if (type == NULL && PyErr_Occurred()) goto fail;
        if (is_string(type, "text")) type = text_type;
        PyObject *cut = PyDict_New();
        if (cut == NULL) goto fail;
        if (PyDict_SetItem(cut, s_type, type != NULL ? type : s_empty) < 0 ||
            PyDict_SetItem(cut, s_text, text) < 0) {
            Py_DECREF(cut);
            goto fail;
        }
        PyList_SET_ITEM(list, i, cut);
    }
    return list;
fail:
    Py_DECREF(list); /* unset slots are NULL, which a list's deallocation skips */
    return NULL;
}

/* Whether `null` occurs in text (memmem is not in every C library). */
static int holds_null(const char *text, Py_ssize_t size) {
    const char *end = text + size;
    while (end - text >= 4) {
        const char *at = memchr(text, 'n', (size_t)(end - text - 3));
        if (at == NULL) return 0;
        if (memcmp(at, "null", 4) == 0) return 1;
        text = at + 1;
    }
    return 0;
}

/* The item's matching key, orjson's sorted form of the normalised copy; None (new reference)
 * when the Python way must decide (orjson cannot write it, or a `null` may be a NaN). */
static PyObject *key_of(PyObject *normalised) {
    PyObject *args[2] = {normalised, sort_option};
    PyObject *key = PyObject_Vectorcall(dumps, args, 1, option_names);
    if (key == NULL) {
        if (!PyErr_ExceptionMatches(encode_error)) return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (!PyBytes_Check(key)) {
        Py_DECREF(key);
        PyErr_SetString(PyExc_TypeError, "dumps returned no bytes");
        return NULL;
    }
    if (holds_null(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key))) {
        Py_DECREF(key);
        Py_RETURN_NONE;
    }
    return key;
}

/* The described item from the parsed object (a dict); None where the Python way decides. */
static PyObject *describe_object(PyObject *parsed) {
    PyObject *normalised = NULL, *key = NULL, *parts = NULL, *fields = NULL, *args = NULL;
    PyObject *result = NULL;
    PyObject *strings[5] = {NULL, NULL, NULL, NULL, NULL}; /* id, call_id, name, args, output */

    normalised = PyDict_Copy(parsed);
    if (normalised == NULL) goto done;
    if (PyDict_DelItem(normalised, s_id) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError)) goto done;
        PyErr_Clear();
    }
    if (PyDict_DelItem(normalised, s_status) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError)) goto done;
        PyErr_Clear();
    }
    /* Was kept: an item a Chat client marked (an SDK's `refusal: null` echoed, a `name`) keyed
     * apart from the one the model made, where the Python way matched them. */
    if (PyDict_DelItem(normalised, chat_message_key) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError)) goto done;
        PyErr_Clear();
    }
    PyObject *item_type = get(parsed, s_type);
    if (item_type == NULL && PyErr_Occurred()) goto done;
    if (item_type == NULL || item_type == Py_None) {
        /* parsed.get("type") is None: absent, or null. */
        int has_role = PyDict_Contains(parsed, s_role);
        if (has_role < 0) goto done;
        if (has_role) {
            /* The short input form {"role", "content"} is a message. */
            item_type = s_message;
            if (PyDict_SetItem(normalised, s_type, item_type) < 0) goto done;
        }
    }
    PyObject *role_value = get(parsed, s_role);
    if (role_value == NULL && PyErr_Occurred()) goto done;
    PyObject *content = get(parsed, s_content);
    if (content == NULL && PyErr_Occurred()) goto done;
    /* Its role's text type, for the key and for a string's shown part alike. */
    PyObject *text_type = is_string(role_value, "assistant") ? s_output_text : s_input_text;
    if (content != NULL && (PyUnicode_Check(content) || PyList_Check(content))) {
        PyObject *cut = normalised_content(content, text_type);
        if (cut == NULL) goto done;
        int set = PyDict_SetItem(normalised, s_content, cut);
        Py_DECREF(cut);
        if (set < 0) goto done;
    }

    PyObject *kind = kind_other;
    if (item_type != NULL && PyUnicode_Check(item_type)) {
        PyObject *found = get(kinds, item_type);
        if (found == NULL && PyErr_Occurred()) goto done;
        if (found != NULL) kind = found;
    }
    PyObject *role = role_unspecified;
    if (role_value != NULL && PyUnicode_Check(role_value)) {
        PyObject *found = get(roles, role_value);
        if (found == NULL && PyErr_Occurred()) goto done;
        if (found != NULL) role = found;
    }
    int unspecified = PyObject_RichCompareBool(role, role_unspecified, Py_EQ);
    if (unspecified < 0) goto done;
    if (unspecified) {
        int is_output = PyObject_RichCompareBool(kind, kind_function_call_output, Py_EQ);
        if (is_output < 0) goto done;
        if (is_output) role = role_tool;
    }
    int reasoning = PyObject_RichCompareBool(kind, kind_reasoning, Py_EQ);
    if (reasoning < 0) goto done;
    if (reasoning) {
        PyObject *summary = get(parsed, s_summary);
        if (summary == NULL && PyErr_Occurred()) goto done;
        parts = parts_of(summary, s_summary_text);
    } else {
        parts = parts_of(content, text_type);
    }
    if (parts == NULL) goto done;

    PyObject *names[4] = {s_id, s_call_id, s_name, s_arguments};
    for (int i = 0; i < 4; i++) {
        PyObject *value = get(parsed, names[i]);
        if (value == NULL && PyErr_Occurred()) goto done;
        strings[i] = text_of(value);
    }
    PyObject *output = get(parsed, s_output);
    if (output == NULL && PyErr_Occurred()) goto done;
    strings[4] = output_of(output);
    if (strings[4] == NULL) goto done;

    key = key_of(normalised);
    if (key == NULL) goto done;
    if (key == Py_None) {
        result = key;
        key = NULL;
        goto done;
    }
    /* ItemInfo(key, responses_item_id, role, kind, content, call_id, name, arguments, output),
     * made as its _make makes it: tuple.__new__ of the class. */
    fields = PyTuple_Pack(9, key, strings[0], role, kind, parts, strings[1], strings[2],
                          strings[3], strings[4]);
    if (fields == NULL) goto done;
    args = PyTuple_Pack(1, fields);
    if (args == NULL) goto done;
    result = PyTuple_Type.tp_new((PyTypeObject *)item_info, args, NULL);
done:
    Py_XDECREF(normalised);
    Py_XDECREF(key);
    Py_XDECREF(parts);
    Py_XDECREF(fields);
    Py_XDECREF(args);
    for (int i = 0; i < 5; i++) Py_XDECREF(strings[i]);
    return result;
}

/* -- an item's message, encoded --------------------------------------------------------------- */

/* A growing byte buffer for one message's encoding. */
typedef struct {
    char *data;
    size_t size, used;
} Out;

static int reserve(Out *out, size_t more) {
    if (out->used + more <= out->size) return 0;
    size_t size = out->size ? out->size : 256;
    while (size < out->used + more) size *= 2;
    char *data = PyMem_Realloc(out->data, size);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    out->data = data;
    out->size = size;
    return 0;
}

static int put_varint(Out *out, uint64_t value) {
    if (reserve(out, 10) < 0) return -1;
    do {
        uint8_t byte = value & 0x7F;
        value >>= 7;
        out->data[out->used++] = (char)(byte | (value ? 0x80 : 0));
    } while (value);
    return 0;
}

static int put_bytes(Out *out, uint32_t field, const char *bytes, Py_ssize_t size) {
    if (put_varint(out, (uint64_t)field << 3 | 2) < 0 || put_varint(out, (uint64_t)size) < 0 ||
        reserve(out, (size_t)size) < 0)
        return -1;
    memcpy(out->data + out->used, bytes, (size_t)size);
    out->used += (size_t)size;
    return 0;
}

/* A string field, left out when empty (as proto3 writes it); 1 when the text is no UTF-8
 * (a lone surrogate): the message library is then left to say what is wrong. */
static int put_string(Out *out, uint32_t field, PyObject *text) {
    if (!PyUnicode_Check(text)) return 1;
    Py_ssize_t size;
    const char *utf8 = PyUnicode_AsUTF8AndSize(text, &size);
    if (utf8 == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) return -1;
        PyErr_Clear();
        return 1;
    }
    return size ? put_bytes(out, field, utf8, size) : 0;
}

/* A varint field (int64 as two's complement, as protobuf writes a negative one), left out
 * when 0; 1 when the value is no int or does not fit. */
static int put_number(Out *out, uint32_t field, PyObject *number) {
    if (!PyLong_Check(number)) return 1;
    int overflow;
    long long value = PyLong_AsLongLongAndOverflow(number, &overflow);
    if (overflow || (value == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 1;
    }
    if (!value) return 0;
    if (put_varint(out, (uint64_t)field << 3) < 0) return -1;
    return put_varint(out, (uint64_t)value);
}

PyDoc_STRVAR(item_wire_doc,
             "item_wire(info, item_id, thread_id, turn_id, responses_item_id, seq, payload_id,\n"
             "          seconds, nanos, producer) -> bytes | None\n\n"
             "The ConversationItem _reducer._new_item makes, encoded (producer: a ProducerRef's\n"
             "bytes, or b'' for none); None when a value is one it leaves to the library.");

static PyObject *item_wire(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "item_wire() takes 10 arguments");
        return NULL;
    }
    if (!item_fields_set) {
        PyErr_SetString(PyExc_RuntimeError, "_describe.set_item_fields() was not called");
        return NULL;
    }
    PyObject *info = args[0];
    if (!PyTuple_Check(info) || PyTuple_GET_SIZE(info) < 9 || !PyBytes_Check(args[9])) Py_RETURN_NONE;
    Out out = {NULL, 0, 0};
    Out part = {NULL, 0, 0};
    PyObject *result = NULL;
    int status = 0;
    /* The fields in the order _new_item sets them (a parse takes them in any order; only the
     * repeated ones keep theirs). */
    struct {
        int field;
        PyObject *value;
        int number;
    } fields[] = {
        {F_ITEM_ID, args[1], 0},
        {F_THREAD_ID, args[2], 0},
        {F_TURN_ID, args[3], 0},
        {F_RESPONSES_ITEM_ID, args[4], 0},
        {F_FIRST_SEEN_SEQ, args[5], 1},
        {F_PAYLOAD_ID, args[6], 0},
        {F_ROLE, PyTuple_GET_ITEM(info, 2), 1},
        {F_KIND, PyTuple_GET_ITEM(info, 3), 1},
        {F_CALL_ID, PyTuple_GET_ITEM(info, 5), 0},
        {F_NAME, PyTuple_GET_ITEM(info, 6), 0},
        {F_ARGUMENTS, PyTuple_GET_ITEM(info, 7), 0},
        {F_OUTPUT, PyTuple_GET_ITEM(info, 8), 0},
    };
    for (size_t i = 0; i < sizeof fields / sizeof fields[0] && !status; i++) {
        uint32_t number = item_field[fields[i].field];
        status = fields[i].number ? put_number(&out, number, fields[i].value)
                                  : put_string(&out, number, fields[i].value);
    }
    PyObject *content = PyTuple_GET_ITEM(info, 4);
    if (!status && !PyTuple_Check(content)) status = 1;
    for (Py_ssize_t i = 0; !status && i < PyTuple_GET_SIZE(content); i++) {
        PyObject *pair = PyTuple_GET_ITEM(content, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            status = 1;
            break;
        }
        part.used = 0;
        status = put_string(&part, item_field[F_PART_TYPE], PyTuple_GET_ITEM(pair, 0));
        if (!status) status = put_string(&part, item_field[F_PART_TEXT], PyTuple_GET_ITEM(pair, 1));
        if (!status) status = put_bytes(&out, item_field[F_CONTENT], part.data ? part.data : "",
                                        (Py_ssize_t)part.used);
    }
    /* The timestamp is always there (setting its fields marks it present, zero or not). */
    if (!status) {
        part.used = 0;
        status = put_number(&part, item_field[F_SECONDS], args[7]);
        if (!status) status = put_number(&part, item_field[F_NANOS], args[8]);
        if (!status) status = put_bytes(&out, item_field[F_FIRST_SEEN_AT],
                                        part.data ? part.data : "", (Py_ssize_t)part.used);
    }
    if (!status && PyBytes_GET_SIZE(args[9]))
        status = put_bytes(&out, item_field[F_PRODUCED_BY], PyBytes_AS_STRING(args[9]),
                           PyBytes_GET_SIZE(args[9]));
    if (status == 0) {
        result = PyBytes_FromStringAndSize(out.data ? out.data : "", (Py_ssize_t)out.used);
    } else if (status > 0) {
        result = Py_None;
        Py_INCREF(result);
    }
    PyMem_Free(out.data);
    PyMem_Free(part.data);
    return result;
}

PyDoc_STRVAR(set_item_fields_doc,
             "set_item_fields(numbers)\n\n"
             "ConversationItem's field numbers for item_wire, in its argument order, then\n"
             "content, first_seen_at, produced_by, ContentPart's type and text, Timestamp's\n"
             "seconds and nanos (see the enum in _describe.c), handed over once by _items.py.");

static PyObject *set_item_fields(PyObject *module, PyObject *numbers) {
    (void)module;
    if (!PyTuple_Check(numbers) || PyTuple_GET_SIZE(numbers) != F_COUNT) {
        PyErr_Format(PyExc_TypeError, "set_item_fields() takes a tuple of %d numbers", F_COUNT);
        return NULL;
    }
    for (int i = 0; i < F_COUNT; i++) {
        long number = PyLong_AsLong(PyTuple_GET_ITEM(numbers, i));
        if (number == -1 && PyErr_Occurred()) return NULL;
        if (number < 1 || number > 536870911) {
            PyErr_SetString(PyExc_ValueError, "a field number is out of range");
            return NULL;
        }
        item_field[i] = (uint32_t)number;
    }
    item_fields_set = 1;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(describe_doc,
             "describe(data: bytes) -> ItemInfo | None\n\n"
             "parse_item(data) for the common case (see _describe.c); None for the rest.");

static PyObject *describe(PyObject *module, PyObject *data) {
    (void)module;
    if (item_info == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_describe.setup() was not called");
        return NULL;
    }
    if (!PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "describe() takes bytes");
        return NULL;
    }
    const unsigned char *bytes = (const unsigned char *)PyBytes_AS_STRING(data);
    Py_ssize_t size = PyBytes_GET_SIZE(data), run = 0, brackets = 0;
    for (Py_ssize_t i = 0; i < size; i++) {
        unsigned char c = bytes[i];
        if (c >= '0' && c <= '9') {
            if (++run >= long_number) Py_RETURN_NONE;
            continue;
        }
        run = 0;
        brackets += (c == '[') | (c == '{');
    }
    /* Nesting past the limit needs more brackets than it: only then may the item be opaque. */
    if (size > max_depth && brackets > max_depth) Py_RETURN_NONE;
    PyObject *parsed = PyObject_CallOneArg(loads, data);
    if (parsed == NULL) {
        if (!PyErr_ExceptionMatches(decode_error)) return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *result;
    if (PyDict_Check(parsed)) {
        result = describe_object(parsed);
    } else {
        result = Py_None;
        Py_INCREF(result);
    }
    Py_DECREF(parsed);
    return result;
}

PyDoc_STRVAR(setup_doc,
             "setup(loads, dumps, decode_error, encode_error, sort_option, item_info, roles, "
             "kinds, kind_other, role_unspecified, role_tool, kind_function_call_output, "
             "kind_reasoning, max_depth, long_number, chat_message_key)\n\n"
             "What describe() is made of, handed over once by _items.py.");

static PyObject *setup(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 16) {
        PyErr_SetString(PyExc_TypeError, "setup() takes 16 arguments");
        return NULL;
    }
    if (!PyType_Check(args[5]) || !PyType_IsSubtype((PyTypeObject *)args[5], &PyTuple_Type) ||
        !PyDict_Check(args[6]) || !PyDict_Check(args[7]) || !PyUnicode_Check(args[15])) {
        PyErr_SetString(PyExc_TypeError,
                        "setup(): item_info a tuple type, roles and kinds dicts, "
                        "chat_message_key a string");
        return NULL;
    }
    Py_ssize_t depth = PyLong_AsSsize_t(args[13]);
    if (depth == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t digits = PyLong_AsSsize_t(args[14]);
    if (digits == -1 && PyErr_Occurred()) return NULL;
    PyObject **slots[13] = {&loads,      &dumps,          &decode_error,
                            &encode_error, &sort_option,  &item_info,
                            &roles,      &kinds,          &kind_other,
                            &role_unspecified, &role_tool, &kind_function_call_output,
                            &kind_reasoning};
    for (int i = 0; i < 13; i++) {
        Py_INCREF(args[i]);
        Py_XSETREF(*slots[i], args[i]);
    }
    Py_INCREF(args[15]);
    Py_XSETREF(chat_message_key, args[15]);
    max_depth = depth;
    long_number = digits;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"describe", describe, METH_O, describe_doc},
    {"setup", (PyCFunction)(void (*)(void))setup, METH_FASTCALL, setup_doc},
    {"item_wire", (PyCFunction)(void (*)(void))item_wire, METH_FASTCALL, item_wire_doc},
    {"set_item_fields", set_item_fields, METH_O, set_item_fields_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_describe",
    "parse_item's common case in C (see _describe.c); _items.parse_item is the reference.",
    -1,
    methods,
};

static int intern(PyObject **slot, const char *text) {
    *slot = PyUnicode_InternFromString(text);
    return *slot == NULL ? -1 : 0;
}

PyMODINIT_FUNC PyInit__describe(void) {
    if (intern(&s_id, "id") < 0 || intern(&s_status, "status") < 0 ||
        intern(&s_type, "type") < 0 || intern(&s_role, "role") < 0 ||
        intern(&s_content, "content") < 0 || intern(&s_text, "text") < 0 ||
        intern(&s_refusal, "refusal") < 0 || intern(&s_summary, "summary") < 0 ||
        intern(&s_call_id, "call_id") < 0 || intern(&s_name, "name") < 0 ||
        intern(&s_arguments, "arguments") < 0 || intern(&s_output, "output") < 0 ||
        intern(&s_message, "message") < 0 || intern(&s_input_text, "input_text") < 0 ||
        intern(&s_output_text, "output_text") < 0 ||
        intern(&s_summary_text, "summary_text") < 0 || intern(&s_empty, "") < 0)
        return NULL;
    /* Interned: orjson tells its keywords apart by identity. */
    PyObject *option = PyUnicode_InternFromString("option");
    if (option == NULL) return NULL;
    option_names = PyTuple_Pack(1, option);
    Py_DECREF(option);
    if (option_names == NULL) return NULL;
    return PyModule_Create(&module);
}
