/* `schedule._python_schedule` compiled: list scheduling of a task graph.
 *
 * Why: a delta simulation of InceptionV3 on 16 devices re-schedules
 * ~16,000 tasks; CPython spends ~0.4 us on each, which caps a search walk
 * near 100 simulations per second. This runs the same steps over the
 * same arrays, so a schedule is bit for bit the one the Python code
 * makes: the same keys (ready time, priority, task id) leave a binary
 * heap in the same order whatever the heap's layout, and every time is
 * the same `max(free, ready) + duration` in IEEE doubles (no fused
 * operations, no reassociation).
 *
 * Optional: `setup.py` builds it when a C compiler is there, and
 * `schedule.py` falls back to the Python code when it is not.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef struct {
    double ready;
    long long prio;
    Py_ssize_t task;
} Key;

typedef struct {
    Key *keys;
    Py_ssize_t size, capacity;
} Heap;

static inline int key_less(const Key *a, const Key *b)
{
    if (a->ready != b->ready)
        return a->ready < b->ready;
    if (a->prio != b->prio)
        return a->prio < b->prio;
    return a->task < b->task;
}

static void sift_down(Heap *h, Py_ssize_t i)
{
    Key item = h->keys[i];
    Py_ssize_t n = h->size;
    for (;;) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= n)
            break;
        if (child + 1 < n && key_less(&h->keys[child + 1], &h->keys[child]))
            child++;
        if (!key_less(&h->keys[child], &item))
            break;
        h->keys[i] = h->keys[child];
        i = child;
    }
    h->keys[i] = item;
}

static int heap_push(Heap *h, Key item)
{
    if (h->size == h->capacity) {
        Py_ssize_t capacity = h->capacity ? 2 * h->capacity : 256;
        Key *keys = PyMem_Realloc(h->keys, capacity * sizeof(Key));
        if (keys == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        h->keys = keys;
        h->capacity = capacity;
    }
    Py_ssize_t i = h->size++;
    while (i > 0) {
        Py_ssize_t parent = (i - 1) / 2;
        if (!key_less(&item, &h->keys[parent]))
            break;
        h->keys[i] = h->keys[parent];
        i = parent;
    }
    h->keys[i] = item;
    return 0;
}

static void heap_pop(Heap *h)
{
    h->keys[0] = h->keys[--h->size];
    if (h->size > 0)
        sift_down(h, 0);
}

static void heap_replace(Heap *h, Key item)
{
    h->keys[0] = item;
    sift_down(h, 0);
}

/* A typed array (array.array, numpy) viewed in place. */
typedef struct {
    Py_buffer view;
    int held;
} Buf;

/* Views `o` as a C-contiguous array of 8-byte items of `kind` ('d':
 * double, 'q': int64) with at least `min_len` items. */
static int get_buf(PyObject *o, Buf *b, char kind, int writable,
                   Py_ssize_t min_len, const char *name)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT;
    if (writable)
        flags |= PyBUF_WRITABLE;
    if (PyObject_GetBuffer(o, &b->view, flags) < 0)
        return -1;
    b->held = 1;
    const char *f = b->view.format ? b->view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    int ok = b->view.itemsize == 8 && f[1] == '\0' &&
             (kind == 'd' ? f[0] == 'd'
                          : (f[0] == 'q' || f[0] == 'l'));
    if (!ok || b->view.len / 8 < min_len) {
        PyErr_Format(PyExc_TypeError,
                     "`%s` must be an array of %s with at least %zd items; "
                     "received format '%s', %zd items",
                     name, kind == 'd' ? "float64" : "int64", min_len,
                     b->view.format ? b->view.format : "B",
                     b->view.len / (b->view.itemsize ? b->view.itemsize : 1));
        return -1;
    }
    return 0;
}

static void release(Buf *b)
{
    if (b->held)
        PyBuffer_Release(&b->view);
    b->held = 0;
}

/* Task id `o` (a Python int) checked against `n`; -1 with an error. */
static inline Py_ssize_t task_id(PyObject *o, Py_ssize_t n)
{
    Py_ssize_t t = PyLong_AsSsize_t(o);
    if (t < 0 || t >= n) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_IndexError, "task id %zd of %zd", t, n);
        return -1;
    }
    return t;
}

/* The resources of task `t`: a tuple of ids below `num_resources`. */
static PyObject *resources(PyObject *resm, Py_ssize_t t,
                           Py_ssize_t num_resources)
{
    PyObject *rs = PyList_GET_ITEM(resm, t);
    if (!PyTuple_Check(rs)) {
        PyErr_Format(PyExc_TypeError, "resources of task %zd: expected a "
                     "tuple, received %s", t, Py_TYPE(rs)->tp_name);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(rs); k++) {
        if (task_id(PyTuple_GET_ITEM(rs, k), num_resources) < 0)
            return NULL;
    }
    return rs;
}

