/* Guest RAM in a memfd the C program owns, through the C API, against a
 * running cluster.
 *
 *   shared <coordinator-url> <bytes> <cluster-key-file> memfd|handover
 *
 * memfd: the region maps the program's memfd (at an offset) itself.
 * handover: the program opens its own userfaultfd (UFFDIO_API with the
 * features the region needs), maps the memfd MAP_SHARED, registers the
 * mapping and hands both over; guest memory is that mapping. A descriptor
 * without the features, one that is no userfaultfd and a mapping of the
 * wrong part of the file are refused first.
 *
 * Every page of [0, bytes) is first written to its owner through the
 * manager, then read through guest memory (faulted in from the owner) and
 * checked there and through the program's own mapping of the memfd;
 * rewritten through guest memory, flushed and checked through the own
 * mapping and rt_manager_read_page; evicted, faulted back in and checked
 * again. Bad shared-file configs are refused with their reason. Prints
 * "c shared: ok" and exits 0 on success. */
#define _GNU_SOURCE
#include "rdma_transport.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/userfaultfd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PAGE 4096u
/* Where the region starts in the memfd: the file's first pages are not
 * guest RAM. */
#define OFFSET (4 * PAGE)

#ifndef UFFD_FEATURE_POISON
#define UFFD_FEATURE_POISON (1 << 14)
#endif

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

#define SYS(call)                                                            \
  do {                                                                       \
    if ((call) < 0) {                                                        \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,          \
              strerror(errno));                                              \
      return 1;                                                              \
    }                                                                        \
  } while (0)

/* The 64-bit word i of page `page` in version `round` of the contents. */
static uint64_t word(uint64_t page, uint64_t i, uint64_t round) {
  return (page + 1) * 0x9e3779b97f4a7c15ull ^ i * 0xbf58476d1ce4e5b9ull ^ round << 56;
}

static void fill(uint8_t *page_buf, uint64_t page, uint64_t round) {
  for (uint64_t i = 0; i < PAGE / 8; i++) {
    uint64_t w = word(page, i, round);
    memcpy(page_buf + i * 8, &w, 8);
  }
}

/* 1 if the 4096 bytes at `p` are page `page` of version `round`, else 0
 * after saying where they differ. */
static int holds(const volatile uint8_t *p, uint64_t page, uint64_t round, const char *where) {
  for (uint64_t i = 0; i < PAGE / 8; i++) {
    uint64_t w;
    memcpy(&w, (const uint8_t *)p + i * 8, 8);
    if (w != word(page, i, round)) {
      fprintf(stderr, "%s: page %" PRIu64 " word %" PRIu64 " is %#" PRIx64 ", not %#" PRIx64
              " (round %" PRIu64 ")\n", where, page, i, w, word(page, i, round), round);
      return 0;
    }
  }
  return 1;
}

/* How many descriptors of this process are `target` (a /proc/self/fd link
 * such as "/memfd:c-guest-ram (deleted)" or "anon_inode:[userfaultfd]"),
 * -1 on error. */
static int open_fds_of(const char *target) {
  DIR *dir = opendir("/proc/self/fd");
  if (dir == NULL) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(dir)) != NULL) {
    if (e->d_name[0] == '.') continue;
    char link[256];
    ssize_t len = readlinkat(dirfd(dir), e->d_name, link, sizeof link - 1);
    if (len < 0) continue; /* the directory's own descriptor, gone already */
    link[len] = '\0';
    if (strcmp(link, target) == 0) n++;
  }
  closedir(dir);
  return n;
}

#define MEMFD_LINK "/memfd:c-guest-ram (deleted)"
#define UFFD_LINK "anon_inode:[userfaultfd]"

/* The VMM's own userfaultfd with `features` enabled, its `len` bytes at
 * `mapping` registered for MISSING faults (`mapping` NULL: not
 * registered); -1 on error. */
