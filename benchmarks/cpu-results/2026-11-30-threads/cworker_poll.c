/* A measurement, not a design: a copy thread in C that makes a batch's memmoves without the GIL and
 * never takes it; the batches it finished are collected by whoever holds the GIL (poll). Built by
 * ab_c_worker_polled.py; see its docstring. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <errno.h>

typedef struct { uint64_t dst, src, n; } Copy;
typedef struct Job { Copy *c; Py_ssize_t n; long long id; struct Job *next; } Job;
typedef struct {
    PyObject_HEAD pthread_mutex_t mu; pthread_cond_t cv, dv;
    Job *head, *tail; long long done[4096]; int ndone; int started; pthread_t t;
} Worker;

static void *run(void *arg) {
    Worker *w = (Worker *)arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->head) pthread_cond_wait(&w->cv, &w->mu);
        Job *j = w->head; w->head = j->next; if (!w->head) w->tail = NULL;
        pthread_mutex_unlock(&w->mu);
        for (Py_ssize_t i = 0; i < j->n; i++) memmove((void *)(uintptr_t)j->c[i].dst, (void *)(uintptr_t)j->c[i].src, j->c[i].n);
        pthread_mutex_lock(&w->mu);
        if (w->ndone < 4096) w->done[w->ndone++] = j->id;
        pthread_cond_broadcast(&w->dv);
        free(j->c); free(j);
    }
    return NULL;
}

static PyObject *submit(Worker *w, PyObject *args) {
    PyObject *triples; long long id;
    if (!PyArg_ParseTuple(args, "OL", &triples, &id)) return NULL;
    PyObject *seq = PySequence_Fast(triples, "triples");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Job *j = malloc(sizeof(Job)); j->c = malloc(sizeof(Copy) * (n ? n : 1)); j->n = n; j->next = NULL; j->id = id;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        j->c[i].dst = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 0));
        j->c[i].src = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 1));
        j->c[i].n = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 2));
    }
    Py_DECREF(seq);
    pthread_mutex_lock(&w->mu);
    if (!w->started) { pthread_create(&w->t, NULL, run, w); w->started = 1; }
    if (w->tail) w->tail->next = j; else w->head = j;
    w->tail = j;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    Py_RETURN_NONE;
}

/* poll(): the ids of the batches finished since the last poll, in order. */
static PyObject *poll(Worker *w, PyObject *unused) {
    if (!w->ndone) return PyTuple_New(0);  /* a hint read without the lock: the next poll finds the rest */
    long long ids[4096]; int n;
    pthread_mutex_lock(&w->mu);  /* held briefly by a thread that never takes the GIL: no need to let it go */
    n = w->ndone; memcpy(ids, w->done, sizeof(long long) * n); w->ndone = 0;
    pthread_mutex_unlock(&w->mu);
    PyObject *out = PyTuple_New(n);
    for (int i = 0; i < n; i++) PyTuple_SET_ITEM(out, i, PyLong_FromLongLong(ids[i]));
    return out;
}

/* wait(seconds): until a batch has finished that no poll collected yet, or the time is up. */
static PyObject *wwait(Worker *w, PyObject *args) {
    double s;
    if (!PyArg_ParseTuple(args, "d", &s)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    struct timespec ts; clock_gettime(CLOCK_REALTIME, &ts);
    long long ns = ts.tv_nsec + (long long)(s * 1e9);
    ts.tv_sec += ns / 1000000000LL; ts.tv_nsec = ns % 1000000000LL;
    pthread_mutex_lock(&w->mu);
    while (!w->ndone) if (pthread_cond_timedwait(&w->dv, &w->mu, &ts) == ETIMEDOUT) break;
    pthread_mutex_unlock(&w->mu);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *wnew(PyTypeObject *tp, PyObject *a, PyObject *k) {
    Worker *w = (Worker *)tp->tp_alloc(tp, 0);
    pthread_mutex_init(&w->mu, NULL); pthread_cond_init(&w->cv, NULL); pthread_cond_init(&w->dv, NULL);
    return (PyObject *)w;
}
static PyMethodDef wmethods[] = {{"submit", (PyCFunction)submit, METH_VARARGS, ""}, {"poll", (PyCFunction)poll, METH_NOARGS, ""},
                                 {"wait", (PyCFunction)wwait, METH_VARARGS, ""}, {NULL}};
static PyTypeObject WorkerType = {PyVarObject_HEAD_INIT(NULL, 0) .tp_name = "cworker_poll.Worker",
    .tp_basicsize = sizeof(Worker), .tp_flags = Py_TPFLAGS_DEFAULT, .tp_new = wnew, .tp_methods = wmethods};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "cworker_poll", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_cworker_poll(void) {
    if (PyType_Ready(&WorkerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&mod);
    Py_INCREF(&WorkerType); PyModule_AddObject(m, "Worker", (PyObject *)&WorkerType);
    return m;
}
