/* A minimal fork-join pool: fadev_parallel_for(n_tasks, fn, ctx) runs every task once, on up to
 * fadev_get_num_threads() threads (the calling thread included). Tasks are claimed through an
 * atomic counter; kernels split work into tasks whose boundaries do not depend on the thread count,
 * so results are identical for any number of threads. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "fadev.h"

enum { FADEV_MAX_THREADS = 256 };

static atomic_int configured_threads = 0; /* 0: not yet decided */

static int default_threads(void) {
    const char *env = getenv("FADEV_NUM_THREADS");
    if (env && *env) {
        long n = strtol(env, NULL, 10);
        if (n >= 1 && n <= FADEV_MAX_THREADS) return (int)n;
    }
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (cpus < 1) cpus = 1;
    return cpus > FADEV_MAX_THREADS ? FADEV_MAX_THREADS : (int)cpus;
}

int fadev_get_num_threads(void) {
    int n = atomic_load(&configured_threads);
    if (n == 0) {
        n = default_threads();
        atomic_store(&configured_threads, n);
    }
    return n;
}

fadev_status fadev_set_num_threads(int n) {
    if (n < 1 || n > FADEV_MAX_THREADS) return FADEV_ERR_INVALID_ARGUMENT;
    atomic_store(&configured_threads, n);
    return FADEV_OK;
}

typedef struct pool_job {
    fadev_task_fn fn;
    void *ctx;
    size_t n_tasks;
    atomic_size_t next;
    atomic_int status; /* first failure wins */
} pool_job;

static void *pool_worker(void *arg) {
    pool_job *job = (pool_job *)arg;
    for (;;) {
        size_t task = atomic_fetch_add(&job->next, 1);
        if (task >= job->n_tasks) break;
        fadev_status st = job->fn(job->ctx, task);
        if (st != FADEV_OK) {
            int expected = FADEV_OK;
            atomic_compare_exchange_strong(&job->status, &expected, (int)st);
        }
    }
    return NULL;
}

fadev_status fadev_parallel_for(size_t n_tasks, fadev_task_fn fn, void *ctx) {
    if (n_tasks == 0) return FADEV_OK;
    pool_job job;
    job.fn = fn;
    job.ctx = ctx;
    job.n_tasks = n_tasks;
    atomic_init(&job.next, 0);
    atomic_init(&job.status, FADEV_OK);
    size_t n_threads = (size_t)fadev_get_num_threads();
    if (n_threads > n_tasks) n_threads = n_tasks;
    pthread_t threads[FADEV_MAX_THREADS];
    size_t started = 0;
    for (size_t t = 1; t < n_threads; t++) {
        if (pthread_create(&threads[started], NULL, pool_worker, &job) != 0) break;
        started++;
    }
    pool_worker(&job); /* the caller works too; if no thread started it does everything */
    for (size_t t = 0; t < started; t++) pthread_join(threads[t], NULL);
    return (fadev_status)atomic_load(&job.status);
}
