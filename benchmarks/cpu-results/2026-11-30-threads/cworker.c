#include <pthread.h>
#include <string.h>
#include <stdint.h>
typedef struct { uint64_t dst, src, n; } Copy;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER, dv = PTHREAD_COND_INITIALIZER;
static Copy *job; static long njob; static long pending = 0, handled = 0; static int started = 0;
static void *run(void *a) {
    pthread_mutex_lock(&mu);
    for (;;) {
        while (pending == handled) pthread_cond_wait(&cv, &mu);
        Copy *c = job; long n = njob;
        pthread_mutex_unlock(&mu);
        for (long i = 0; i < n; i++) memmove((void *)c[i].dst, (void *)c[i].src, c[i].n);
        pthread_mutex_lock(&mu);
        handled = pending;
        pthread_cond_broadcast(&dv);
    }
    return 0;
}
/* hands the copies to the worker and waits for them (called through ctypes: GIL released) */
void copy_on_worker(Copy *c, long n) {
    pthread_mutex_lock(&mu);
    if (!started) { pthread_t t; pthread_create(&t, 0, run, 0); started = 1; }
    job = c; njob = n; long mine = ++pending;
    pthread_cond_signal(&cv);
    while (handled < mine) pthread_cond_wait(&dv, &mu);
    pthread_mutex_unlock(&mu);
}
