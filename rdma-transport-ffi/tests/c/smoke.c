/* C smoke test of the rdma-transport C API against a running cluster.
 *
 *   smoke <coordinator-url> <bytes>
 *
 * Maps guest memory over [0, bytes) of the cluster, writes a pattern
 * through the host pointer (faulting pages in), flushes, evicts, checks the
 * owners have it, touches the pages again (faulting them back in) and
 * checks them, and exercises page I/O (single, batched, into pool frames),
 * every manager option, statistics, error codes and error strings.
 * Prints "c smoke: ok" and exits 0 on success. */
#define _GNU_SOURCE /* syscall(2) */
#include "rdma_transport.h"

#include <dirent.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/utsname.h>
#include <unistd.h>

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
      fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond);    \
      return 1;                                                              \
    }                                                                        \
  } while (0)

static uint64_t word(uint64_t page, uint64_t i) {
  return (page + 1) * 0x9e3779b97f4a7c15ull ^ i * 0xbf58476d1ce4e5b9ull;
}

/* The manager's statistics, or a zeroed struct after printing the error. */
static RtManagerStats stats_of(const RtManager *m) {
  RtManagerStats s = {.struct_size = sizeof s};
  RtStatus st = rt_manager_stats(m, &s);
  if (st != RT_STATUS_OK) {
    fprintf(stderr, "rt_manager_stats: %s (%s)\n", rt_status_str(st), rt_last_error());
    memset(&s, 0, sizeof s);
  }
  return s;
}

/* Decodes the hex key file at `path` into `key`; returns its length, 0 on error. */
static size_t read_key(const char *path, uint8_t *key, size_t capacity) {
  FILE *f = fopen(path, "r");
  if (f == NULL) return 0;
  size_t n = 0;
  unsigned byte;
  while (n < capacity && fscanf(f, "%2x", &byte) == 1) key[n++] = (uint8_t)byte;
  fclose(f);
  return n;
}

/* `struct sched_attr` of <linux/sched/types.h> (48 bytes, SCHED_ATTR_SIZE_VER1). */
struct slice_attr {
  uint32_t size, sched_policy;
  uint64_t sched_flags;
  int32_t sched_nice;
  uint32_t sched_priority;
  uint64_t sched_runtime, sched_deadline, sched_period;
  uint32_t util_min, util_max;
};

/* Handler threads of this process (named "uffd-handler*") whose scheduler
 * slice (sched_runtime) is `ns`. */
static int handlers_with_slice(uint64_t ns) {
  int found = 0;
  DIR *tasks = opendir("/proc/self/task");
  if (tasks == NULL) return -1;
  struct dirent *e;
  while ((e = readdir(tasks)) != NULL) {
    if (e->d_name[0] == '.') continue;
    char path[300], comm[32] = {0};
    snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
    FILE *f = fopen(path, "r");
    if (f == NULL) continue;
    if (fgets(comm, sizeof comm, f) == NULL) comm[0] = 0;
    fclose(f);
    if (strncmp(comm, "uffd-handler", 12) != 0) continue;
    struct slice_attr attr = {0};
    if (syscall(SYS_sched_getattr, atoi(e->d_name), &attr, 48u, 0u) == 0 && attr.sched_runtime == ns)
      found++;
  }
  closedir(tasks);
  return found;
}

