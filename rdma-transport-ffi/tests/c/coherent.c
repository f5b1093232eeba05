/* Coherent guest memory through the C API, against a running cluster:
 * two nodes (two regions in this program, each its own node to the homes)
 * map the same guest RAM.
 *
 *   coherent <coordinator-url> <bytes> <cluster-key-file>
 *
 * Node a writes a word in every page through its mapping; node b reads
 * each one through its own mapping (the homes recall a's copies first),
 * then writes a new word that a reads back. Bad arguments get their
 * status; a's pages are handed back with evict, and b reads them all
 * again after a is destroyed. The counters must show the traffic. Prints
 * "c coherent: ok" and exits 0 on success. */
#include "rdma_transport.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static volatile uint64_t *word_at(RtCoherentMemory *mem, uint64_t page) {
  return (volatile uint64_t *)(rt_coherent_memory_host_addr(mem) + page * PAGE);
}

static uint64_t value(uint64_t page, uint64_t round) {
  return (page + 1) * 0x9e3779b97f4a7c15ull ^ round;
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
  mc.coordinator_url = argv[1];
  mc.cluster_key_file = argv[3];
  RtManager *m = NULL;
  CHECK(rt_manager_connect(&mc, &m));

  RtGuestMemoryConfig gc;
  rt_guest_memory_config_default(&gc);
  gc.gpa_base = 0;
  gc.size_bytes = size;
  RtCoherenceConfig cc;
  rt_coherence_config_default(&cc);
  EXPECT(cc.struct_size == sizeof(RtCoherenceConfig));
  EXPECT(cc.min_hold_us == 50 && cc.timeout_ms == 5000);
  EXPECT(cc.dead_home_timeout_ms == 10000);

  /* Bad arguments first. */
  RtCoherentMemory *bad = NULL;
  EXPECT(rt_coherent_memory_create(NULL, &gc, &cc, &bad) == RT_STATUS_INVALID_ARGUMENT);
  EXPECT(rt_coherent_memory_create(m, &gc, NULL, &bad) == RT_STATUS_INVALID_ARGUMENT);
  RtCoherenceConfig wrong = cc;
  wrong.struct_size = 7;
  EXPECT(rt_coherent_memory_create(m, &gc, &wrong, &bad) == RT_STATUS_STRUCT_SIZE);
  EXPECT(bad == NULL);

  RtCoherentMemory *a = NULL, *b = NULL;
  CHECK(rt_coherent_memory_create(m, &gc, &cc, &a));
  /* b with the first layout (before dead_home_timeout_ms): still accepted. */
  RtCoherenceConfig first = cc;
  first.struct_size = 24;
  CHECK(rt_coherent_memory_create(m, &gc, &first, &b));
  EXPECT(rt_coherent_memory_size(a) == size);
  EXPECT(rt_coherent_memory_acquire(a, 3, 0) == RT_STATUS_UNALIGNED);
  EXPECT(rt_coherent_memory_acquire(a, size, 0) == RT_STATUS_UNKNOWN_GPA);
  EXPECT(rt_coherent_memory_acquire(a, 0, 2) == RT_STATUS_INVALID_ARGUMENT);

  for (uint64_t p = 0; p < pages; p++)
    *word_at(a, p) = value(p, 1);
  for (uint64_t p = 0; p < pages; p++) {
    EXPECT(*word_at(b, p) == value(p, 1));
    *word_at(b, p) = value(p, 2);
  }
  for (uint64_t p = 0; p < pages; p++)
    EXPECT(*word_at(a, p) == value(p, 2));
  for (uint64_t p = 0; p < pages; p++)
    *word_at(a, p) = value(p, 3);

  RtCoherentMemoryStats sa = {.struct_size = sizeof sa}, sb = {.struct_size = sizeof sb};
  CHECK(rt_coherent_memory_stats(a, &sa));
  CHECK(rt_coherent_memory_stats(b, &sb));
  EXPECT(sa.write_faults == pages && sb.read_faults == pages);
  EXPECT(sb.upgrade_faults == pages && sa.downgrades >= pages && sb.invalidations >= pages);
  EXPECT(sa.fault_errors == 0 && sb.fault_errors == 0 && sa.lost == 0);

  /* a hands every page back (they are its, modified), then goes away:
   * nothing it wrote is lost. */
  uint64_t dropped = 0;
  CHECK(rt_coherent_memory_evict(a, 0, size, &dropped));
  EXPECT(dropped == pages);
  rt_coherent_memory_destroy(a);
  for (uint64_t p = 0; p < pages; p++) {
    CHECK(rt_coherent_memory_acquire(b, p * PAGE, 0));
    EXPECT(*word_at(b, p) == value(p, 3));
  }
  rt_coherent_memory_destroy(b);
  rt_manager_destroy(m);
  printf("c coherent: ok (%" PRIu64 " pages, a: %" PRIu64 " requests, b: %" PRIu64
         " requests, %" PRIu64 " upgrades)\n",
         pages, sa.requests, sb.requests, sb.upgrade_faults);
  return 0;
}
