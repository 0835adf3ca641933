#include <pthread.h>
#include <string.h>
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static long pending = 0, handled = 0;
static int started = 0;
static void *run(void *a) {
    pthread_mutex_lock(&mu);
    for (;;) {
        while (pending == handled) pthread_cond_wait(&cv, &mu);
        handled = pending;
    }
    return 0;
}
void poke(void) {
    pthread_mutex_lock(&mu);
    if (!started) { pthread_t t; pthread_create(&t, 0, run, 0); started = 1; }
    pending++;
    pthread_cond_signal(&cv);
    pthread_mutex_unlock(&mu);
}
