/* A measurement, not a design: a copy thread in C that makes a batch's memmoves without the GIL
 * and takes the GIL once afterwards to run the batch's completion (a Python callable). Built by
 * ab_c_worker.py; see its docstring. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef struct { uint64_t dst, src, n; } Copy;
typedef struct Job { Copy *c; Py_ssize_t n; PyObject *done; struct Job *next; } Job;
typedef struct { PyObject_HEAD pthread_mutex_t mu; pthread_cond_t cv; Job *head, *tail; int started, stop; pthread_t t; } Worker;

static void *run(void *arg) {
    Worker *w = (Worker *)arg;
    for (;;) {
        pthread_mutex_lock(&w->mu);
        while (!w->head && !w->stop) pthread_cond_wait(&w->cv, &w->mu);
        if (!w->head) { pthread_mutex_unlock(&w->mu); return NULL; }
        Job *j = w->head; w->head = j->next; if (!w->head) w->tail = NULL;
        pthread_mutex_unlock(&w->mu);
        for (Py_ssize_t i = 0; i < j->n; i++) memmove((void *)(uintptr_t)j->c[i].dst, (void *)(uintptr_t)j->c[i].src, j->c[i].n);
        PyGILState_STATE g = PyGILState_Ensure();
        PyObject *r = PyObject_CallNoArgs(j->done);
        if (!r) PyErr_Print(); else Py_DECREF(r);
        Py_DECREF(j->done);
        PyGILState_Release(g);
        free(j->c); free(j);
    }
}

static PyObject *submit(Worker *w, PyObject *args) {
    PyObject *triples, *done;
    if (!PyArg_ParseTuple(args, "OO", &triples, &done)) return NULL;
    PyObject *seq = PySequence_Fast(triples, "triples");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Job *j = malloc(sizeof(Job)); j->c = malloc(sizeof(Copy) * (n ? n : 1)); j->n = n; j->next = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        j->c[i].dst = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 0));
        j->c[i].src = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 1));
        j->c[i].n = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 2));
    }
    Py_DECREF(seq);
    Py_INCREF(done); j->done = done;
    pthread_mutex_lock(&w->mu);
    if (!w->started) { pthread_create(&w->t, NULL, run, w); w->started = 1; }
    if (w->tail) w->tail->next = j; else w->head = j;
    w->tail = j;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    Py_RETURN_NONE;
}

static PyObject *wnew(PyTypeObject *tp, PyObject *a, PyObject *k) {
    Worker *w = (Worker *)tp->tp_alloc(tp, 0);
    pthread_mutex_init(&w->mu, NULL); pthread_cond_init(&w->cv, NULL);
    return (PyObject *)w;
}
static PyMethodDef wmethods[] = {{"submit", (PyCFunction)submit, METH_VARARGS, ""}, {NULL}};
static PyTypeObject WorkerType = {PyVarObject_HEAD_INIT(NULL, 0) .tp_name = "cworker_gil.Worker",
    .tp_basicsize = sizeof(Worker), .tp_flags = Py_TPFLAGS_DEFAULT, .tp_new = wnew, .tp_methods = wmethods};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "cworker_gil", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_cworker_gil(void) {
    if (PyType_Ready(&WorkerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&mod);
    Py_INCREF(&WorkerType); PyModule_AddObject(m, "Worker", (PyObject *)&WorkerType);
    return m;
}