static int vmm_uffd(uint64_t features, void *mapping, uint64_t len) {
  /* Kernel-mode faults too (no UFFD_USER_MODE_ONLY): fault_mode stays
   * RT_FAULT_MODE_KERNEL_AND_USER. */
  int uffd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
  if (uffd < 0) {
    perror("userfaultfd");
    return -1;
  }
  struct uffdio_api api = {.api = UFFD_API, .features = features};
  if (ioctl(uffd, UFFDIO_API, &api) < 0) {
    perror("UFFDIO_API");
    close(uffd);
    return -1;
  }
  struct uffdio_register reg = {
      .range = {.start = (uintptr_t)mapping, .len = len},
      .mode = UFFDIO_REGISTER_MODE_MISSING,
  };
  if (mapping != NULL && ioctl(uffd, UFFDIO_REGISTER, &reg) < 0) {
    perror("UFFDIO_REGISTER");
    close(uffd);
    return -1;
  }
  return uffd;
}

/* What a handed-over userfaultfd must have enabled (POISON only for
 * RT_SIGBUS_METHOD_POISON; the default falls back to tgkill without it). */
#define HANDOVER_FEATURES                                                    \
  (UFFD_FEATURE_PAGEFAULT_FLAG_WP | UFFD_FEATURE_THREAD_ID |                 \
   UFFD_FEATURE_MISSING_SHMEM | UFFD_FEATURE_MINOR_SHMEM |                   \
   UFFD_FEATURE_WP_HUGETLBFS_SHMEM)