/* 1 with an IndexError if a task's one resource `r` (or -1, -2 - riders)
 * is past the last resource. */
static int bad_resource(long long r, Py_ssize_t num_resources)
{
    if (r < num_resources)
        return 0;
    PyErr_Format(PyExc_IndexError, "resource %lld of %zd", r, num_resources);
    return 1;
}

#define RES(rs, k) PyLong_AsSsize_t(PyTuple_GET_ITEM((rs), (k)))

#define FAIL_IF(cond)  \
    do {               \
        if (cond)      \
            goto fail; \
    } while (0)

static PyObject *schedule(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *dur_o, *res1_o, *resm, *prio_o, *succ, *npred_o, *sources;
    PyObject *end_o, *ready_o, *order_o;
    Py_ssize_t kept, num_resources;
    int bare;
    if (!PyArg_ParseTuple(args, "OOO!OO!OO!OOOnnp", &dur_o, &res1_o,
                          &PyList_Type, &resm, &prio_o, &PyList_Type,
                          &succ, &npred_o, &PyList_Type, &sources, &end_o,
                          &ready_o, &order_o, &kept, &num_resources,
                          &bare))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(succ);
    if (PyList_GET_SIZE(resm) != n || num_resources < 0) {
        PyErr_Format(PyExc_ValueError,
                     "`resm` has %zd tasks and `succ` %zd; "
                     "num_resources=%zd", PyList_GET_SIZE(resm), n,
                     num_resources);
        return NULL;
    }
    Buf bdur = {0}, bres1 = {0}, bprio = {0}, bnpred = {0};
    Buf bend = {0}, bready = {0}, border = {0};
    Heap heap = {NULL, 0, 0};
    long long *count = NULL, *woken = NULL;
    double *free = NULL;
    PyObject *result = NULL;
    FAIL_IF(get_buf(dur_o, &bdur, 'd', 0, n, "dur") < 0);
    FAIL_IF(get_buf(res1_o, &bres1, 'q', 0, n, "res1") < 0);
    FAIL_IF(get_buf(prio_o, &bprio, 'q', 0, n, "prio") < 0);
    FAIL_IF(get_buf(npred_o, &bnpred, 'q', 0, n, "npred") < 0);
    FAIL_IF(get_buf(end_o, &bend, 'd', 1, n, "end") < 0);
    FAIL_IF(get_buf(ready_o, &bready, 'd', 1, n, "ready") < 0);
    FAIL_IF(get_buf(order_o, &border, 'q', 1, kept, "order") < 0);
    const double *dur = bdur.view.buf;
    const long long *res1 = bres1.view.buf, *prio = bprio.view.buf;
    double *end = bend.view.buf, *ready = bready.view.buf;
    long long *order = border.view.buf;
    Py_ssize_t num_order = border.view.len / 8;
    if (kept < 0) {
        PyErr_Format(PyExc_ValueError, "kept=%zd", kept);
        goto fail;
    }
    count = PyMem_Malloc((n + 1) * sizeof(long long));
    free = PyMem_Calloc(num_resources + 1, sizeof(double));
    Py_ssize_t num_sources = PyList_GET_SIZE(sources);
    woken = PyMem_Malloc((num_sources + n + 1) * sizeof(long long));
    if (count == NULL || free == NULL || woken == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    memcpy(count, bnpred.view.buf, n * sizeof(long long));
    Py_ssize_t num_woken = 0;
    for (Py_ssize_t i = 0; i < num_sources; i++) {
        Py_ssize_t t = task_id(PyList_GET_ITEM(sources, i), n);
        FAIL_IF(t < 0);
        woken[num_woken++] = t;
    }

    /* Replay the kept pops: counts, ready times and resource times. */
    for (Py_ssize_t i = 0; i < kept; i++) {
        long long t = order[i];
        if (t < 0 || t >= n) {
            PyErr_Format(PyExc_IndexError, "kept pop %lld of %zd", t, n);
            goto fail;
        }
        double e = end[t];
        count[t] = -1; /* popped: not queued again below */
        long long r = res1[t];
        FAIL_IF(bad_resource(r, num_resources));
        if (r >= 0) {
            free[r] = e;
        } else {
            if (r < -1) { /* riders share the leader's ready time */
                for (long long v = t + 1; v < t - 1 - r && v < n; v++)
                    ready[v] = ready[t];
            }
            PyObject *rs = resources(resm, t, num_resources);
            FAIL_IF(rs == NULL);
            for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(rs); k++)
                free[RES(rs, k)] = e;
        }
        PyObject *next = PyList_GET_ITEM(succ, t);
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(next); k++) {
            Py_ssize_t u = task_id(PyList_GET_ITEM(next, k), n);
            FAIL_IF(u < 0);
            if (e > ready[u])
                ready[u] = e;
            if (--count[u] == 0)
                woken[num_woken++] = u;
        }
    }
    /* No task is woken twice; the popped ones were marked above. */
    for (Py_ssize_t i = 0; i < num_woken; i++) {
        Py_ssize_t u = woken[i];
        if (count[u] == 0) {
            Key key = {ready[u], prio[u], u};
            FAIL_IF(heap_push(&heap, key) < 0);
        }
    }

    /* Pop until none is left (see `schedule._python_loop`). */
    Py_ssize_t pos = kept;
    while (heap.size > 0) {
        Py_ssize_t t = heap.keys[0].task;
        double s = heap.keys[0].ready, e;
        long long r = res1[t];
        FAIL_IF(bad_resource(r, num_resources));
        if (r >= 0) {
            double f = free[r];
            e = (f > s ? f : s) + dur[t];
            free[r] = e;
        } else if (r == -1) {
            PyObject *rs = resources(resm, t, num_resources);
            FAIL_IF(rs == NULL);
            Py_ssize_t m = PyTuple_GET_SIZE(rs);
            for (Py_ssize_t k = 0; k < m; k++) {
                double f = free[RES(rs, k)];
                if (f > s)
                    s = f;
            }
            e = s + dur[t];
            for (Py_ssize_t k = 0; k < m; k++)
                free[RES(rs, k)] = e;
        } else {
            /* A leader and its riders: sinks on one device each, all
             * ready at s (see `schedule._ride`). */
            long long last = t - 2 - r;
            if (last >= n || pos + (last - t) >= num_order) {
                PyErr_SetString(PyExc_IndexError,
                                "riders past the last task");
                goto fail;
            }
            for (long long v = t; v <= last; v++) {
                PyObject *rs = resources(resm, v, num_resources);
                FAIL_IF(rs == NULL);
                if (PyTuple_GET_SIZE(rs) != 1) {
                    PyErr_Format(PyExc_ValueError,
                                 "rider %lld needs one resource", v);
                    goto fail;
                }
                Py_ssize_t q = RES(rs, 0);
                double f = free[q];
                double ev = (f > s ? f : s) + dur[v];
                free[q] = ev;
                end[v] = ev;
                ready[v] = s;
                order[pos++] = v;
            }
            heap_pop(&heap);
            continue;
        }
        if (pos >= num_order) {
            PyErr_Format(PyExc_ValueError,
                         "`order` holds %zd tasks; more are live",
                         num_order);
            goto fail;
        }
        end[t] = e;
        order[pos++] = t;
        int root_free = 1; /* the popped key still sits at the root */
        PyObject *next = PyList_GET_ITEM(succ, t);
        Py_ssize_t num_next = PyList_GET_SIZE(next);
        for (Py_ssize_t k = 0; k < num_next; k++) {
            Py_ssize_t u = task_id(PyList_GET_ITEM(next, k), n);
            FAIL_IF(u < 0);
            if (e > ready[u])
                ready[u] = e;
            if (--count[u] == 0) {
                Key key = {ready[u], prio[u], u};
                if (root_free) {
                    heap_replace(&heap, key);
                    root_free = 0;
                } else {
                    FAIL_IF(heap_push(&heap, key) < 0);
                }
            }
        }
        if (root_free)
            heap_pop(&heap);
    }
    if (pos != num_order) {
        PyErr_Format(PyExc_ValueError,
                     "The task graph has a cycle: %zd of %zd tasks could "
                     "be scheduled.", pos, num_order);
        goto fail;
    }
    double step = 0.0;
    if (bare) { /* dead ids end at 0 */
        for (Py_ssize_t i = 0; i < n; i++)
            if (end[i] > step)
                step = end[i];
    } else { /* see `schedule._python_schedule` */
        for (Py_ssize_t r = 0; r < num_resources; r++)
            if (free[r] > step)
                step = free[r];
    }
    result = PyFloat_FromDouble(step);
fail:
    PyMem_Free(count);
    PyMem_Free(free);
    PyMem_Free(woken);
    PyMem_Free(heap.keys);
    release(&bdur);
    release(&bres1);
    release(&bprio);
    release(&bnpred);
    release(&bend);
    release(&bready);
    release(&border);
    return result;
}

static PyMethodDef methods[] = {
    {"schedule", schedule, METH_VARARGS,
     "schedule(dur, res1, resm, prio, succ, npred, sources, end, ready, "
     "order, kept, num_resources, bare) -> makespan\n\n"
     "`schedule._python_schedule` over typed arrays, in place: replays "
     "order[:kept], then fills order[kept:], end and ready."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_listsched",
    "Compiled list-scheduling loop of flexflow_keras.schedule.", -1, methods,
};

PyMODINIT_FUNC PyInit__listsched(void)
{
    return PyModule_Create(&module);
}
