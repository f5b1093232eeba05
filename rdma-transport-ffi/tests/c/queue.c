/* C test of the asynchronous API (rt_queue_*) against a running cluster.
 *
 *   queue <coordinator-url> <bytes> <cluster-key-file> [interleaved]
 *
 * Poll mode with 32 reads kept in flight, eventfd mode with poll(2) on the
 * eventfd, callback mode, a batch of more than 64 pages, bad arguments, a
 * read of an unknown address, destroying queues with requests in flight
 * and a queue that outlives its manager; the content of every page read
 * is checked. With "interleaved", only large batches whose every window
 * spans both nodes, 20 times. Prints "c queue: ok" and exits 0 on success. */
#define _POSIX_C_SOURCE 200809L

#include "rdma_transport.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PAGE 4096u

#define CHECK(call)                                                          \
  do {                                                                       \
    RtStatus st_ = (call);                                                   \
    if (st_ != RT_STATUS_OK) {                                               \
      fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call,     \
              rt_status_str(st_), rt_last_error());                          \
      return 1;                                                              \
    }                                                                        \
  } while (0)

#define EXPECT(cond)                                                         \
  do {                                                                       \
    if (!(cond)) {                                                           \
      fprintf(stderr, "%s:%d: expected %s (last error: %s)\n", __FILE__,     \
              __LINE__, #cond, rt_last_error());                             \
      return 1;                                                              \
    }                                                                        \
  } while (0)

/* A call refused with RT_STATUS_INVALID_ARGUMENT and a message containing `text`. */
#define REFUSED(call, text)                                                  \
  do {                                                                       \
    EXPECT((call) == RT_STATUS_INVALID_ARGUMENT);                            \
    EXPECT(strstr(rt_last_error(), (text)) != NULL);                         \
  } while (0)

#define RUN(test)                                                            \
  do {                                                                       \
    if (test != 0) {                                                         \
      fprintf(stderr, "%s failed\n", #test);                                 \
      return 1;                                                              \
    }                                                                        \
  } while (0)

static uint64_t size_bytes;  /* of the cluster's address space */

/* The content of the page at `gpa` after a write with `seed`. */
static void fill(uint8_t *page, uint64_t gpa, unsigned seed) {
  for (unsigned i = 0; i < PAGE / 8; i++) {
    uint64_t w = (gpa / PAGE + 1) * 0x9e3779b97f4a7c15ull ^ i * 0xbf58476d1ce4e5b9ull ^ seed;
    memcpy(page + i * 8, &w, 8);
  }
}

static int holds(const uint8_t *page, uint64_t gpa, unsigned seed) {
  uint8_t expected[PAGE];
  fill(expected, gpa, seed);
  return memcmp(page, expected, PAGE) == 0;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Seed of the whole address space, written by main before the tests. */
enum { SEED = 1, BATCH_SEED = 2 };

/* --- bad arguments ------------------------------------------------------ */

static void never_called(void *ctx, uint64_t user_data, int32_t status) {
  (void)ctx, (void)user_data, (void)status;
  abort();
}

static int bad_arguments(RtManager *m) {
  RtQueue *q = NULL;
  REFUSED(rt_queue_create(NULL, RT_REAP_MODE_POLL, NULL, NULL, &q), "manager is NULL");
  REFUSED(rt_queue_create(m, 7, NULL, NULL, &q), "mode 7");
  REFUSED(rt_queue_create(m, RT_REAP_MODE_CALLBACK, NULL, NULL, &q), "callback is NULL");
  REFUSED(rt_queue_create(m, RT_REAP_MODE_POLL, never_called, NULL, &q), "never be called");
  REFUSED(rt_queue_create(m, RT_REAP_MODE_POLL, NULL, NULL, NULL), "out is NULL");
  EXPECT(q == NULL);
  CHECK(rt_queue_create(m, RT_REAP_MODE_POLL, NULL, NULL, &q));

  static uint8_t page[PAGE];
  uint64_t gpa = 0;
  REFUSED(rt_queue_submit_read(NULL, &gpa, 1, page, 0), "queue is NULL");
  REFUSED(rt_queue_submit_read(q, &gpa, 0, page, 0), "count is 0");
  REFUSED(rt_queue_submit_read(q, NULL, 0, NULL, 0), "count is 0");
  REFUSED(rt_queue_submit_read(q, NULL, 1, page, 0), "gpas is NULL with count 1");
  REFUSED(rt_queue_submit_read(q, &gpa, 1, NULL, 0), "pages is NULL with count 1");
  REFUSED(rt_queue_submit_write(q, &gpa, 0, page, 0), "count is 0");
  REFUSED(rt_queue_submit_write(q, NULL, 2, page, 0), "gpas is NULL with count 2");
  REFUSED(rt_queue_submit_write(q, &gpa, 1, NULL, 0), "pages is NULL with count 1");
  EXPECT(rt_queue_in_flight(q) == 0);

  RtCompletion out[2];
  size_t n = 99;
  REFUSED(rt_queue_poll(NULL, out, 2, &n), "queue is NULL");
  REFUSED(rt_queue_poll(q, NULL, 2, &n), "out is NULL with max 2");
  REFUSED(rt_queue_poll(q, out, 2, NULL), "n is NULL");
  REFUSED(rt_queue_wait(q, out, 1, 2, 10, &n), "min 2 is more than max 1");
  EXPECT(n == 99);
  /* Nothing in flight: nothing to reap, and waiting does not block. */
  CHECK(rt_queue_poll(q, NULL, 0, &n));
  EXPECT(n == 0);
  double start = now_s();
  CHECK(rt_queue_wait(q, out, 2, 1, 5000, &n));
  EXPECT(n == 0 && now_s() - start < 1.0);

  EXPECT(rt_queue_eventfd(q) == -1);
  EXPECT(rt_queue_eventfd(NULL) == -1);
  EXPECT(rt_queue_in_flight(NULL) == 0);
  rt_queue_destroy(NULL);
  rt_queue_destroy(q);
  return 0;
}

/* --- poll mode: 32 in flight ---------------------------------------------- */

static int poll_mode_keeps_32_in_flight(RtManager *m) {
  enum { N = 160, DEPTH = 32, MAX = 4 };
  static uint8_t bufs[N][PAGE];
  uint64_t gpas[N];
  uint64_t pages = size_bytes / PAGE;
  for (unsigned i = 0; i < N; i++) gpas[i] = (i * 7 % pages) * PAGE;
  memset(bufs, 0, sizeof bufs);

  RtQueue *q = NULL;
  CHECK(rt_queue_create(m, RT_REAP_MODE_POLL, NULL, NULL, &q));
  size_t next = 0, done = 0;
  for (; next < DEPTH; next++) CHECK(rt_queue_submit_read(q, &gpas[next], 1, bufs[next], next));
  EXPECT(rt_queue_in_flight(q) == DEPTH);
  int seen[N] = {0};
  while (done < N) {
    /* At most MAX at a time: the queue holds the rest for the next call. */
    RtCompletion out[MAX];
    size_t n = 0;
    CHECK(rt_queue_wait(q, out, MAX, 1, 5000, &n));
    EXPECT(n >= 1 && n <= MAX);
    for (size_t k = 0; k < n; k++) {
      uint64_t i = out[k].user_data;
      EXPECT(out[k].status == RT_STATUS_OK);
      EXPECT(i < next && !seen[i]);
      seen[i] = 1;
      EXPECT(holds(bufs[i], gpas[i], SEED));
      done++;
      if (next < N) {
        CHECK(rt_queue_submit_read(q, &gpas[next], 1, bufs[next], next));
        next++;
      }
    }
    /* Every submission not returned yet counts, held ones included. */
    EXPECT(rt_queue_in_flight(q) == next - done);
    EXPECT(next == N || next - done == DEPTH);
  }
  size_t n = 1;
  CHECK(rt_queue_poll(q, NULL, 0, &n));
  EXPECT(n == 0 && rt_queue_in_flight(q) == 0);
  rt_queue_destroy(q);
  return 0;
}

/* --- eventfd mode ---------------------------------------------------------- */

static int eventfd_mode_with_poll(RtManager *m) {
  enum { N = 48, MAX = 3 };
  static uint8_t bufs[N][PAGE];
  uint64_t gpas[N];
  /* From the top of the space down: both nodes, other pages than above. */
  for (unsigned i = 0; i < N; i++) gpas[i] = size_bytes - (uint64_t)(i * 5 + 1) * PAGE;
  memset(bufs, 0, sizeof bufs);

  RtQueue *q = NULL;
  CHECK(rt_queue_create(m, RT_REAP_MODE_EVENTFD, NULL, NULL, &q));
  int fd = rt_queue_eventfd(q);
  EXPECT(fd >= 0);
  for (unsigned i = 0; i < N; i++) CHECK(rt_queue_submit_read(q, &gpas[i], 1, bufs[i], i));
  int seen[N] = {0};
  size_t done = 0;
  double deadline = now_s() + 10.0;
  while (done < N) {
    EXPECT(now_s() < deadline);
    /* Readable while anything is left to reap: completions held back by
     * `max` re-arm it, so this never waits out its timeout. */
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    int ready = poll(&pfd, 1, 5000);
    EXPECT(ready == 1 && (pfd.revents & POLLIN));
    RtCompletion out[MAX];
    size_t n = 0;
    CHECK(rt_queue_poll(q, out, MAX, &n));
    EXPECT(n <= MAX);
    for (size_t k = 0; k < n; k++) {
      uint64_t i = out[k].user_data;
      EXPECT(i < N && !seen[i] && out[k].status == RT_STATUS_OK);
      seen[i] = 1;
      EXPECT(holds(bufs[i], gpas[i], SEED));
      done++;
    }
  }
  EXPECT(rt_queue_in_flight(q) == 0);

  /* rt_queue_wait works in this mode too: 4 writes, then read back. */
  static uint8_t wpages[4][PAGE], rpages[4][PAGE];
  RtCompletion out[4];
  size_t n = 0;
  for (unsigned i = 0; i < 4; i++) fill(wpages[i], gpas[i], SEED);
  for (unsigned i = 0; i < 4; i++) CHECK(rt_queue_submit_write(q, &gpas[i], 1, wpages[i], 100 + i));
  size_t got = 0;
  double t0 = now_s();
  while (got < 4) {
    CHECK(rt_queue_wait(q, out, 4, 4 - got, 5000, &n));
    EXPECT(n > 0);
    for (size_t k = 0; k < n; k++) EXPECT(out[k].status == RT_STATUS_OK && out[k].user_data >= 100);
    got += n;
  }
  CHECK(rt_queue_submit_read(q, gpas, 4, rpages, 200));
  CHECK(rt_queue_wait(q, out, 4, 1, 5000, &n));
  EXPECT(n == 1 && out[0].user_data == 200 && out[0].status == RT_STATUS_OK);
  /* Woken by the answers, not by the requests' deadline (5 s here). */
  EXPECT(now_s() - t0 < 2.0);
  for (unsigned i = 0; i < 4; i++) EXPECT(holds(rpages[i], gpas[i], SEED));
  /* A read alone in flight is read from the socket straight into its
     page; the statistics say so. */
  RtManagerStats before = {.struct_size = sizeof before};
  CHECK(rt_manager_stats(m, &before));
  memset(rpages[0], 0, PAGE);
  CHECK(rt_queue_submit_read(q, &gpas[2], 1, rpages[0], 300));
  CHECK(rt_queue_wait(q, out, 1, 1, 5000, &n));
  EXPECT(n == 1 && out[0].user_data == 300 && out[0].status == RT_STATUS_OK);
  EXPECT(holds(rpages[0], gpas[2], SEED));
  RtManagerStats after = {.struct_size = sizeof after};
  CHECK(rt_manager_stats(m, &after));
  EXPECT(after.tcp_direct_pages == before.tcp_direct_pages + 1);
  rt_queue_destroy(q);
  return 0;
}

/* --- callback mode --------------------------------------------------------- */

enum { CB_N = 40, CB_BAD = 1000, CB_DESTROY = 2000 };

struct cb_state {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  pthread_t main_thread;
  RtQueue *queue;
  size_t count;
  size_t on_main_thread;
  unsigned seen[CB_N];
  int32_t bad_status;
  char bad_message[256];
  char destroy_message[256];
};

static void on_completion(void *ctx, uint64_t user_data, int32_t status) {
  struct cb_state *s = ctx;
  /* Before the lock: a failed completion's message is this thread's last error. */
  char message[256];
  snprintf(message, sizeof message, "%s", rt_last_error());
  char destroy_message[256] = "";
  if (user_data == CB_DESTROY) {
    /* Destroying the queue from its own callback is refused (it says so in
     * rt_last_error(), and the queue keeps working below). */
    rt_queue_destroy(s->queue);
    snprintf(destroy_message, sizeof destroy_message, "%s", rt_last_error());
  }
  pthread_mutex_lock(&s->mu);
  if (pthread_equal(pthread_self(), s->main_thread)) s->on_main_thread++;
  if (user_data < CB_N) {
    s->seen[user_data]++;
    if (status != RT_STATUS_OK) s->bad_status = status;
  } else if (user_data == CB_BAD) {
    s->bad_status = status;
    snprintf(s->bad_message, sizeof s->bad_message, "%s", message);
  } else if (user_data == CB_DESTROY) {
    snprintf(s->destroy_message, sizeof s->destroy_message, "%s", destroy_message);
  }
  s->count++;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

/* Waits up to 10 s until `count` callbacks ran; 0 on success. */
static int wait_count(struct cb_state *s, size_t count) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 10;
  pthread_mutex_lock(&s->mu);
  int err = 0;
  while (s->count < count && err != ETIMEDOUT) err = pthread_cond_timedwait(&s->cv, &s->mu, &until);
  int ok = s->count >= count;
  pthread_mutex_unlock(&s->mu);
  return ok ? 0 : 1;
}

static int callback_mode(RtManager *m) {
  static uint8_t bufs[CB_N][PAGE];
  static uint8_t bad_page[PAGE], other[PAGE];
  uint64_t gpas[CB_N];
  for (unsigned i = 0; i < CB_N; i++) gpas[i] = (uint64_t)(i * 3 + 2) * PAGE;
  memset(bufs, 0, sizeof bufs);
  static struct cb_state s;
  memset(&s, 0, sizeof s);
  pthread_mutex_init(&s.mu, NULL);
  pthread_cond_init(&s.cv, NULL);
  s.main_thread = pthread_self();

  RtQueue *q = NULL;
  CHECK(rt_queue_create(m, RT_REAP_MODE_CALLBACK, on_completion, &s, &q));
  pthread_mutex_lock(&s.mu);
  s.queue = q;
  pthread_mutex_unlock(&s.mu);
  EXPECT(rt_queue_eventfd(q) == -1);
  RtCompletion out[1];
  size_t n;
  REFUSED(rt_queue_poll(q, out, 1, &n), "RT_REAP_MODE_CALLBACK");
  REFUSED(rt_queue_wait(q, out, 1, 1, 10, &n), "RT_REAP_MODE_CALLBACK");

  for (unsigned i = 0; i < CB_N; i++) CHECK(rt_queue_submit_read(q, &gpas[i], 1, bufs[i], i));
  uint64_t unknown = size_bytes + 16 * PAGE;
  CHECK(rt_queue_submit_read(q, &unknown, 1, bad_page, CB_BAD));
  EXPECT(wait_count(&s, CB_N + 1) == 0);
  pthread_mutex_lock(&s.mu);
  size_t count = s.count, on_main = s.on_main_thread;
  int32_t bad_status = s.bad_status;
  int every_once = 1;
  for (unsigned i = 0; i < CB_N; i++) every_once &= s.seen[i] == 1;
  pthread_mutex_unlock(&s.mu);
  EXPECT(count == CB_N + 1 && every_once && on_main == 0);
  EXPECT(bad_status == RT_STATUS_UNKNOWN_GPA);
  EXPECT(strstr(s.bad_message, "not mapped") != NULL);
  /* Every callback ran: the pages are in. */
  for (unsigned i = 0; i < CB_N; i++) EXPECT(holds(bufs[i], gpas[i], SEED));
  EXPECT(rt_queue_in_flight(q) == 0);

  /* rt_queue_destroy from the callback: refused, the queue stays usable. */
  CHECK(rt_queue_submit_read(q, &gpas[0], 1, other, CB_DESTROY));
  EXPECT(wait_count(&s, CB_N + 2) == 0);
  EXPECT(strstr(s.destroy_message, "own callback") != NULL);
  memset(bufs[1], 0, PAGE);
  CHECK(rt_queue_submit_read(q, &gpas[1], 1, bufs[1], 1));
  EXPECT(wait_count(&s, CB_N + 3) == 0);
  EXPECT(holds(other, gpas[0], SEED) && holds(bufs[1], gpas[1], SEED));
  rt_queue_destroy(q);
  pthread_mutex_destroy(&s.mu);
  pthread_cond_destroy(&s.cv);
  return 0;
}

/* --- more than 64 pages in one submission ---------------------------------- */

/* 300 pages over both nodes: five windows of up to 64 pages. `interleaved`:
 * every window holds pages of both nodes (else each window stays on one). */
static int large_batch(RtManager *m, int interleaved) {
  enum { N = 300 };
  static uint8_t out_pages[N][PAGE], in_pages[N][PAGE], check[N][PAGE];
  uint64_t gpas[N];
  uint64_t pages = size_bytes / PAGE;
  for (unsigned i = 0; i < N; i++) {
    gpas[i] = (interleaved ? i * 11 % pages : i) * PAGE;
    fill(out_pages[i], gpas[i], BATCH_SEED);
  }
  memset(in_pages, 0, sizeof in_pages);
  RtQueue *q = NULL;
  CHECK(rt_queue_create(m, RT_REAP_MODE_POLL, NULL, NULL, &q));
  RtCompletion out[1];
  size_t n = 0;
  CHECK(rt_queue_submit_write(q, gpas, N, out_pages, 1));
  CHECK(rt_queue_wait(q, out, 1, 1, 10000, &n));
  EXPECT(n == 1 && out[0].user_data == 1 && out[0].status == RT_STATUS_OK);
  CHECK(rt_queue_submit_read(q, gpas, N, in_pages, 2));
  CHECK(rt_queue_wait(q, out, 1, 1, 10000, &n));
  EXPECT(n == 1 && out[0].user_data == 2 && out[0].status == RT_STATUS_OK);
  for (unsigned i = 0; i < N; i++) EXPECT(holds(in_pages[i], gpas[i], BATCH_SEED));
  /* The blocking API agrees; then the original content goes back. */
  CHECK(rt_manager_read_pages(m, gpas, N, &check[0][0]));
  EXPECT(memcmp(check, out_pages, sizeof check) == 0);
  for (unsigned i = 0; i < N; i++) fill(out_pages[i], gpas[i], SEED);
  CHECK(rt_queue_submit_write(q, gpas, N, out_pages, 3));
  CHECK(rt_queue_wait(q, out, 1, 1, 10000, &n));
  EXPECT(n == 1 && out[0].status == RT_STATUS_OK);
  rt_queue_destroy(q);
  return 0;
}

/* --- typed errors in completions ------------------------------------------- */

static int typed_errors(RtManager *m) {
  RtQueue *q = NULL;
  CHECK(rt_queue_create(m, RT_REAP_MODE_POLL, NULL, NULL, &q));
  static uint8_t bufs[3][PAGE];
  uint64_t unknown = size_bytes + PAGE, unaligned = 0x10, good = 5 * PAGE;
  CHECK(rt_queue_submit_read(q, &unknown, 1, bufs[0], 7));
  CHECK(rt_queue_submit_read(q, &unaligned, 1, bufs[1], 8));
  CHECK(rt_queue_submit_read(q, &good, 1, bufs[2], 9));
  int seen = 0;
  double deadline = now_s() + 10.0;
  while (seen != 7) {
    EXPECT(now_s() < deadline);
    RtCompletion out[1];
    size_t n = 0;
    /* One at a time: rt_last_error() is the message of a failed one. */
    CHECK(rt_queue_wait(q, out, 1, 1, 5000, &n));
    if (n == 0) continue;
    switch (out[0].user_data) {
    case 7:
      EXPECT(out[0].status == RT_STATUS_UNKNOWN_GPA);
      EXPECT(strstr(rt_last_error(), "not mapped to any node") != NULL);
      seen |= 1;
      break;
    case 8:
      EXPECT(out[0].status == RT_STATUS_UNALIGNED);
      EXPECT(strstr(rt_last_error(), "0x10 is not page aligned") != NULL);
      seen |= 2;
      break;
    case 9:
      EXPECT(out[0].status == RT_STATUS_OK && holds(bufs[2], good, SEED));
      seen |= 4;
      break;
    default:
      EXPECT(0);
    }
  }
  rt_queue_destroy(q);
  return 0;
}

/* --- destroying queues with requests in flight ----------------------------- */

static int destroy_in_flight(RtManager *m) {
  enum { SUBS = 16, PER = 32 };
  static uint8_t bufs[SUBS][PER][PAGE], check[PER][PAGE];
  uint64_t gpas[PER];
  for (unsigned i = 0; i < PER; i++) gpas[i] = (uint64_t)(i * 13 + 3) * PAGE % size_bytes;
  static struct cb_state s;
  memset(&s, 0, sizeof s);
  pthread_mutex_init(&s.mu, NULL);
  pthread_cond_init(&s.cv, NULL);
  s.main_thread = pthread_self();
  for (int mode = RT_REAP_MODE_POLL; mode <= RT_REAP_MODE_CALLBACK; mode++) {
    RtQueue *q = NULL;
    RtCompletionFn cb = mode == RT_REAP_MODE_CALLBACK ? on_completion : NULL;
    CHECK(rt_queue_create(m, (uint32_t)mode, cb, cb ? &s : NULL, &q));
    memset(bufs, 0, sizeof bufs);
    for (unsigned k = 0; k < SUBS; k++) CHECK(rt_queue_submit_read(q, gpas, PER, bufs[k], 500 + k));
    /* Poll and eventfd modes deliver only when reaped: all still count. */
    if (mode != RT_REAP_MODE_CALLBACK) EXPECT(rt_queue_in_flight(q) == SUBS);
    rt_queue_destroy(q);
    /* Nothing touches the buffers any more: reuse them, then drive the same
     * connections and check that no late answer landed in them. */
    pthread_mutex_lock(&s.mu);
    size_t callbacks = s.count;
    pthread_mutex_unlock(&s.mu);
    memset(bufs, 0x5a, sizeof bufs);
    for (unsigned r = 0; r < 4; r++) {
      CHECK(rt_manager_read_pages(m, gpas, PER, &check[0][0]));
      for (unsigned i = 0; i < PER; i++) EXPECT(holds(check[i], gpas[i], SEED));
    }
    const uint8_t *b = &bufs[0][0][0];
    for (size_t i = 0; i < sizeof bufs; i++) EXPECT(b[i] == 0x5a);
    pthread_mutex_lock(&s.mu);
    EXPECT(s.count == callbacks);
    pthread_mutex_unlock(&s.mu);
  }
  pthread_mutex_destroy(&s.mu);
  pthread_cond_destroy(&s.cv);
  return 0;
}

/* --- a queue outlives its manager ------------------------------------------ */

static int outlives_manager(const RtManagerConfig *mc) {
  RtManager *m = NULL;
  CHECK(rt_manager_connect(mc, &m));
  RtQueue *q = NULL;
  CHECK(rt_queue_create(m, RT_REAP_MODE_POLL, NULL, NULL, &q));
  rt_manager_destroy(m);
  /* A page of each node (one submission each: see large_batch). */
  static uint8_t bufs[2][PAGE];
  uint64_t gpas[2] = {PAGE, size_bytes - PAGE};
  CHECK(rt_queue_submit_read(q, &gpas[0], 1, bufs[0], 1));
  CHECK(rt_queue_submit_read(q, &gpas[1], 1, bufs[1], 2));
  RtCompletion out[2];
  size_t n = 0;
  CHECK(rt_queue_wait(q, out, 2, 2, 5000, &n));
  EXPECT(n == 2 && out[0].status == RT_STATUS_OK && out[1].status == RT_STATUS_OK);
  EXPECT(holds(bufs[0], gpas[0], SEED) && holds(bufs[1], gpas[1], SEED));
  rt_queue_destroy(q);
  return 0;
}

int main(int argc, char **argv) {
  int interleaved = argc == 5 && strcmp(argv[4], "interleaved") == 0;
  if (argc != 4 && !interleaved) {
    fprintf(stderr, "usage: %s <coordinator-url> <bytes> <cluster-key-file> [interleaved]\n",
            argv[0]);
    return 2;
  }
  size_bytes = strtoull(argv[2], NULL, 0);
  RtManagerConfig mc;
  rt_manager_config_default(&mc);
  mc.coordinator_url = argv[1];
  mc.cluster_key_file = argv[3];
  mc.pin_pollers = 0;
  /* Far above what any request here takes: a wait that sleeps until the
   * deadline instead of waking on the answer shows. */
  mc.request_timeout_ms = 5000;
  RtManager *m = NULL;
  CHECK(rt_manager_connect(&mc, &m));

  /* Every page of the cluster holds its SEED content. */
  uint64_t pages = size_bytes / PAGE;
  uint8_t *all = malloc(size_bytes);
  uint64_t *gpas = malloc(pages * sizeof *gpas);
  EXPECT(all != NULL && gpas != NULL);
  for (uint64_t i = 0; i < pages; i++) {
    gpas[i] = i * PAGE;
    fill(all + i * PAGE, gpas[i], SEED);
  }
  CHECK(rt_manager_write_pages(m, gpas, pages, all));
  free(all);
  free(gpas);

  if (interleaved) {
    /* Only the batch whose every window spans both nodes, many times. */
    for (int r = 0; r < 20; r++) RUN(large_batch(m, 1));
    rt_manager_destroy(m);
    printf("c queue: ok\n");
    return 0;
  }
  RUN(bad_arguments(m));
  RUN(poll_mode_keeps_32_in_flight(m));
  RUN(eventfd_mode_with_poll(m));
  RUN(callback_mode(m));
  RUN(large_batch(m, 0));
  RUN(typed_errors(m));
  RUN(destroy_in_flight(m));
  RUN(outlives_manager(&mc));
  rt_manager_destroy(m);
  printf("c queue: ok\n");
  return 0;
}
