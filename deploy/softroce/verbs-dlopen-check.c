/*
 * Selftest helper: load libibverbs the way the Rust transport does, with
 * dlopen("libibverbs.so.1") at run time (no link-time dependency), list the
 * devices and open each one. Proves the loader inside the VM finds the
 * library and that the rxe provider is picked up.
 *
 * Prints "VERBS_DEVICE <name> opened" per device; exits 0 when at least
 * one device opened, 1 when none, 2 when the library cannot be loaded.
 */
#include <dlfcn.h>
#include <stdio.h>

struct ibv_device;
struct ibv_context;

typedef struct ibv_device **(*get_device_list_fn)(int *num_devices);
typedef void (*free_device_list_fn)(struct ibv_device **list);
typedef const char *(*get_device_name_fn)(struct ibv_device *device);
typedef struct ibv_context *(*open_device_fn)(struct ibv_device *device);
typedef int (*close_device_fn)(struct ibv_context *context);

int main(void)
{
    void *lib = dlopen("libibverbs.so.1", RTLD_NOW);
    if (lib == NULL) {
        fprintf(stderr, "dlopen(libibverbs.so.1): %s\n", dlerror());
        return 2;
    }
    get_device_list_fn get_device_list =
        (get_device_list_fn)dlsym(lib, "ibv_get_device_list");
    free_device_list_fn free_device_list =
        (free_device_list_fn)dlsym(lib, "ibv_free_device_list");
    get_device_name_fn get_device_name =
        (get_device_name_fn)dlsym(lib, "ibv_get_device_name");
    open_device_fn open_device = (open_device_fn)dlsym(lib, "ibv_open_device");
    close_device_fn close_device = (close_device_fn)dlsym(lib, "ibv_close_device");
    if (!get_device_list || !free_device_list || !get_device_name || !open_device ||
        !close_device) {
        fprintf(stderr, "dlsym: a verbs entry point is missing\n");
        return 2;
    }

    int num_devices = 0;
    struct ibv_device **devices = get_device_list(&num_devices);
    if (devices == NULL) {
        perror("ibv_get_device_list");
        return 1;
    }
    int opened = 0;
    for (int i = 0; i < num_devices; i++) {
        const char *name = get_device_name(devices[i]);
        struct ibv_context *context = open_device(devices[i]);
        if (context == NULL) {
            printf("VERBS_DEVICE %s open_failed\n", name);
            continue;
        }
        printf("VERBS_DEVICE %s opened\n", name);
        close_device(context);
        opened++;
    }
    free_device_list(devices);
    return opened > 0 ? 0 : 1;
}