int main(int argc, char **argv) {
  if (argc != 5 || (strcmp(argv[4], "memfd") != 0 && strcmp(argv[4], "handover") != 0)) {
    fprintf(stderr, "usage: %s <coordinator-url> <bytes> <cluster-key-file> memfd|handover\n",
            argv[0]);
    return 2;
  }
  int handover = strcmp(argv[4], "handover") == 0;
  uint64_t size = strtoull(argv[2], NULL, 0);
  uint64_t pages = size / PAGE;

  RtManagerConfig mc;
  rt_manager_config_default(&mc);
  mc.coordinator_url = argv[1];
  mc.cluster_key_file = argv[3];
  RtManager *m = NULL;
  CHECK(rt_manager_connect(&mc, &m));

  /* Round 1 of every page at its owner, read back before going on. */
  static uint8_t page[PAGE], back[PAGE];
  for (uint64_t p = 0; p < pages; p++) {
    fill(page, p, 1);
    CHECK(rt_manager_write_page(m, p * PAGE, page));
    CHECK(rt_manager_read_page(m, p * PAGE, back));
    EXPECT(memcmp(page, back, PAGE) == 0);
  }

  /* The program's memfd, its own view of the whole file. */
  int fd = memfd_create("c-guest-ram", MFD_CLOEXEC);
  SYS(fd);
  SYS(ftruncate(fd, OFFSET + size));
  uint8_t *view = mmap(NULL, OFFSET + size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  EXPECT(view != MAP_FAILED);
  const uint8_t *view_ram = view + OFFSET;

  RtGuestMemoryConfig gc;
  rt_guest_memory_config_default(&gc);
  EXPECT(gc.shared_fd == -1 && gc.handed_over_uffd == -1);
  EXPECT(gc.shared_offset_bytes == 0 && gc.handed_over_mapping == NULL);
  gc.gpa_base = 0;
  gc.size_bytes = size;
  RtGuestMemory *g = NULL;

  /* Bad shared files, refused with their reason. */
  int small = memfd_create("c-small", MFD_CLOEXEC);
  SYS(small);
  SYS(ftruncate(small, size / 2));
  gc.shared_fd = small;
  EXPECT(rt_guest_memory_create(m, &gc, &g) == RT_STATUS_INVALID_ARGUMENT && g == NULL);
  EXPECT(strstr(rt_last_error(), "ftruncate") != NULL);
  close(small);
  int ends[2];
  SYS(pipe(ends));
  gc.shared_fd = ends[0];
  EXPECT(rt_guest_memory_create(m, &gc, &g) == RT_STATUS_INVALID_ARGUMENT && g == NULL);
  EXPECT(strstr(rt_last_error(), "not shared memory") != NULL);
  close(ends[0]);
  close(ends[1]);
  gc.shared_fd = -2;
  EXPECT(rt_guest_memory_create(m, &gc, &g) == RT_STATUS_INVALID_ARGUMENT && g == NULL);
  EXPECT(strstr(rt_last_error(), "shared_fd is -2") != NULL);
  gc.shared_fd = fd;
  gc.shared_offset_bytes = OFFSET + 100;
  EXPECT(rt_guest_memory_create(m, &gc, &g) == RT_STATUS_INVALID_ARGUMENT && g == NULL);
  gc.shared_offset_bytes = OFFSET;
  gc.handed_over_mapping = view;
  EXPECT(rt_guest_memory_create(m, &gc, &g) == RT_STATUS_INVALID_ARGUMENT && g == NULL);
  EXPECT(strstr(rt_last_error(), "handed_over_uffd is -1") != NULL);
  gc.handed_over_mapping = NULL;

  uint8_t *vmm_map = NULL;
  int uffd = -1;
  if (handover) {
    vmm_map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, OFFSET);
    EXPECT(vmm_map != MAP_FAILED);
    /* A handshake without the shared-memory features: the kernel may have
     * them, this descriptor does not. */
    int basic = vmm_uffd(UFFD_FEATURE_PAGEFAULT_FLAG_WP | UFFD_FEATURE_THREAD_ID, NULL, 0);
    EXPECT(basic >= 0);
    gc.handed_over_uffd = basic;
    gc.handed_over_mapping = vmm_map;
    EXPECT(rt_guest_memory_create(m, &gc, &g) == RT_STATUS_UNSUPPORTED && g == NULL);
    EXPECT(strstr(rt_last_error(), "MINOR_SHMEM") != NULL);
    close(basic);
    /* Not a userfaultfd at all. */
    gc.handed_over_uffd = fd;
    EXPECT(rt_guest_memory_create(m, &gc, &g) == RT_STATUS_INVALID_ARGUMENT && g == NULL);
    EXPECT(strstr(rt_last_error(), "not a usable userfaultfd") != NULL);

    uffd = vmm_uffd(HANDOVER_FEATURES, vmm_map, size);
    EXPECT(uffd >= 0);
    gc.handed_over_uffd = uffd;
    /* A mapping of the file at another offset (0, not OFFSET). */
    gc.handed_over_mapping = view;
    EXPECT(rt_guest_memory_create(m, &gc, &g) == RT_STATUS_INVALID_ARGUMENT && g == NULL);
    EXPECT(strstr(rt_last_error(), "not the shared file") != NULL);
    /* The mapping is required with the userfaultfd. */
    gc.handed_over_mapping = NULL;
    EXPECT(rt_guest_memory_create(m, &gc, &g) == RT_STATUS_INVALID_ARGUMENT && g == NULL);
    EXPECT(strstr(rt_last_error(), "handed_over_mapping is NULL") != NULL);
    gc.handed_over_mapping = vmm_map;
  }
  /* Every refused config closed the duplicates it made. */
  EXPECT(open_fds_of(MEMFD_LINK) == 1);
  EXPECT(open_fds_of(UFFD_LINK) == (handover ? 1 : 0));
  /* The caller's descriptors stay the caller's: created from copies that
   * are closed right after the call, the region keeps its own. */
  int fd_copy = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  SYS(fd_copy);
  gc.shared_fd = fd_copy;
  int uffd_copy = -1;
  if (handover) {
    uffd_copy = fcntl(uffd, F_DUPFD_CLOEXEC, 0);
    SYS(uffd_copy);
    gc.handed_over_uffd = uffd_copy;
  }
  CHECK(rt_guest_memory_create(m, &gc, &g));
  close(fd_copy);
  if (handover) close(uffd_copy);
  EXPECT(open_fds_of(MEMFD_LINK) >= 2);
  volatile uint8_t *ram = rt_guest_memory_host_addr(g);
  EXPECT(ram != NULL && rt_guest_memory_size(g) == size);
  if (handover) EXPECT(ram == vmm_map);
  /* Dirty tracking: PAGEMAP_SCAN on the region's own userfaultfd (Linux >=
   * 6.7), write-protect faults on a handed-over one. */
  EXPECT(rt_guest_memory_dirty_tracking(g) ==
         (handover ? RT_DIRTY_TRACKING_WRITE_FAULTS : RT_DIRTY_TRACKING_PAGEMAP_SCAN));
  /* This host's kernel write-protects shared memory (Linux >= 5.19). */
  EXPECT(rt_guest_memory_tracks_writes(g) == 1);
  EXPECT(rt_guest_memory_tracks_writes(NULL) == 0);

  /* Round 1 through guest memory: every page faulted in from its owner,
   * straight into the file. */
  for (uint64_t p = 0; p < pages; p++) EXPECT(holds(ram + p * PAGE, p, 1, "guest, round 1"));
  for (uint64_t p = 0; p < pages; p++) EXPECT(holds(view_ram + p * PAGE, p, 1, "memfd, round 1"));
  /* The file's pages before the region are untouched. */
  for (uint64_t i = 0; i < OFFSET; i++) EXPECT(view[i] == 0);

  /* Round 2 written through guest memory (every page becomes dirty),
   * flushed, and found in the file and at the owners. */
  for (uint64_t p = 0; p < pages; p++) {
    fill(page, p, 2);
    memcpy((uint8_t *)ram + p * PAGE, page, PAGE);
  }
  uint64_t written = 0;
  CHECK(rt_guest_memory_flush(g, &written));
  EXPECT(written == pages);
  for (uint64_t p = 0; p < pages; p++) {
    EXPECT(holds(view_ram + p * PAGE, p, 2, "memfd, round 2"));
    CHECK(rt_manager_read_page(m, p * PAGE, back));
    EXPECT(holds(back, p, 2, "owner, round 2"));
  }
  /* Nothing left to write. */
  CHECK(rt_guest_memory_flush(g, &written));
  EXPECT(written == 0);

  /* Evicted (written back first, nothing dirty here), then faulted back in
   * from the owners, in reverse order. */
  uint64_t dropped = 0;
  CHECK(rt_guest_memory_evict(g, 0, size, &dropped));
  EXPECT(dropped == pages);
  for (uint64_t p = pages; p-- > 0;) EXPECT(holds(ram + p * PAGE, p, 2, "guest, refaulted"));
  for (uint64_t p = 0; p < pages; p++) EXPECT(holds(view_ram + p * PAGE, p, 2, "memfd, refaulted"));

  /* Round 3 of the last page through the copy helpers. */
  uint64_t last = pages - 1;
  fill(page, last, 3);
  CHECK(rt_guest_memory_write(g, last * PAGE, page, PAGE));
  CHECK(rt_guest_memory_read(g, last * PAGE, back, PAGE));
  EXPECT(holds(back, last, 3, "guest read, round 3"));
  CHECK(rt_guest_memory_flush(g, &written));
  EXPECT(written == 1);
  EXPECT(holds(view_ram + last * PAGE, last, 3, "memfd, round 3"));
  CHECK(rt_manager_read_page(m, last * PAGE, back));
  EXPECT(holds(back, last, 3, "owner, round 3"));

  RtGuestMemoryStats stats = {.struct_size = sizeof stats};
  CHECK(rt_guest_memory_stats(g, &stats));
  printf("%s: faults %" PRIu64 ", wp faults %" PRIu64 ", fetched %" PRIu64 ", prefetched %" PRIu64
         ", written back %" PRIu64 " (in place %" PRIu64 "), evicted %" PRIu64 "\n",
         argv[4], stats.missing_faults, stats.wp_faults, stats.pages_fetched, stats.prefetched_pages,
         stats.pages_written_back, stats.pages_written_in_place, stats.pages_evicted);
  EXPECT(stats.pages_fetched + stats.prefetched_pages >= 2 * pages);
  /* Dirty pages: write-protect faults with a handed-over userfaultfd;
   * PAGEMAP_SCAN (no fault) on the region's own one, where the kernel has
   * it (Linux >= 6.7). */
  EXPECT(handover ? stats.wp_faults >= 1 : stats.wp_faults == 0);
  EXPECT(stats.pages_written_back == pages + 1);
  EXPECT(stats.pages_evicted == pages);
  EXPECT(stats.fault_errors == 0 && stats.sigbus_raised == 0);

  rt_guest_memory_destroy(g);
  /* The region closed its duplicates (and its own userfaultfd); the
   * program's descriptors are still open, and the file keeps the last
   * round. */
  EXPECT(open_fds_of(MEMFD_LINK) == 1);
  EXPECT(open_fds_of(UFFD_LINK) == (handover ? 1 : 0));
  SYS(fcntl(fd, F_GETFD));
  if (handover) SYS(fcntl(uffd, F_GETFD));
  EXPECT(holds(view_ram + last * PAGE, last, 3, "memfd after destroy"));
  if (handover) {
    munmap(vmm_map, size);
    close(uffd);
  }
  munmap(view, OFFSET + size);
  close(fd);
  rt_manager_destroy(m);
  printf("c shared: ok\n");
  return 0;
}