/* Linux 6.12 or later: sched_runtime sets a fair thread's slice. */
static int kernel_has_custom_slices(void) {
  struct utsname u;
  int major = 0, minor = 0;
  if (uname(&u) != 0 || sscanf(u.release, "%d.%d", &major, &minor) != 2) return 0;
  return major > 6 || (major == 6 && minor >= 12);
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s <coordinator-url> <bytes> <cluster-key-file>\n", argv[0]);
    return 2;
  }
  uint64_t size = strtoull(argv[2], NULL, 0);
  uint64_t pages = size / PAGE;

  RtManagerConfig mc;
  rt_manager_config_default(&mc);
  EXPECT(mc.struct_size == sizeof mc);
  mc.coordinator_url = argv[1];
  mc.pin_pollers = 0;
  RtManager *m = NULL;
  /* Config checks: a flag is 0 or 1, struct_size is sizeof the struct. */
  mc.pin_pollers = 2;
  EXPECT(rt_manager_connect(&mc, &m) == RT_STATUS_INVALID_ARGUMENT && m == NULL);
  mc.pin_pollers = 0;
  mc.struct_size = sizeof mc + 8;
  EXPECT(rt_manager_connect(&mc, &m) == RT_STATUS_STRUCT_SIZE && m == NULL);
  mc.struct_size = sizeof mc;
  /* No cluster key and not insecure: refused with a reason. */
  EXPECT(rt_manager_connect(&mc, &m) == RT_STATUS_INVALID_ARGUMENT && m == NULL);
  EXPECT(strstr(rt_last_error(), "cluster key") != NULL);
  /* Insecure: the page-servers hold a key, so they are refused. */
  mc.insecure = 1;
  CHECK(rt_manager_connect(&mc, &m));
  uint8_t probe[PAGE];
  EXPECT(rt_manager_read_page(m, 0, probe) == RT_STATUS_AUTH_FAILED);
  rt_manager_destroy(m);
  m = NULL;
  mc.insecure = 0;
  mc.cluster_key_file = argv[3];
  /* Every option reaches the manager: RDMA only fails on this device-less
   * host (the tail past the first 64-byte layout is read)... */
  mc.transport = RT_TRANSPORT_KIND_RDMA;
  mc.rdma_device = "rt-no-such-dev0";
  EXPECT(rt_manager_connect(&mc, &m) == RT_STATUS_UNSUPPORTED && m == NULL);
  /* ...and an unknown enum value is refused, naming the field... */
  mc.transport = 7;
  EXPECT(rt_manager_connect(&mc, &m) == RT_STATUS_INVALID_ARGUMENT && m == NULL);
  EXPECT(strstr(rt_last_error(), "transport 7") != NULL);
  /* ...unless struct_size says the caller knows only the first layout: the
   * fields after it are not read and take their defaults. */
  mc.struct_size = 64;
  CHECK(rt_manager_connect(&mc, &m));
  rt_manager_destroy(m);
  m = NULL;
  mc.struct_size = sizeof mc;
  /* Non-default values of every option. */
  static const uint32_t cpus[] = {0};
  mc.transport = RT_TRANSPORT_KIND_TCP;
  mc.poll_mode = RT_POLL_MODE_EVENT;
  mc.poller_threads = 2;
  mc.pin_pollers = 1;
  mc.poller_cpus = cpus;
  mc.poller_cpus_len = 1;
  mc.poll_idle_spin_us = 50;
  mc.wait_spin_us = 10;
  mc.request_timeout_ms = 3000;
  mc.connect_timeout_ms = 2000;
  mc.map_refresh_ms = 200;
  mc.pool_size_bytes = 16 * PAGE;
  mc.rdma_port = 2;
  mc.rdma_gid_index = 3;
  mc.rdma_ack_timeout = 12;
  mc.rdma_retry_count = 5;
  mc.page_checksums = 0;
  mc.read_hedge_delay_us = 4321;
  /* NULL with a nonzero length is refused. */
  mc.poller_cpus = NULL;
  EXPECT(rt_manager_connect(&mc, &m) == RT_STATUS_INVALID_ARGUMENT && m == NULL);
  EXPECT(strstr(rt_last_error(), "poller_cpus is NULL") != NULL);
  mc.poller_cpus = cpus;
  /* The key as bytes instead of a file: a short one is refused... */
  uint8_t key[64];
  size_t key_len = read_key(argv[3], key, sizeof key);
  EXPECT(key_len == 32);
  mc.cluster_key_file = NULL;
  mc.cluster_key = key;
  mc.cluster_key_len = 8;
  EXPECT(rt_manager_connect(&mc, &m) == RT_STATUS_INVALID_ARGUMENT && m == NULL);
  EXPECT(strstr(rt_last_error(), "8 bytes") != NULL);
  /* ...the whole one works, proven by the page-servers' handshakes. */
  mc.cluster_key_len = key_len;
  CHECK(rt_manager_connect(&mc, &m));

  /* Statistics of a fresh manager. */
  RtManagerStats s0 = stats_of(m);
  EXPECT(s0.node_count == 2 && s0.nodes_connected == 2 && s0.nodes_rdma == 0);
  EXPECT(s0.map_version > 0);
  uint64_t refreshed = 0;
  CHECK(rt_manager_refresh_map(m, &refreshed));
  EXPECT(refreshed >= s0.map_version && refreshed == stats_of(m).map_version);
  /* No write missed by a replica: nothing owed, settled at once. */
  EXPECT(s0.owed_stale_marks == 0);
  CHECK(rt_manager_settle_owed_stale_marks(m));
  EXPECT(rt_manager_settle_owed_stale_marks(NULL) == RT_STATUS_INVALID_ARGUMENT);
  CHECK(rt_manager_refresh_map(m, NULL));
  EXPECT(rt_manager_refresh_map(NULL, &refreshed) == RT_STATUS_INVALID_ARGUMENT);
  EXPECT(s0.pool_frames == 16 && s0.pool_free_frames == 16);
  EXPECT(s0.read_hedge_delay_us == 4321);
  EXPECT(s0.calls_ok == 0 && s0.calls_failed == 0 && s0.pages_read == 0);
  EXPECT(s0.reads_hedged == 0);
  EXPECT(rt_manager_node_count(m) == 2);
  RtManagerStats bad = {.struct_size = sizeof bad + 8};
  EXPECT(rt_manager_stats(m, &bad) == RT_STATUS_STRUCT_SIZE && bad.node_count == 0);
  /* A program built against the first layout (up to pages_written) gets
     that much, and nothing past it is written. */
  RtManagerStats old = {.struct_size = offsetof(RtManagerStats, rdma_registered_regions)};
  old.tcp_direct_pages = 77;
  CHECK(rt_manager_stats(m, &old));
  EXPECT(old.node_count == 2 && old.tcp_direct_pages == 77);
  /* Likewise the third (up to owed_stale_marks): reads_hedged is not
     written. */
  RtManagerStats third = {.struct_size = offsetof(RtManagerStats, reads_hedged)};
  third.reads_hedged = 78;
  CHECK(rt_manager_stats(m, &third));
  EXPECT(third.node_count == 2 && third.reads_hedged == 78);

  /* Every node, by index: its id and data path. */
  int seen = 0;
  for (size_t i = 0; i < 2; i++) {
    RtNodeInfo info = {.struct_size = sizeof info};
    CHECK(rt_manager_node_info(m, i, &info, NULL, 0));
    EXPECT(info.id_len == 2 && info.data_path == RT_DATA_PATH_TCP);
    char small[2];
    EXPECT(rt_manager_node_info(m, i, &info, small, sizeof small) == RT_STATUS_INVALID_ARGUMENT);
    char id[16];
    CHECK(rt_manager_node_info(m, i, &info, id, sizeof id));
    if (strcmp(id, "n0") == 0) seen |= 1;
    if (strcmp(id, "n1") == 0) seen |= 2;
  }
  EXPECT(seen == 3);
  RtNodeInfo past = {.struct_size = sizeof past};
  EXPECT(rt_manager_node_info(m, 2, &past, NULL, 0) == RT_STATUS_OUT_OF_RANGE);

  /* Page I/O straight through the manager. */
  uint8_t page[PAGE], back[PAGE];
  for (unsigned i = 0; i < PAGE; i++) page[i] = (uint8_t)(i * 7);
  CHECK(rt_manager_write_page(m, 3 * PAGE, page));
  CHECK(rt_manager_read_page(m, 3 * PAGE, back));
  EXPECT(memcmp(page, back, PAGE) == 0);

  /* A frame of the pool holds the page until released. */
  RtFrame *frame = NULL;
  CHECK(rt_manager_read_frame(m, 3 * PAGE, &frame));
  const uint8_t *data = rt_frame_data(frame);
  EXPECT(data != NULL && (uintptr_t)data % PAGE == 0);
  EXPECT(memcmp(data, page, PAGE) == 0);
  EXPECT(rt_frame_gpa(frame) == 3 * PAGE);
  EXPECT(stats_of(m).pool_free_frames == 15);
  rt_frame_release(frame);
  EXPECT(stats_of(m).pool_free_frames == 16);
  /* Every frame in use: RT_STATUS_POOL, and all come back. */
  RtFrame *frames[16];
  for (unsigned i = 0; i < 16; i++) CHECK(rt_manager_read_frame(m, 3 * PAGE, &frames[i]));
  EXPECT(stats_of(m).pool_free_frames == 0);
  frame = NULL;
  EXPECT(rt_manager_read_frame(m, 3 * PAGE, &frame) == RT_STATUS_POOL && frame == NULL);
  for (unsigned i = 0; i < 16; i++) rt_frame_release(frames[i]);
  EXPECT(stats_of(m).pool_free_frames == 16);

  /* A batch over both nodes, out of order, written then read back. */
  enum { BATCH = 8 };
  uint64_t gpas[BATCH];
  static uint8_t out_pages[BATCH * PAGE], in_pages[BATCH * PAGE];
  for (unsigned i = 0; i < BATCH; i++) {
    gpas[i] = (i % 2 ? size / 2 : 0) + (uint64_t)(BATCH - i) * PAGE;
    for (unsigned j = 0; j < PAGE; j++) out_pages[i * PAGE + j] = (uint8_t)(i * 31 + j * 3 + 1);
  }
  RtManagerStats s1 = stats_of(m);
  CHECK(rt_manager_write_pages(m, gpas, BATCH, out_pages));
  CHECK(rt_manager_read_pages(m, gpas, BATCH, in_pages));
  EXPECT(memcmp(out_pages, in_pages, sizeof out_pages) == 0);
  for (unsigned i = 0; i < BATCH; i++) {
    CHECK(rt_manager_read_page(m, gpas[i], back));
    EXPECT(memcmp(back, out_pages + i * PAGE, PAGE) == 0);
  }
  RtManagerStats s2 = stats_of(m);
  EXPECT(s2.calls_ok - s1.calls_ok == 2 + BATCH);
  EXPECT(s2.pages_written - s1.pages_written == BATCH);
  EXPECT(s2.pages_read - s1.pages_read == 2 * BATCH);
  EXPECT(s2.calls_failed == s1.calls_failed);
  EXPECT(rt_manager_read_pages(m, NULL, 2, in_pages) == RT_STATUS_INVALID_ARGUMENT);
  CHECK(rt_manager_write_pages(m, NULL, 0, NULL));

  /* Typed errors and their strings. */
  EXPECT(rt_manager_read_page(m, 0x10, back) == RT_STATUS_UNALIGNED);
  EXPECT(strlen(rt_last_error()) > 0);
  EXPECT(strcmp(rt_status_str(RT_STATUS_UNALIGNED), "address not page aligned") == 0);
  EXPECT(strcmp(rt_status_str(999), "unknown status") == 0);
  EXPECT(rt_manager_read_page(m, size + PAGE, back) == RT_STATUS_UNKNOWN_GPA);
  RtManagerStats s3 = stats_of(m);
  /* Two failed reads; the empty batch is a call that succeeded. */
  EXPECT(s3.calls_failed - s2.calls_failed == 2 && s3.calls_ok - s2.calls_ok == 1);
  EXPECT(s3.calls_timed_out == 0);

  /* Guest memory over the whole cluster. */
  RtGuestMemoryConfig gc;
  rt_guest_memory_config_default(&gc);
  EXPECT(gc.struct_size == sizeof gc);
  EXPECT(gc.fault_mode == RT_FAULT_MODE_KERNEL_AND_USER);
  gc.gpa_base = 0;
  gc.size_bytes = size;
  gc.pin_handlers = 0;
  EXPECT(gc.handler_slice_us == 0);
  /* Handlers that ask for a 4.321 ms slice (found below by that value). */
  gc.handler_slice_us = 4321;
  RtGuestMemory *g = NULL;
  gc.fault_mode = 7;
  EXPECT(rt_guest_memory_create(m, &gc, &g) == RT_STATUS_INVALID_ARGUMENT && g == NULL);
  gc.fault_mode = RT_FAULT_MODE_KERNEL_AND_USER;
  gc.struct_size = 8;
  EXPECT(rt_guest_memory_create(m, &gc, &g) == RT_STATUS_STRUCT_SIZE && g == NULL);
  gc.struct_size = sizeof gc;
  CHECK(rt_guest_memory_create(m, &gc, &g));
  EXPECT(rt_guest_memory_size(g) == size);
  volatile uint64_t *ram = (volatile uint64_t *)rt_guest_memory_host_addr(g);
  EXPECT(ram != NULL);
  EXPECT(handlers_with_slice(4321000) == (kernel_has_custom_slices() ? (int)gc.handler_threads : 0));

  for (uint64_t p = 0; p < pages; p++)
    for (uint64_t i = 0; i < PAGE / 8; i++) ram[p * (PAGE / 8) + i] = word(p, i);
  uint64_t written = 0, dropped = 0;
  CHECK(rt_guest_memory_flush(g, &written));
  EXPECT(written == pages);
  CHECK(rt_guest_memory_evict(g, 0, size, &dropped));
  EXPECT(dropped == pages);

  /* The owners have the pattern... */
  CHECK(rt_manager_read_page(m, 7 * PAGE, back));
  uint64_t w;
  memcpy(&w, back + 8 * 5, 8);
  EXPECT(w == word(7, 5));
  /* ...and touching the pages faults them back in. */
  for (uint64_t p = pages; p-- > 0;)
    for (uint64_t i = 0; i < PAGE / 8; i++) EXPECT(ram[p * (PAGE / 8) + i] == word(p, i));

  /* Copy helpers and range errors. */
  CHECK(rt_guest_memory_write(g, PAGE + 100, (const uint8_t *)"hello", 5));
  char hello[6] = {0};
  CHECK(rt_guest_memory_read(g, PAGE + 100, (uint8_t *)hello, 5));
  EXPECT(strcmp(hello, "hello") == 0);
  EXPECT(rt_guest_memory_evict(g, size, PAGE, NULL) == RT_STATUS_OUT_OF_RANGE);
  EXPECT(rt_guest_memory_evict(g, 1, PAGE, NULL) == RT_STATUS_OUT_OF_RANGE);
  EXPECT(rt_guest_memory_create(NULL, &gc, &g) == RT_STATUS_INVALID_ARGUMENT);

  RtGuestMemoryStats stats = {.struct_size = sizeof stats};
  CHECK(rt_guest_memory_stats(g, &stats));
  printf("faults %" PRIu64 ", prefetched %" PRIu64 " in %" PRIu64 " batches, deferred %" PRIu64
         ", written back %" PRIu64 ", evicted %" PRIu64 "\n",
         stats.missing_faults, stats.prefetched_pages, stats.prefetch_batches,
         stats.deferred_faults, stats.pages_written_back, stats.pages_evicted);
  EXPECT(stats.missing_faults + stats.prefetched_pages >= 2 * pages);
  EXPECT(stats.pages_written_back >= pages && stats.pages_evicted == pages);
  EXPECT((stats.prefetched_pages == 0) == (stats.prefetch_batches == 0));
  EXPECT(stats.fault_errors == 0 && stats.sigbus_raised == 0);
  RtGuestMemoryStats bad_g = {.struct_size = 8};
  EXPECT(rt_guest_memory_stats(g, &bad_g) == RT_STATUS_STRUCT_SIZE);

  rt_guest_memory_destroy(g);
  EXPECT(handlers_with_slice(4321000) == 0);
  /* The region's page I/O went through the manager, and with its handler
   * threads stopped every frame it fetched into is back in the pool. */
  RtManagerStats s4 = stats_of(m);
  EXPECT(s4.pages_written - s3.pages_written >= pages);
  EXPECT(s4.pool_free_frames == s4.pool_frames);
  rt_manager_destroy(m);
  printf("c smoke: ok\n");
  return 0;
}
