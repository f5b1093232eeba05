/* C smoke test of the rdma-transport C API against a running cluster.
 *
 *   smoke <coordinator-url> <bytes>
 *
 * Maps guest memory over [0, bytes) of the cluster, writes a pattern
 * through the host pointer (faulting pages in), flushes, evicts, checks the
 * owners have it, touches the pages again (faulting them back in) and
 * checks them, and exercises page I/O, error codes and error strings.
 * Prints "c smoke: ok" and exits 0 on success. */
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
      fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond);    \
      return 1;                                                              \
    }                                                                        \
  } while (0)

static uint64_t word(uint64_t page, uint64_t i) {
  return (page + 1) * 0x9e3779b97f4a7c15ull ^ i * 0xbf58476d1ce4e5b9ull;
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
  CHECK(rt_manager_connect(&mc, &m));

  /* Page I/O straight through the manager. */
  uint8_t page[PAGE], back[PAGE];
  for (unsigned i = 0; i < PAGE; i++) page[i] = (uint8_t)(i * 7);
  CHECK(rt_manager_write_page(m, 3 * PAGE, page));
  CHECK(rt_manager_read_page(m, 3 * PAGE, back));
  EXPECT(memcmp(page, back, PAGE) == 0);

  /* Typed errors and their strings. */
  EXPECT(rt_manager_read_page(m, 0x10, back) == RT_STATUS_UNALIGNED);
  EXPECT(strlen(rt_last_error()) > 0);
  EXPECT(strcmp(rt_status_str(RT_STATUS_UNALIGNED), "address not page aligned") == 0);
  EXPECT(strcmp(rt_status_str(999), "unknown status") == 0);
  EXPECT(rt_manager_read_page(m, size + PAGE, back) == RT_STATUS_UNKNOWN_GPA);

  /* Guest memory over the whole cluster. */
  RtGuestMemoryConfig gc;
  rt_guest_memory_config_default(&gc);
  EXPECT(gc.struct_size == sizeof gc);
  EXPECT(gc.fault_mode == RT_FAULT_MODE_KERNEL_AND_USER);
  gc.gpa_base = 0;
  gc.size_bytes = size;
  gc.pin_handlers = 0;
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

  RtGuestMemoryStats stats;
  CHECK(rt_guest_memory_stats(g, &stats));
  printf("faults %" PRIu64 ", prefetched %" PRIu64 ", written back %" PRIu64 "\n",
         stats.missing_faults, stats.prefetched_pages, stats.pages_written_back);
  EXPECT(stats.missing_faults + stats.prefetched_pages >= 2 * pages);

  rt_guest_memory_destroy(g);
  rt_manager_destroy(m);
  printf("c smoke: ok\n");
  return 0;
}
